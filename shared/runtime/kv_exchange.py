"""KV that crosses instances enters and leaves an engine here, so that only the runtime
allocates, frees or caches blocks (`Engine` is a `KVExchange`; the services call these through
`EngineWorker.call`, on the engine thread):

    decoder     admit_with_kv        prefill's KV [start, n) stitched onto the cached prefix
    prefill     export_part          a prompt's KV chunk as it is computed (a streaming push)
    prefill     export_and_release   a finished prompt's KV (the rest) copied out, its blocks freed
    relay       generated            the tokens it streamed so far (what a handoff chunk sends)
    md          extend_shadow        the relay's tokens appended to a shadow (one extend computes them)
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import torch

from shared.runtime.kv_payload import KVPayload, export_kv, import_kv, valid_start
from shared.runtime.kv_pool import KVPool, PoolExhausted
from shared.runtime.radix_cache import RadixCache
from shared.runtime.sequence import Sequence
from shared.runtime.stops import StopRules


class Admission(NamedTuple):
    """How a sequence that arrived with KV joined: `finish_reason` when prefill's first token
    already ends it (nothing to decode), `error` when it can never join (it holds nothing)."""

    finish_reason: str | None
    error: str = ""


class NotHeld(LookupError):
    """The sequence holds no exported KV here (it was aborted meanwhile)."""


class KVExchange:
    """The engine's KV commands across instances. `Engine` supplies the state and the admission."""

    pool: KVPool
    cache: RadixCache | None
    stops: StopRules
    waiting: deque[Sequence]
    running: dict[str, Sequence]
    held: dict[str, Sequence]

    def add(self, seq: Sequence) -> None: ...
    def find(self, seq_id: str) -> Sequence | None: ...
    def release(self, seq_id: str) -> None: ...
    def match_prefix(self, seq: Sequence, max_tokens: int) -> None: ...
    def count_prefix(self, seq: Sequence) -> None: ...
    def _never_fits(self, seq: Sequence) -> str: ...
    def _reserve(self, seq: Sequence) -> None: ...

    def admit_with_kv(self, arrivals: list[tuple[Sequence, KVPayload]]) -> list[Admission]:
        """Sequences whose prompt KV arrived from prefill join the batch, oldest first, until one
        does not fit now: it and those after it get no result and are offered again once blocks
        free. One that can never join (too big, bad KV) gets its error; the rest go on."""
        results = []
        for seq, payload in arrivals:
            try:
                results.append(Admission(self._stitch(seq, payload)))
            except PoolExhausted:
                break
            except Exception as e:
                results.append(Admission(None, str(e)))
        return results

    def _stitch(self, seq: Sequence, payload: KVPayload) -> str | None:
        """Stitch the arriving KV [start, n) onto the cached prefix [0, start) and join the batch.
        Returns the finish reason when prefill's first token (the last of `token_ids`) ends it.

        If part of [0, start) was evicted since the plan was made, the missing range is recomputed
        from its token ids before anything is decoded (never decode on incomplete KV); if the cache
        meanwhile holds more than [0, start), that part of the payload is not imported.

        A migrated attempt (`Sampling.resumed`) is stitched only up to where its earlier output
        begins, and carries no first token: that output's KV was computed by a decoder, in its
        precision, so this engine computes it again (one extend, equal to its decode steps bit
        for bit) and samples the next token itself; prefill's float32 copy of it would change the
        answer in a mixed-precision fleet.
        """
        resumed = seq.params.resumed
        if not resumed and (reason := self.stops.reason(seq, seq.token_ids[-1])) is not None:
            return reason
        start, n, bs = payload.header.start, seq.prompt_len, self.pool.block_size
        end = n - resumed  # [0, end) is prompt: from the cache or the payload; [end, n) computed here
        if not valid_start(start, n, bs):
            raise ValueError(f"KV starts at {start}, not on a block boundary of {bs} nor at the prompt's end")
        if error := self._never_fits(seq):
            raise ValueError(error)
        # [0, hit) from this engine's own cache, all of it: a copy landing beside cached blocks of
        # the same prefix would hang new cache nodes under nodes this sequence does not hold
        self.match_prefix(seq, end)
        hit = seq.num_computed
        try:
            self._reserve(seq)  # the whole budget, as `_admit` would: never wait holding half of it
            if max(hit, start) < end:  # never write into shared cached blocks
                with torch.inference_mode():
                    import_kv(self.pool, seq.block_table, payload.narrow(max(hit, start), end))
            self.add(seq)
        except BaseException:  # as it was before the call: a parked request retries from scratch
            self.pool.allocator.free(seq.block_table)
            seq.block_table = []
            seq.num_computed = seq.cached_tokens = 0
            raise
        seq.num_computed = end
        if hit < start:  # recompute [hit, start), then skip what was imported
            seq.num_computed, seq.imported = hit, ((start, end) if start < end else None)
        elif self.cache is not None:  # KV is cached as it lands: the next turn hits at once
            self.cache.insert(seq.token_ids[:end], seq.block_table[: end // bs], seq.namespace)
        self.count_prefix(seq)
        return None

    def export_and_release(self, seq_id: str, starts: list[int]) -> tuple[list[KVPayload], int]:
        """A finished `hold_kv` sequence's prompt KV [start, prompt_len) for each start; then its
        blocks are freed (the prompt stays in the prefix cache). Returns the payloads and the
        prompt tokens found cached. Raises NotHeld when it holds nothing (aborted)."""
        seq = self.held.get(seq_id)
        if seq is None:
            raise NotHeld(f"request {seq_id} holds no KV here (aborted?)")
        try:
            return [export_kv(self.pool, seq.block_table, start, seq.prompt_len) for start in starts], seq.cached_tokens
        finally:
            self.release(seq_id)

    def export_part(self, seq: Sequence) -> KVPayload:
        """A streaming prefill's KV computed since its last part, [export_from, num_computed),
        copied out while the rest of its prompt prefills (its blocks stay its own)."""
        part = export_kv(self.pool, seq.block_table, seq.export_from, seq.num_computed)
        seq.export_from = seq.num_computed
        return part

    def generated(self, seq_id: str) -> list[int] | None:
        """The tokens a running sequence generated so far (None: it is not running)."""
        seq = self.running.get(seq_id)
        return None if seq is None else seq.token_ids[seq.prompt_len :]

    def extend_shadow(self, seq_id: str, start_index: int, token_ids: list[int], final: bool) -> int:
        """Hand a shadow generated tokens [start_index, ...): it appends those it lacks, whose KV
        the next steps compute in one extend. `final` makes it an ordinary decoding sequence.
        Returns how many tokens were new. Raises ValueError on a gap or an unknown sequence."""
        seq = self.find(seq_id)
        if seq is None:
            raise ValueError(f"request {seq_id} is not running here")
        have = seq.num_generated
        if start_index > have:
            raise ValueError(f"handoff gap: have tokens [0, {have}), chunk starts at {start_index}")
        new = token_ids[have - start_index :]
        seq.token_ids.extend(new)
        if final:
            seq.shadow = False
        return len(new)
