"""Model facts, read from the model folder's JSON files: no torch, no transformers.

The gateway, the scheduler and the command line need the model's shape (KV bytes per token,
context length, vocabulary size, end-of-sequence ids) but never its weights; importing torch
would cost them seconds and hundreds of MB. The engine services load the weights themselves
(shared/runtime/models.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


class WireFormat(StrEnum):
    """How KV may travel (shared/runtime/kv_wire.py): the one home of these names."""

    NATIVE = "native"  # what the receiver stores, bit for bit (link_wire)
    BF16 = "bf16"
    FP8 = "fp8"  # with a float32 scale per token and head
    INT8 = "int8"  # with a float32 scale per token and head

    @property
    def scaled(self) -> bool:
        return self in (WireFormat.FP8, WireFormat.INT8)


WIRE_FORMATS: tuple[str, ...] = tuple(w.value for w in WireFormat)
AUTO_WIRE = "auto"  # the scheduler narrows the WAN's wire format only as far as the SLO needs


def parse_wire(name: str, allow_auto: bool = False) -> str:
    """`name` if it is a wire format (or `auto`, where allowed); ValueError naming the choices."""
    choices = (*WIRE_FORMATS, AUTO_WIRE) if allow_auto else WIRE_FORMATS
    if name not in choices:
        raise ValueError(f"unknown KV wire format {name!r}; one of {', '.join(choices)}")
    return name


def link_wire(wire: str, sender_dtype: str, receiver_dtype: str) -> str:
    """The format a push travels in: `native` from a float32 pool into a bfloat16 one goes as
    `bf16`, the very bits the receiver's pool would round it to on import (the same rounding,
    to nearest even), in half the bytes. Every other choice travels as chosen."""
    if wire == WireFormat.NATIVE and sender_dtype == "float32" and receiver_dtype == "bfloat16":
        return WireFormat.BF16
    return wire


def wire_bytes(tokens: int, kv_heads: int, head_dim: int, dtype: str, wire: str) -> int:
    """Bytes of one layer's K and V for `tokens` in wire format `wire` from a `dtype` pool."""
    w = WireFormat(parse_wire(wire))
    element = ITEMSIZE[dtype] if w == WireFormat.NATIVE else 2 if w == WireFormat.BF16 else 1
    return 2 * tokens * kv_heads * (head_dim * element + (4 if w.scaled else 0))


DEFAULT_MODEL_NAME = "smollm2-135m-instruct"  # provisioned by shared/runtime/provision.py


def default_model_dir() -> Path:
    """`$PDD_MODEL_CACHE/smollm2-135m-instruct` (default `~/.cache/pdd/models/...`)."""
    root = os.environ.get("PDD_MODEL_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "pdd" / "models") / DEFAULT_MODEL_NAME


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    num_layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    context_len: int
    eos_token_ids: tuple[int, ...]

    @property
    def name(self) -> str:
        """What clients call the model (the OpenAI `model` field)."""
        return self.path.name

    def kv_bytes_per_token(self, dtype: str = "float32", wire: str = "native") -> int:
        """KV bytes of one token from a pool of `dtype` (K and V, every layer), as `wire` carries it."""
        return self.num_layers * wire_bytes(1, self.kv_heads, self.head_dim, dtype, wire)


def model_path(model: str) -> Path:
    """The folder of the config's `model` ("default" = the provisioned SmolLM2)."""
    return default_model_dir() if model == "default" else Path(model)


def model_name(model: str) -> str:
    """What clients and metrics call the model (its folder's name), without reading it."""
    return model_path(model).name


def load_model_info(model: str) -> ModelInfo:
    path = model_path(model)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        hint = "; run `pdd model-dir` to provision it" if model == "default" else ""
        raise FileNotFoundError(f"no model at {path} (config.json missing){hint}") from None
    generation = path / "generation_config.json"
    eos = json.loads(generation.read_text()).get("eos_token_id") if generation.exists() else None
    eos = cfg.get("eos_token_id") if eos is None else eos
    heads = cfg["num_attention_heads"]
    return ModelInfo(
        path=path,
        num_layers=cfg["num_hidden_layers"],
        kv_heads=cfg.get("num_key_value_heads", heads),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        context_len=int(cfg.get("max_position_embeddings", 2048)),
        eos_token_ids=tuple(eos if isinstance(eos, list) else [] if eos is None else [eos]),
    )
