"""EngineWorker: one thread owns the Engine; asyncio code sends it commands.

The model forward takes tens of milliseconds and must not block the event loop that serves
NATS and TCP. So the engine, its pool and its sequences belong to one thread. The event loop
never touches them directly: it calls `await worker.call(fn)`, and `fn(engine)` runs on the
engine thread between two steps. Outputs of each step come back to the loop through
`on_outputs`, in step order.

`figures` is what `observe(engine)` returned at the last step boundary (load, free blocks...).
It is replaced whole, never mutated, so the loop reads it without waiting for a step: a
heartbeat must not stall behind a long prefill chunk, or the instance looks dead.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from shared.runtime.engine import Engine, TokenOutput

T = TypeVar("T")
log = logging.getLogger(__name__)


class EngineWorker:
    def __init__(
        self, engine: Engine, on_outputs: Callable[[list[TokenOutput]], Any], threads: int = 1,
        observe: Callable[[Engine], dict[str, Any]] | None = None,
    ) -> None:  # fmt: skip
        self.engine = engine
        self.on_outputs = on_outputs
        self.threads = threads
        self.observe = observe
        self.figures: dict[str, Any] = observe(engine) if observe else {}
        self._cond = threading.Condition()
        self._commands: list[tuple[Callable[[Engine], Any], asyncio.Future]] = []
        self._stopped = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.last_step_ms = 0.0

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
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
        future = self._loop.create_future()
        with self._cond:
            if self._stopped:
                raise RuntimeError("engine worker is stopped")
            self._commands.append((fn, future))
            self._cond.notify()
        return await future

    def _run(self) -> None:
        torch.set_num_threads(self.threads)
        while True:
            with self._cond:
                while not self._stopped and not self._commands and not self.engine.has_work:
                    self._cond.wait()
                if self._stopped:
                    return
                commands, self._commands = self._commands, []
            for fn, future in commands:
                self._run_command(fn, future)
            if self.engine.has_work:
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
        if self.observe is not None:
            self.figures = self.observe(self.engine)

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception:
            log.exception("engine step failed; failing its running sequences")
            outputs = self.engine.fail_running("engine step failed")
        self.last_step_ms = (time.perf_counter() - t0) * 1000
        self._observe()
        if outputs:
            self._loop.call_soon_threadsafe(self.on_outputs, outputs)


def _set_result(future: asyncio.Future, value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
