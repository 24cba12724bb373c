"""Load a causal LM for the runtime: a local HF Llama/Qwen-family folder, or a tiny test model."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from shared.runtime import attention  # registers the paged attention implementation
from shared.runtime.kv_pool import KVLayout

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(DTYPES)}") from None


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return torch.device(device)


def load_model(path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu") -> torch.nn.Module:
    """Load a local HF folder with the paged attention implementation, in eval mode."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} is not a Hugging Face model folder (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=parse_dtype(dtype), attn_implementation=attention.ATTN_IMPLEMENTATION
    )
    return model.to(resolve_device(device)).eval()


def load_tokenizer(path: str | Path):
    return AutoTokenizer.from_pretrained(Path(path))


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> LlamaForCausalLM:
    """A small randomly initialised Llama for tests: same code path as the real model."""
    params = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.2,  # wide weights keep greedy choices far from ties
        tie_word_embeddings=False,
    )
    params.update(overrides)
    config = LlamaConfig(**params)
    config._attn_implementation = attention.ATTN_IMPLEMENTATION
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(dtype).eval()


def kv_layout(model: torch.nn.Module) -> KVLayout:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return KVLayout(cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim)


def set_attention(model: torch.nn.Module, name: str) -> None:
    """Switch between the paged kernel and a stock one (the reference `generate()` uses sdpa)."""
    model.set_attn_implementation(name)


class Timer:
    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.ms = (time.perf_counter() - self.t0) * 1000
