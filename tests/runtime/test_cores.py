"""The host's idle cores lent to the instance that steps alone (shared/cores.py), and the engine
worker running each step on the threads the board gives (shared/runtime/worker.py)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shared import cores
from shared.config import config_from_dict, load_config
from shared.cores import CoreBoard
from shared.messages import EngineFigures
from shared.runtime.engine import TokenOutput
from shared.runtime.worker import EngineWorker

SHIPPED = Path(__file__).resolve().parents[2] / "configs" / "single-host.yaml"


def boards(tmp_path: Path, n: int, share: int = 1, alone: int = 4) -> list[CoreBoard]:
    path = cores.create(tmp_path / "cores", n)
    return [CoreBoard(path, slot, share, alone) for slot in range(n)]


def test_an_instance_alone_takes_every_core_and_its_share_beside_a_busy_one(tmp_path):
    md, rld = boards(tmp_path, 2)
    assert md.threads() == 4  # the relay has no work
    assert rld.threads() == 1  # main-decode is stepping: the relay keeps its share
    assert md.threads() == 1  # and main-decode goes back to its own
    rld.idle()
    assert md.threads() == 4
    md.idle()
    assert rld.threads() == 4


def test_a_slot_whose_process_is_gone_lends_its_cores_back(tmp_path):
    md, rld = boards(tmp_path, 2)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    cores.SLOT.pack_into(rld._map, rld.slot * cores.SLOT.size, int(dead.stdout))  # killed while busy
    assert md.threads() == 4
    rld.threads()  # a live relay that steps is seen
    assert md.threads() == 1


def test_a_prefill_computing_a_prompt_is_seen_by_the_decoders_and_warming_is_not(tmp_path):
    prefill, md, rld = boards(tmp_path, 3)
    assert not md.prompt_busy()
    prefill.threads(prompt=True)
    assert md.prompt_busy() and rld.prompt_busy() and md.others_busy()
    assert not prefill.prompt_busy()  # its own slot aside
    prefill.threads(prompt=False)  # warming an answer: busy, but no prompt anyone waits for
    assert md.others_busy() and not md.prompt_busy()
    prefill.threads(prompt=True)
    prefill.idle()
    assert not md.prompt_busy() and not md.others_busy()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    cores.SLOT.pack_into(prefill._map, prefill.slot * cores.SLOT.size, -int(dead.stdout))  # killed mid-prompt
    assert not md.prompt_busy() and not md.others_busy()


def test_the_board_comes_from_the_launchers_variable(tmp_path):
    path = cores.create(tmp_path / "cores", 3)
    assert CoreBoard.from_env(1, env={}) is None
    board = CoreBoard.from_env(1, alone=2, env={cores.ENV: cores.env_value(path, 2)})
    assert (board.slot, board.slots, board.share, board.alone) == (2, 3, 1, 2)
    assert CoreBoard(path, 0, share=2, alone=1).alone == 2  # never fewer than its share
    with pytest.raises(ValueError, match="<file>:<slot>"):
        CoreBoard.from_env(1, env={cores.ENV: str(path)})
    with pytest.raises(ValueError, match="3 slots"):
        CoreBoard.from_env(1, env={cores.ENV: cores.env_value(path, 3)})


def test_the_shipped_config_puts_its_three_auto_instances_on_one_board():
    cfg = load_config(str(SHIPPED))
    assert [[i.id for i in group] for group in cfg.core_boards()] == [["prefill-0", "rld-0", "md-0"]]
    explicit = config_from_dict(
        {
            "instances": [
                {"id": "prefill-0", "role": "prefill", "threads": 2},
                {"id": "rld-0", "role": "rld", "threads": "auto"},
                {"id": "md-0", "role": "md", "dc": "B", "threads": "auto"},
                {"id": "md-1", "role": "md", "dc": "B", "threads": "auto", "host": "10.0.0.2"},
            ]
        }
    )
    assert [[i.id for i in group] for group in explicit.core_boards()] == [["rld-0", "md-0"]]  # md-1 alone on its host
    assert load_config(str(SHIPPED), lend_idle_cores=False).core_boards() == []


class ThreadsEngine:
    """An engine of `steps` instant steps that notes the torch threads each step ran on."""

    def __init__(self, steps: int) -> None:
        self.left = steps
        self.threads: list[int] = []
        self.last_step_tokens = 1
        self.samples_a_first_token = False

    @property
    def has_work(self) -> bool:
        return self.left > 0

    def step(self) -> list[TokenOutput]:
        self.threads.append(torch.get_num_threads())
        self.left -= 1
        return [TokenOutput("s", 7, len(self.threads) - 1)]

    def figures(self) -> EngineFigures:
        return EngineFigures()


async def test_the_worker_steps_on_lent_cores_only_while_its_neighbour_is_idle(tmp_path):
    md, rld = boards(tmp_path, 2, share=1, alone=2)
    engine = ThreadsEngine(3)
    before = torch.get_num_threads()
    worker = EngineWorker(engine, lambda outputs: None, threads=1, handoff_wait_s=0, board=md)  # type: ignore[arg-type]
    worker.start()
    try:
        await worker.call(lambda e: None)
        await _until(lambda: not engine.has_work and not rld.others_busy())  # out of work: its slot freed
        assert engine.threads == [2, 2, 2] and worker.lent_steps == 3
        assert worker.figures.lent_steps == 3
        assert rld.threads() == 2  # main-decode idle: the relay may take both cores
        engine.left = 2
        await worker.call(lambda e: None)
        await _until(lambda: not engine.has_work)
        assert engine.threads[3:] == [1, 1] and worker.lent_steps == 3
    finally:
        worker.stop()
        torch.set_num_threads(before)  # the engine thread's count reaches the process's (later tests read it)
    rld.idle()
    assert rld.threads() == 2  # a stopped worker holds no slot


async def _until(predicate, timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def test_a_decoder_waits_for_a_prompt_on_its_host_and_runs_commands_meanwhile(tmp_path):
    prefill, md = boards(tmp_path, 2, share=1, alone=2)
    engine = ThreadsEngine(2)
    before = torch.get_num_threads()
    prefill.threads(prompt=True)
    worker = EngineWorker(engine, lambda outputs: None, threads=1, handoff_wait_s=0, board=md, yield_s=600)  # type: ignore[arg-type]
    worker.start()
    try:
        assert await worker.call(lambda e: e.left) == 2  # a command runs while the step waits
        assert engine.threads == []  # and no step ran: the prompt has the cores
        prefill.idle()
        await _until(lambda: not engine.has_work)
        assert engine.threads == [2, 2]  # the prompt done and the prefill idle: every core
        await worker.call(lambda e: None)
        assert worker.yielded_s > 0 and worker.figures.yielded_s == round(worker.yielded_s, 3)
    finally:
        worker.stop()
        torch.set_num_threads(before)
        md.idle()


async def test_a_decoder_waits_at_most_yield_s_for_a_prompt(tmp_path):
    prefill, md = boards(tmp_path, 2, share=1, alone=2)
    engine = ThreadsEngine(2)
    before = torch.get_num_threads()
    prefill.threads(prompt=True)  # and never done
    worker = EngineWorker(engine, lambda outputs: None, threads=1, handoff_wait_s=0, board=md, yield_s=0.05)  # type: ignore[arg-type]
    worker.start()
    try:
        await _until(lambda: not engine.has_work)
        assert engine.threads == [1, 1]  # stepped on its share, beside the prompt
        await worker.call(lambda e: None)
        assert worker.figures.yielded_s >= 2 * 0.05  # each step waited its most first
    finally:
        worker.stop()
        torch.set_num_threads(before)
        md.idle()
        prefill.idle()


async def test_a_step_that_samples_a_first_token_does_not_wait_for_a_prompt(tmp_path):
    prefill, md = boards(tmp_path, 2, share=1, alone=2)
    engine = ThreadsEngine(1)
    engine.samples_a_first_token = True  # a request's second token, or main-decode's first after a handoff
    before = torch.get_num_threads()
    prefill.threads(prompt=True)
    worker = EngineWorker(engine, lambda outputs: None, threads=1, handoff_wait_s=0, board=md, yield_s=600)  # type: ignore[arg-type]
    worker.start()
    try:
        await _until(lambda: not engine.has_work)
        assert engine.threads == [1] and worker.yielded_s == 0  # beside the prompt, on its share
    finally:
        worker.stop()
        torch.set_num_threads(before)
        md.idle()
        prefill.idle()
