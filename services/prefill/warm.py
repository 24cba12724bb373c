"""The previous answer, prefilled ahead: a finished request's prompt and answer come back as
token ids (`Warm`, from the gateway), and prefill computes the answer's KV into its prefix cache
while it has nothing else to do. An agent's next turn holds the answer main-decode generated in
datacenter B, which this cache never saw; without this, the next turn would prefill it again, on
its critical path. Only token ids cross (the relay -> main-decode handoff in reverse); the cached
blocks are evicted like any others.

One answer at a time, and only while no request is held here and the engine has no other work:
a task arriving meanwhile waits at most one engine step behind it. The queue is bounded; when it
is full the oldest offer goes (a later turn of a busy fleet is better served than an old one).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable

from shared.messages import Sampling, Warm
from shared.prefix_hash import namespace_of
from shared.runtime.engine import TokenOutput
from shared.runtime.sequence import FinishReason, Sequence
from shared.runtime.worker import EngineWorker

log = logging.getLogger(__name__)
QUEUE = 64  # offers waiting for idle time, at most
IDLE_POLL_S = 0.05  # how often a waiting offer looks for idle time
WARMING = Sampling(max_tokens=1, ignore_eos=True)  # its one sampled token is dropped


class AnswerWarmer:
    def __init__(
        self, worker: EngineWorker, busy: Callable[[], bool], model: str, on_warmed: Callable[[], None] = lambda: None
    ) -> None:
        self.worker = worker
        self.busy = busy  # whether requests are held here (their prefill or push goes first)
        self.model = model
        self.on_warmed = on_warmed
        self.queue: deque[Warm] = deque(maxlen=QUEUE)
        self.warmed = 0  # answers computed into the cache
        self._offered = asyncio.Event()
        self._warming: dict[str, asyncio.Future] = {}  # sequence id -> done when the engine finished it

    def offer(self, msg: Warm) -> None:
        self.queue.append(msg)
        self._offered.set()

    def clear(self) -> list[str]:
        """Forget every offer; the sequence ids still in the engine, for the caller to abort
        (an operator's cache flush leaves nothing to land in the cache after it)."""
        self.queue.clear()
        for seq_id, done in self._warming.items():
            if not done.done():
                done.set_result(TokenOutput(seq_id, None, 0, FinishReason.ABORT, "flushed"))
        return list(self._warming)

    def took(self, out: TokenOutput) -> bool:
        """The engine's output is one of ours (the warming sequence ended): True, and it is done."""
        done = self._warming.get(out.seq_id)
        if done is not None and not done.done():
            done.set_result(out)
        return done is not None

    async def run(self) -> None:
        while True:
            if not self.queue:
                self._offered.clear()
                await self._offered.wait()
                continue
            while self.busy() or self.worker.figures.running or self.worker.figures.waiting:
                await asyncio.sleep(IDLE_POLL_S)
            await self._warm(self.queue.popleft())

    async def _warm(self, msg: Warm) -> None:
        seq_id = f"warm:{msg.request_id}"
        seq = Sequence(seq_id, list(msg.token_ids), WARMING, namespace=namespace_of(self.model, msg.cache_salt))
        done = asyncio.get_running_loop().create_future()
        self._warming[seq_id] = done
        try:
            await self.worker.call(lambda e: e.add(seq))
            out = await done
            if out.error:
                log.info("answer of %s not warmed: %s", msg.request_id, out.error)
            else:
                self.warmed += 1
                self.on_warmed()
        except ValueError as e:  # the same answer offered twice and still in the engine
            log.info("answer of %s not warmed: %s", msg.request_id, e)
        finally:
            self._warming.pop(seq_id, None)
