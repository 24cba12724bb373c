"""A sequence in the runtime: known token ids, how many have KV, and where that KV lives.

Prefill, chunked prefill, extend (the relay -> main handoff) and decode are one mechanism:
a sequence knows `token_ids`; `[0, num_computed)` already have KV in the pool; each step
computes some of the rest. When a step reaches the last known token, its logits give the
next token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from shared.messages import Sampling


class SeqStatus(IntEnum):
    WAITING = 0  # queued, no blocks yet
    RUNNING = 1  # blocks allocated, stepping
    FINISHED = 2  # done; blocks freed unless hold_kv


class FinishReason:
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"
    ERROR = "error"


@dataclass
class Sequence:
    seq_id: str
    token_ids: list[int]
    params: Sampling = field(default_factory=Sampling)
    prompt_len: int = -1  # defaults to len(token_ids) at creation
    num_computed: int = 0  # [0, num_computed) have KV in the pool
    block_table: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    hold_kv: bool = False  # keep blocks after finishing (prefill exports them, then releases)
    max_new: int | None = None  # stop after this many tokens *sampled here* (prefill samples 1)
    sampled_here: int = 0
    # A shadow computes the KV of tokens another instance produced (main-decode catching up
    # with relay-decode) but samples nothing: reaching its last known token is reported as
    # `caught_up`. Clearing the flag makes it an ordinary decoding sequence.
    shadow: bool = False
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # KV of [start, end) is already in the blocks (imported) although [num_computed, start) is
    # not: the engine computes up to `start`, then jumps to `end` (a prefix evicted mid-flight).
    imported: tuple[int, int] | None = None
    namespace: str = ""  # prefix-cache namespace (model and tenant salt); "" = the engine's
    # Prefill streaming its KV: each step that computes part of the prompt (and samples nothing)
    # hands out [export_from, num_computed) and moves this up (`Engine.step`'s `kv_part`
    # outputs); the rest is exported once the first token is sampled. None: at the end only.
    export_from: int | None = None
    # The step that ends the prompt hands out its KV from here (from `export_from` when that moved
    # up) layer by layer as its forward computes them (`Engine.emit`, `kv_layer` outputs), so
    # nothing is left for after the first token. None: not so.
    layers_from: int | None = None

    def __post_init__(self) -> None:
        if self.prompt_len < 0:
            self.prompt_len = len(self.token_ids)
        if not self.token_ids:
            raise ValueError(f"sequence {self.seq_id} has no tokens")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_start(self) -> int:
        """Where the request's own output begins: a migrated attempt's prompt ends with some of it."""
        return max(self.prompt_len - self.params.resumed, 0)

    @property
    def num_output(self) -> int:
        """Output tokens of the request so far, an earlier attempt's included (penalties,
        min_tokens, the seeded step and the grammar count these)."""
        return len(self.token_ids) - self.output_start

    @property
    def num_pending(self) -> int:
        """Known tokens whose KV is not computed yet."""
        return len(self.token_ids) - self.num_computed

    @property
    def num_schedulable(self) -> int:
        """Tokens the next step may compute: up to a hole's end, and a shadow keeps its last one."""
        if self.imported is not None:
            return self.imported[0] - self.num_computed
        return self.num_pending - 1 if self.shadow else self.num_pending

    @property
    def max_total_tokens(self) -> int:
        """Upper bound of tokens this sequence can hold; the engine reserves blocks for it."""
        remaining = self.params.max_tokens - self.num_generated
        if self.max_new is not None:
            remaining = min(remaining, self.max_new)
        return len(self.token_ids) + max(remaining, 0)

    @property
    def finished(self) -> bool:
        return self.status == SeqStatus.FINISHED
