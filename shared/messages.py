"""Control-plane messages (msgpack). Named for what they ask of their receiver.

Messages carry ids and changes, never KV (KV travels on the TCP plane, see kv_transport).
Every message is a dataclass; `encode()` gives msgpack bytes and `Cls.decode(data)` rebuilds
it, ignoring unknown fields so a newer sender does not break an older receiver.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack

M = TypeVar("M", bound="Message")


class Message:
    def encode(self) -> bytes:
        return msgpack.packb(dataclasses.asdict(self), use_bin_type=True)

    @classmethod
    def decode(cls: type[M], data: bytes) -> M:
        raw = msgpack.unpackb(data, raw=False)
        if not isinstance(raw, dict):
            raise ValueError(f"{cls.__name__}: expected a map, got {type(raw).__name__}")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls: type[M], raw: dict[str, Any]) -> M:
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name not in raw:
                continue
            value = raw[f.name]
            sub = _NESTED.get((cls.__name__, f.name))
            if sub is not None and value is not None:
                value = [sub.from_dict(v) for v in value] if isinstance(value, list) else sub.from_dict(value)
            kwargs[f.name] = value
        return cls(**kwargs)


@dataclass
class Sampling(Message):
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass
class Submit(Message):
    """gateway -> scheduler: plan and dispatch this request."""

    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    pipeline: str | None = None  # forced plan (observability contract), else the policy's choice
    handoff: str | None = None
    avoid: list[str] = field(default_factory=list)  # instances this request must not use (they died)


@dataclass
class Plan(Message):
    """scheduler -> gateway: what was decided (or why not)."""

    request_id: str
    pipeline: str = ""
    handoff: str = "none"
    prefill: str = ""
    rld: str = ""
    md: str = ""
    md_cached_tokens: int = 0
    reason: str = ""  # why this pipeline (policy.py)
    handoff_reason: str = ""
    chunk_tokens: int = 0  # catch-up chunk size (0: the relay's configured default)
    estimates: dict[str, Any] = field(default_factory=dict)  # the figures the decision rested on
    queue_ms: float = 0.0
    error: str = ""
    status: int = 200  # HTTP status the gateway should use when error is set


@dataclass
class KVTarget(Message):
    """Where prefill pushes KV: a decoder's advertised endpoint, optionally through a WAN link."""

    instance_id: str
    role: str  # "md" or "rld"
    host: str
    port: int
    start: int = 0  # send positions [start, prompt_len): the decoder already holds [0, start)
    via_host: str = ""  # WAN emulator in front of the target ("" = direct)
    via_port: int = 0


@dataclass
class PrefillTask(Message):
    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    targets: list[KVTarget]
    plan: Plan


@dataclass
class DecodeTask(Message):
    """scheduler -> md / rld: expect this request's KV and decode it."""

    request_id: str
    prompt_ids: list[int]
    sampling: Sampling
    plan: Plan


@dataclass
class Ack(Message):
    request_id: str
    ok: bool = True
    error: str = ""
    busy: bool = False  # refused for lack of room, not a fault: the client may retry (429)


@dataclass
class TokenChunk(Message):
    """decoder -> gateway: generated tokens [index, index + len(token_ids)), or the end."""

    request_id: str
    index: int
    token_ids: list[int]
    role: str = ""
    instance_id: str = ""
    finish_reason: str | None = None
    error: str = ""
    stats: dict[str, Any] = field(default_factory=dict)  # set on the final chunk
    blame: str = ""  # with an error: the instance it came from (the gateway moves the request off it)


@dataclass
class Abort(Message):
    request_id: str
    reason: str = "client disconnected"


@dataclass
class KVReady(Message):
    """md -> rld: main-decode holds this request's prompt KV; hand the request over.
    With `md == ""` (from prefill or main-decode): main-decode will not get it; finish on relay."""

    request_id: str
    md: str


@dataclass
class HandoffChunk(Message):
    """rld -> md: generated tokens [start_index, start_index + len(token_ids)), ids only.

    Main-decode recomputes their KV in one extend. A non-final chunk is acked once main-decode
    has caught up with it (relay keeps streaming meanwhile); the final chunk is acked at once,
    relay stops, and main-decode samples from `start_index + len(token_ids)` on — the sampling
    step that a seeded request needs is exactly that index.
    """

    request_id: str
    start_index: int
    token_ids: list[int]
    final: bool = False
    stats: dict[str, Any] = field(default_factory=dict)  # relay's figures, on the final chunk


@dataclass
class Inspect(Message):
    instance_id: str = ""


@dataclass
class InstanceState(Message):
    instance_id: str
    role: str
    requests: list[str] = field(default_factory=list)  # ids this instance still holds anything for
    free_blocks: int = 0
    total_blocks: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class WanSample(Message):
    """decoder -> scheduler: one KV transfer across the WAN, for the bandwidth estimate."""

    nbytes: int
    seconds: float


@dataclass
class WanControl(Message):
    """Change the WAN emulator at run time; None leaves a setting as it is."""

    bandwidth_mbps: float | None = None
    delay_ms: float | None = None
    jitter_ms: float | None = None
    stall_s: float | None = None  # stop forwarding for this long
    drop: bool = False  # cut every open connection now


_NESTED: dict[tuple[str, str], type[Message]] = {
    ("Submit", "sampling"): Sampling,
    ("PrefillTask", "sampling"): Sampling,
    ("PrefillTask", "targets"): KVTarget,
    ("PrefillTask", "plan"): Plan,
    ("DecodeTask", "sampling"): Sampling,
    ("DecodeTask", "plan"): Plan,
}
