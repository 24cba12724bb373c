"""Hardware profiles: what one chip costs in time and money for one model.

A profile is a handful of coefficients of simple, physically motivated cost models (all ms):

    prefill_ms(new, cached) = prefill_fixed_ms + new * prefill_ms_per_token
                              + new * (cached + new / 2) * prefill_ms_per_token_ctx
        (a forward over `new` prompt tokens: launch/framework cost, per-token GEMMs, and
         attention of each new token over its context, quadratic in the prompt)
    step_ms(batch, context, extra) = step_fixed_ms + batch * step_ms_per_seq
                                     + context * step_ms_per_ctx_token + extra * step_ms_per_extra_token
        (one decode step of the flattened batch: weights read once per step, per-sequence
         overhead, KV read for every context token in the batch, and any extra tokens an extend
         or handoff chunk adds to the same forward)
    kv_io_ms(tokens) = tokens * kv_io_ms_per_token
        (export from the sender's pool and import into the receiver's: host copies and dtype
         conversion, paid once per KV transfer on top of the wire time)

plus the KV pool (`kv_tokens`), bytes of KV per token (`kv_bytes_per_token`, the model's), the
price per hour and the decoder batch limit (`max_running`). Profiles live in YAML (see
configs/sim/profiles.yaml, where every number names its source); `measure` (sim/measure.py)
writes one for this machine from our own runtime.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml


@dataclass(frozen=True)
class ChipProfile:
    name: str
    kv_bytes_per_token: int
    kv_tokens: int
    price_per_hour: float = 1.0
    max_running: int = 32
    prefill_fixed_ms: float = 0.0
    prefill_ms_per_token: float = 1.0
    prefill_ms_per_token_ctx: float = 0.0
    step_fixed_ms: float = 10.0
    step_ms_per_seq: float = 0.0
    step_ms_per_ctx_token: float = 0.0
    step_ms_per_extra_token: float = 0.0
    kv_io_ms_per_token: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, int | float) and value < 0:
                raise ValueError(f"profile {self.name!r}: {f.name} must be >= 0, got {value!r}")
        if self.kv_bytes_per_token <= 0 or self.kv_tokens <= 0 or self.max_running < 1:
            raise ValueError(f"profile {self.name!r}: kv_bytes_per_token, kv_tokens, max_running must be > 0")

    def prefill_ms(self, new: int, cached: int = 0) -> float:
        if new <= 0:
            return 0.0
        return (
            self.prefill_fixed_ms
            + new * self.prefill_ms_per_token
            + new * (cached + new / 2) * self.prefill_ms_per_token_ctx
        )

    def prefill_tok_s(self, new: int = 1024, cached: int = 0) -> float:
        """Throughput at a typical prompt: what a prefill instance would report as measured."""
        return new / self.prefill_ms(new, cached) * 1000.0

    def step_ms(self, batch: int, context: int, extra: int = 0) -> float:
        return (
            self.step_fixed_ms
            + batch * self.step_ms_per_seq
            + context * self.step_ms_per_ctx_token
            + extra * self.step_ms_per_extra_token
        )

    def kv_io_ms(self, tokens: int) -> float:
        return max(tokens, 0) * self.kv_io_ms_per_token


def profile_from_dict(name: str, raw: dict[str, Any]) -> ChipProfile:
    known = {f.name for f in fields(ChipProfile)}
    values = {k: v for k, v in raw.items() if k in known and k != "name"}
    unknown = sorted(set(raw) - known - {"sources"})
    if unknown:
        raise ValueError(f"profile {name!r}: unknown field(s) {unknown}")
    return ChipProfile(name=name, **values)


def load_profiles(path: str | Path) -> dict[str, ChipProfile]:
    """Every profile in a YAML file: `{profiles: {name: {field: value, ...}}}`."""
    raw = yaml.safe_load(Path(path).read_text()) or {}
    return {name: profile_from_dict(name, body) for name, body in (raw.get("profiles") or {}).items()}
