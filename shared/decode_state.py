"""A request's state on a decoder: the phases it moves through and how it ends.

`DecodeRequest` is owned by `DecoderService` (shared/decoder.py), which alone adds and removes
it; the roles' own parts (services/rld, services/md) move its phase and read its fields.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import IntEnum

from shared.kv_transport import FirstToken
from shared.messages import DecodeTask, Logprob, RequestStats, TokenChunk
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


@dataclass
class Replay:
    """What a decoder sent of one request, to send again when the gateway lost a chunk (core
    NATS is at-most-once): its tokens from `start` on, and its final chunk once it ended."""

    start: int = -1  # index of the first token sent (-1: none yet)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] | None = None  # theirs, when the request asked for them
    final: TokenChunk | None = None

    def record(self, chunk: TokenChunk) -> None:
        if chunk.token_ids:
            if self.start < 0:
                self.start = chunk.index
            if chunk.index == self.start + len(self.token_ids):  # in order: one step's token after another
                self.token_ids += chunk.token_ids
                if chunk.logprobs is not None and len(self.logprobs or []) + len(chunk.logprobs) == len(self.token_ids):
                    self.logprobs = (self.logprobs or []) + chunk.logprobs
        if chunk.finish_reason is not None or chunk.error:
            self.final = chunk

    def since(self, request_id: str, index: int, role: str, instance_id: str) -> TokenChunk:
        """One chunk with every token sent from `index` on (and the end, if it ended)."""
        base = self.start if self.start >= 0 else max(index, 0)
        first = max(index, base)
        end = self.final
        aligned = self.logprobs is not None and len(self.logprobs) == len(self.token_ids)
        return TokenChunk(
            request_id,
            first,
            self.token_ids[first - base :],
            logprobs=self.logprobs[first - base :] if aligned else None,
            role=role,
            instance_id=instance_id,
            finish_reason=end.finish_reason if end else None,
            error=end.error if end else "",
            stats=end.stats if end else None,
            blame=end.blame if end else "",
        )


@dataclass(eq=False)
class DecodeRequest:
    task: DecodeTask
    accepted_at: float
    phase: Phase = Phase.PENDING
    stats: RequestStats = field(default_factory=RequestStats)
    parked: tuple[Sequence, KVPayload, FirstToken] | None = None  # (sequence, KV, prefill's first token)
    error: str = ""
    tasks: set[asyncio.Task] = field(default_factory=set)  # cancelled when the request ends
    md_ready: bool = False  # relay: main-decode holds the KV (KVReady came)
    alone: bool = False  # relay: main-decode will never get it (FinishOnRelay came)
    caught_up: asyncio.Event = field(default_factory=asyncio.Event)  # md: the shadow computed all it was given
    extend_started: float = 0.0  # md: when the final handoff chunk arrived
    handed_over: bool = False  # md: the final handoff chunk was taken (a resent one is acked again)
    cache_only: bool = False  # md: finished on the relay; its KV lands into the prefix cache, then it ends
    replay: Replay = field(default_factory=Replay)  # what went out, to send again if asked (`Resend`)

    @property
    def id(self) -> str:
        return self.task.request_id
