"""Model provisioning and loading."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from shared.runtime.models import kv_layout, load_model, parse_dtype


def test_model_dir_command_prints_a_loadable_folder(smol_dir):
    out = subprocess.run(
        [sys.executable, "-m", "pdd.cli", "model-dir"], capture_output=True, text=True, check=True, timeout=300
    )
    folder = out.stdout.strip()
    assert folder == str(smol_dir)
    config = json.loads((smol_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= {p.name for p in smol_dir.iterdir()}


def test_provisioned_folder_loads_fast(smol_dir):
    t0 = time.perf_counter()
    model = load_model(smol_dir)
    elapsed = time.perf_counter() - t0
    assert kv_layout(model).bytes_per_token(parse_dtype("fp32")) == 46_080
    assert elapsed < 15, f"loading the provisioned folder took {elapsed:.1f}s"  # GGUF takes ~25 s


def test_the_folder_is_a_standard_checkpoint_every_parameter_by_name(smol_dir):
    """A strict load of the saved tensors into a fresh model finds every parameter, the tied
    embedding included (it was once saved only as lm_head.weight, and vLLM then ran with an
    uninitialised embedding); both names hold the same values."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    tensors = load_file(str(smol_dir / "model.safetensors"))
    fresh = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(smol_dir))
    fresh.load_state_dict(tensors, strict=True)  # raises on a missing or unexpected key
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= tensors.keys()
    assert torch.equal(tensors["model.embed_tokens.weight"], tensors["lm_head.weight"])
    assert torch.equal(fresh.model.embed_tokens.weight, load_model(smol_dir).model.embed_tokens.weight)


def test_bf16_load(smol_dir):
    model = load_model(smol_dir, dtype="bf16")
    assert next(model.parameters()).dtype == parse_dtype("bfloat16")


def test_bad_inputs_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="float8"):
        parse_dtype("float8")
