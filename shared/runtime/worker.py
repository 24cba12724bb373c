"""EngineWorker: one thread owns the Engine; asyncio code sends it commands.

The model forward takes tens of milliseconds and must not block the event loop that serves
NATS and TCP. So the engine, its pool and its sequences belong to one thread. The event loop
never touches them directly: it calls `await worker.call(fn)`, and `fn(engine)` runs on the
engine thread between two steps. Outputs of each step come back to the loop through
`on_outputs`, in step order.

Each step's hand-off lets the loop take its outputs before the next step starts (bounded by
`handoff_wait_s`): the loop's turn with a token (its chunk built, encoded, written to NATS) then
holds the GIL alone, instead of taking it piecemeal from the next step's forward, where each time
the engine thread waits for it back it also waits to be scheduled again (on a shared 2-core host
that cost main-decode ~1-2 ms a token; benchmarks/served_step.py measures it).

`figures` is the engine's `EngineFigures` at the last step boundary (requests, free blocks...),
with the measured pace (`StepRates`): what the scheduler's estimates use instead of priors.
It is replaced whole, never mutated, so the loop reads it without waiting for a step: a
heartbeat must not stall behind a long prefill chunk, or the instance looks dead.

With a `CoreBoard` (shared/cores.py) a step runs on every core of the host while the instance's
neighbours there have no work, and on its share (`threads`) otherwise. A prefill's worker marks
its slot while it computes a prompt (`prompt`); a decoder's (`yield_s`) then waits before each
step until the prompt is done, at most `yield_s`, running the commands that come meanwhile,
unless the step samples a request's first token here (a user waits on that one too).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from shared.cores import CoreBoard
from shared.messages import EngineFigures
from shared.runtime.engine import Engine, TokenOutput

T = TypeVar("T")
log = logging.getLogger(__name__)
HANDOFF_WAIT_S = 0.002  # the most a step waits for the event loop to take the previous step's outputs
# how often a decoder waiting for a prompt on its host looks at the board again: soon at first
# (most prompts of a chat are short), then every 20 ms (each look wakes it on the prompt's cores)
YIELD_POLL_S = (0.005, 0.02)


class StepRates:
    """Moving averages of this engine's measured pace: the time of a step (what a decode step
    costs here now, batch and context included) and prefill throughput (tokens per second over
    steps that computed at least `min_prefill_tokens`). 0.0 until measured."""

    def __init__(self, alpha: float = 0.2, min_prefill_tokens: int = 32) -> None:
        self.alpha, self.min_prefill_tokens = alpha, min_prefill_tokens
        self.step_ms = 0.0
        self.prefill_tok_s = 0.0

    def add(self, ms: float, tokens: int) -> None:
        self.step_ms = self._ema(self.step_ms, ms)
        if tokens >= self.min_prefill_tokens and ms > 0:
            self.prefill_tok_s = self._ema(self.prefill_tok_s, tokens / ms * 1000.0)

    def _ema(self, old: float, new: float) -> float:
        return new if old == 0.0 else old + self.alpha * (new - old)


class EngineWorker:
    def __init__(
        self,
        engine: Engine,
        on_outputs: Callable[[list[TokenOutput]], Any],
        threads: int = 1,
        handoff_wait_s: float = HANDOFF_WAIT_S,
        board: CoreBoard | None = None,
        prompt: Callable[[], bool] | None = None,
        yield_s: float = 0.0,
    ) -> None:
        self.engine = engine
        self.on_outputs = on_outputs
        self.threads = threads  # its share of the host's cores; more while it steps alone (`board`)
        self.board = board
        self.prompt = prompt or (lambda: False)  # a prefill: whether its work is a prompt someone waits for
        self.yield_s = yield_s  # a decoder: the most it waits, before a step, for a prompt on its host
        self.lent_steps = 0  # steps run on the cores of idle neighbours (shared/cores.py)
        self.yielded_s = 0.0  # time this decoder waited for prompts on its host
        self._waiting_since: float | None = None
        self._threads_now = threads
        self.handoff_wait_s = handoff_wait_s
        self.rates = StepRates()
        self.busy_s = 0.0  # time spent in engine steps since start
        self.figures = self._figures()
        self._cond = threading.Condition()
        self._commands: list[tuple[Callable[[Engine], Any], asyncio.Future]] = []
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.last_step_ms = 0.0

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.engine.emit = self._hand_over_now
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps and return its result."""
        return await self.submit(fn)

    def submit(self, fn: Callable[[Engine], T]) -> asyncio.Future[T]:
        """Queue `fn(engine)` now, without waiting for it: commands run in the order they were
        queued, at the next step boundary. The future holds its result."""
        future = self._loop.create_future()
        with self._cond:
            if self._stopped:
                raise RuntimeError("engine worker is stopped")
            self._commands.append((fn, future))
            self._cond.notify()
        return future

    def _run(self) -> None:
        torch.set_num_threads(self.threads)
        while True:
            with self._cond:
                while not self._stopped and not self._commands and not self.engine.has_work:
                    if self.board is not None:
                        self.board.idle()
                    self._cond.wait()
                if self._stopped:
                    if self.board is not None:
                        self.board.close()
                    return
                commands, self._commands = self._commands, []
            for fn, future in commands:
                self._run_command(fn, future)
            if self.engine.has_work and not self._yielding():
                self._step()

    def _run_command(self, fn: Callable[[Engine], Any], future: asyncio.Future) -> None:
        try:
            result = fn(self.engine)
        except BaseException as e:  # handed to the awaiting coroutine
            self._observe()
            self._loop.call_soon_threadsafe(_set_exception, future, e)
        else:
            self._observe()  # before the caller resumes: it may read the figures its command changed
            self._loop.call_soon_threadsafe(_set_result, future, result)

    def _observe(self) -> None:
        self.figures = self._figures()

    def _figures(self) -> EngineFigures:
        r = self.rates
        return dataclasses.replace(
            self.engine.figures(),
            step_ms=round(r.step_ms, 2),
            prefill_tok_s=round(r.prefill_tok_s, 1),
            busy_s=round(self.busy_s, 3),
            lent_steps=self.lent_steps,
            yielded_s=round(self.yielded_s, 3),
        )

    def _yielding(self) -> bool:
        """Whether this decoder waits a moment more before its next step: a prefill on its host
        computes a prompt, the step samples no request's first token here (those are waited on
        like the prompt: a second token, the first after a handoff), and the wait has not
        reached `yield_s`. Waits on the command condition: a command that comes meanwhile runs."""
        if not self.yield_s or self.board is None or self.engine.samples_a_first_token or not self.board.prompt_busy():
            return self._waited()
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
        elif now - self._waiting_since >= self.yield_s:
            return self._waited()
        first, most = YIELD_POLL_S
        with self._cond:
            if not self._commands and not self._stopped:
                self._cond.wait(min(most, max(first, (now - self._waiting_since) / 2)))
        return True

    def _waited(self) -> bool:
        """No more waiting (or none at all): the wait so far is counted; False, for `_yielding`."""
        if self._waiting_since is not None:
            self.yielded_s += time.monotonic() - self._waiting_since
            self._waiting_since = None
        return False

    def _use_threads(self) -> None:
        """The step's threads: every core this instance may use while its neighbours on the host
        are idle, else its share."""
        n = self.board.threads(prompt=self.prompt())
        if n != self._threads_now:
            torch.set_num_threads(n)
            self._threads_now = n
        self.lent_steps += n > self.threads

    def _step(self) -> None:
        if self.board is not None:
            self._use_threads()
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception:
            log.exception("engine step failed; failing its running sequences")
            outputs = self.engine.fail_running("engine step failed")
        self.last_step_ms = (time.perf_counter() - t0) * 1000
        self.busy_s += self.last_step_ms / 1000
        if self.engine.last_step_tokens:
            self.rates.add(self.last_step_ms, self.engine.last_step_tokens)
        self._observe()
        if outputs:
            self._hand_off(outputs)

    def _hand_over_now(self, outputs: list[TokenOutput]) -> None:
        """Outputs made during a step (a streaming prefill's layers) to `on_outputs` on the loop,
        before the step's own outputs; the step goes on meanwhile."""
        self._loop.call_soon_threadsafe(self.on_outputs, outputs)

    def _hand_off(self, outputs: list[TokenOutput]) -> None:
        """`on_outputs(outputs)` on the loop; the next step waits until the loop has run it and
        what it scheduled (a decoder's publish, then NATS's flush: two more passes of the loop),
        or `handoff_wait_s`, whichever comes first."""
        taken = threading.Event()
        self._loop.call_soon_threadsafe(self._deliver, outputs, taken)
        if self.handoff_wait_s > 0:
            taken.wait(self.handoff_wait_s)

    def _deliver(self, outputs: list[TokenOutput], taken: threading.Event) -> None:
        try:
            self.on_outputs(outputs)
        finally:
            self._loop.call_soon(self._loop.call_soon, taken.set)


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
