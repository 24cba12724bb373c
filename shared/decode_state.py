"""A request's state on a decoder: the phases it moves through and how it ends.

`DecodeRequest` is owned by `DecoderService` (shared/decoder.py), which alone adds and removes
it; the roles' own parts (services/rld, services/md) move its phase and read its fields.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import IntEnum

from shared.messages import DecodeTask, RequestStats
from shared.runtime.kv_payload import KVPayload
from shared.runtime.sequence import Sequence


class Phase(IntEnum):
    PENDING = 0  # task accepted, KV not landed
    PARKED = 1  # KV landed, waiting in host memory for pool room
    RUNNING = 2  # in the batch, streaming tokens
    SHADOW = 3  # md, p-rld-md: in the batch, computing the relay's tokens, streaming nothing
    HANDING_OFF = 4  # relay: sending its tokens to main-decode (catch-up keeps streaming)


class End(IntEnum):
    FINISHED = 0  # its last token went out (or it failed: the final chunk carries the error)
    HANDED_OFF = 1  # relay: main-decode took it over
    ABORTED = 2  # the client went, or another stage failed it (broadcast)
    DROPPED = 3  # only this copy: its KV push failed, the plan changed, or the relay serves it
    FAILED = 4  # its KV never came, or could not be admitted


@dataclass(eq=False)
class DecodeRequest:
    task: DecodeTask
    accepted_at: float
    phase: Phase = Phase.PENDING
    stats: RequestStats = field(default_factory=RequestStats)
    parked: tuple[Sequence, KVPayload, int] | None = None  # (sequence, KV, prefill's first token)
    error: str = ""
    tasks: set[asyncio.Task] = field(default_factory=set)  # cancelled when the request ends
    md_ready: bool = False  # relay: main-decode holds the KV (KVReady came)
    alone: bool = False  # relay: main-decode will never get it (FinishOnRelay came)
    caught_up: asyncio.Event = field(default_factory=asyncio.Event)  # md: the shadow computed all it was given
    extend_started: float = 0.0  # md: when the final handoff chunk arrived
    cache_only: bool = False  # md: finished on the relay; its KV lands into the prefix cache, then it ends

    @property
    def id(self) -> str:
        return self.task.request_id
