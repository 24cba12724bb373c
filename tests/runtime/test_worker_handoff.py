"""EngineWorker's hand-off: the event loop takes a step's outputs, and runs what they scheduled
(a decoder's publish), before the engine thread starts the next step; it does not take the
GIL piecemeal from the next step's forward (shared/runtime/worker.py)."""

from __future__ import annotations

import asyncio

from shared.messages import EngineFigures
from shared.runtime.engine import TokenOutput
from shared.runtime.worker import EngineWorker


class CountingEngine:
    """An engine of `steps` instant steps, one token each, that notes at every step whether the
    loop had handled the previous step's outputs and run what the handler scheduled."""

    def __init__(self, steps: int) -> None:
        self.left = steps
        self.steps = 0
        self.handled = 0  # outputs the loop took (on_outputs ran)
        self.published = 0  # what on_outputs scheduled, run
        self.ready_at_step: list[bool] = []
        self.last_step_tokens = 1

    @property
    def has_work(self) -> bool:
        return self.left > 0

    def step(self) -> list[TokenOutput]:
        self.ready_at_step.append(self.handled == self.published == self.steps)
        self.steps += 1
        self.left -= 1
        return [TokenOutput("s", 7, self.steps - 1)]

    def figures(self) -> EngineFigures:
        return EngineFigures()


async def _run(engine: CountingEngine, handoff_wait_s: float) -> None:
    loop = asyncio.get_running_loop()
    done = asyncio.Event()

    def publish() -> None:
        engine.published += 1
        if engine.published == len(engine.ready_at_step) and not engine.has_work:
            done.set()

    def on_outputs(outputs: list[TokenOutput]) -> None:
        engine.handled += len(outputs)
        loop.call_soon(publish)  # as a decoder's chunk goes to its publisher task

    worker = EngineWorker(engine, on_outputs, handoff_wait_s=handoff_wait_s)  # type: ignore[arg-type]
    worker.start()
    await worker.call(lambda e: None)  # wakes the engine thread, which steps while it has work
    try:
        await asyncio.wait_for(done.wait(), 30)
    finally:
        worker.stop()


async def test_each_step_starts_after_the_loop_took_the_last_steps_outputs():
    engine = CountingEngine(20)
    await _run(engine, handoff_wait_s=30.0)  # the bound, not a wait: each step goes on once they are taken
    assert engine.steps == engine.handled == engine.published == 20
    assert all(engine.ready_at_step), engine.ready_at_step


async def test_outputs_arrive_in_step_order():
    engine = CountingEngine(12)
    got: list[int] = []
    loop_done = asyncio.Event()

    def on_outputs(outputs: list[TokenOutput]) -> None:
        got.extend(o.index for o in outputs)
        engine.handled += len(outputs)
        engine.published += len(outputs)
        if len(got) == 12:
            loop_done.set()

    worker = EngineWorker(engine, on_outputs, handoff_wait_s=0.0)  # type: ignore[arg-type]
    worker.start()
    await worker.call(lambda e: None)
    try:
        await asyncio.wait_for(loop_done.wait(), 30)
    finally:
        worker.stop()
    assert got == list(range(12))
