"""What every engine instance (prefill, rld, md) shares: the engine thread, NATS, heartbeats.

Lifecycle of an instance process:
1. `run()`: connect to its own datacenter's NATS server, build the engine (model, KV pool,
   radix cache) on its worker thread, then `start()`.
2. `start(bus, worker)`: the role's subscriptions (`serve()`), plus the abort broadcast,
   inspect and flush-cache; the prefix index is sent whole, then heartbeats begin. Unit tests
   call `start()` with an in-memory bus and a worker they step by hand (tests/fakes.py).
3. Every `heartbeat_s` the load figures of the last step boundary go to the registrar
   (`pdd.registry.heartbeat`, services/scheduler/registrar.py), which keeps them in Redis with
   a TTL: an instance that stops heartbeating drops out. Prefix-cache events go as they happen
   (`pdd.registry.index`, numbered); when the registrar lost some (or Redis restarted) its
   heartbeat reply asks for the whole cache, which is sent next.
4. SIGTERM/SIGINT: `shutdown()` cancels every task, says `Leave`, stops the engine, closes.

Instances never touch Redis: across two datacenters only NATS (and KV) crosses the WAN.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Coroutine
from typing import Any

from shared import failpoints, heap, subjects
from shared.bus import Bus, BusTimeout
from shared.config import ClusterConfig, InstanceConfig, service_args
from shared.cores import CoreBoard
from shared.messages import (
    Abort,
    Ack,
    Heartbeat,
    HeartbeatReply,
    IndexEvent,
    IndexUpdate,
    Inspect,
    InstanceFigures,
    InstanceInfo,
    InstanceState,
    Leave,
    Sampling,
    token_problem,
)
from shared.model_info import model_name
from shared.pipelines import Role
from shared.runtime.engine import TokenOutput
from shared.runtime.worker import EngineWorker
from shared.security import Secrets
from shared.telemetry import Metrics

log = logging.getLogger(__name__)


# Block hashes per IndexUpdate: 24 hex characters each, so about 400 KiB of msgpack, well under
# NATS's 1 MiB payload limit (a whole cache of 42k blocks in one message went over it).
INDEX_HASHES_PER_UPDATE = 16_384


def index_parts(events: list[IndexEvent], limit: int = INDEX_HASHES_PER_UPDATE) -> list[list[IndexEvent]]:
    """`events` cut into consecutive parts of at most `limit` hashes each, each filled (an event
    that does not fit is cut into several of its kind, a chain's first blocks still marked), in
    order: applied one after another they give the same set. Each part is its own numbered
    update, so a lost one is a gap the registrar resyncs."""
    parts: list[list[IndexEvent]] = [[]]
    room = limit
    for ev in events:
        if not ev.hashes:
            parts[-1].append(ev)
            continue
        start = 0
        while start < len(ev.hashes):  # each part filled to the bound
            if room == 0:
                parts.append([])
                room = limit
            piece = ev.hashes[start : start + room]
            parts[-1].append(IndexEvent(ev.kind, piece, first=ev.first))
            room -= len(piece)
            start += len(piece)
    return [p for p in parts if p]


class InstanceService:
    role = ""

    def __init__(self, cfg: ClusterConfig, inst: InstanceConfig) -> None:
        self.cfg = cfg
        self.inst = inst
        self.bus: Bus | None = None
        self.worker: EngineWorker | None = None
        self.info = InstanceInfo(
            id=inst.id,
            role=inst.role,
            dc=inst.dc,
            dtype=inst.dtype,
            block_size=cfg.block_size,
            capacity=inst.max_running + inst.max_waiting,
            pid=os.getpid(),
        )
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self.metrics = Metrics(model_name(cfg.model), inst.id)
        self._index_seq = 0
        self._index_stale = True  # the registrar has nothing yet: the first report is the whole cache
        self._missed = 0  # heartbeat replies missed in a row

    # -- what a role fills in ---------------------------------------------------------------
    async def serve(self) -> None:
        """Subscribe the role's subjects and start its loops."""

    async def on_abort(self, msg: Abort) -> None: ...

    def held_requests(self) -> list[str]:
        return []

    def computes_prompt(self) -> bool:
        """Read on the engine thread before each step: whether the step's work is a prompt a user
        waits for (a prefill's), which the decoders on this host wait for (shared/cores.py)."""
        return False

    def state_sizes(self) -> dict[str, int]:
        """Sizes of the per-request maps (empty when idle) and of the capped memories of ids."""
        return {}

    def holding_since(self, older_than_s: float) -> dict[str, float]:
        """Requests held longer than `older_than_s`, with the seconds each has been held (the
        registrar checks they still exist, and renews their records)."""
        return {}

    async def forget(self, request_ids: list[str]) -> None:
        """The registrar says these requests are no longer in flight (their record is gone: they
        ended, or moved while the line was down and the abort was lost): drop what is held."""
        for rid in request_ids:
            await self.on_abort(Abort(rid, reason="no longer in flight (moved away or ended)"))

    def on_outputs(self, outputs: list[TokenOutput]) -> None:
        """Called on the event loop with each engine step's outputs, in step order."""

    def figures(self) -> InstanceFigures:
        """As of the last step boundary: never waits for the engine (heartbeats go on mid-step)."""
        return InstanceFigures(self.worker.figures, held=len(self.held_requests()), tasks=len(self._tasks))

    def refuse_if_full(self, request_id: str) -> Ack | None:
        """The bounded queue of this stage: a busy refusal once it holds `capacity` requests."""
        held = len(self.held_requests())
        if held < self.info.capacity:
            return None
        return Ack(
            request_id,
            ok=False,
            busy=True,
            error=f"{self.inst.id} is full ({held} requests held, "
            f"max_running {self.inst.max_running} + max_waiting {self.inst.max_waiting})",
        )

    def task_problem(self, prompt_ids: list[int], sampling: Sampling) -> str:
        """Why a task cannot run here ("" when it can): checked before the engine sees it, so a
        bad message fails its own request, never the batch it would have joined."""
        if not prompt_ids:
            return "empty prompt"
        if len(prompt_ids) + sampling.max_tokens > self.context_len:
            return f"prompt {len(prompt_ids)} + max_tokens {sampling.max_tokens} exceed the context {self.context_len}"
        return token_problem(prompt_ids, self.vocab_size, "prompt", self.context_len) or sampling.problem(
            self.vocab_size, self.context_len
        )

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        """A task the service keeps a reference to (so it is not collected) and cancels at shutdown."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- lifecycle ----------------------------------------------------------------------------
    async def run(self) -> None:
        from shared.runtime.build import build_engine  # the model: seconds to load, on a thread

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        failpoints.configure(self.inst.id, self.role)
        bus = await Bus.connect(self.cfg.nats_url_for(self.inst.dc), self.inst.id, self.inst.id, Secrets.of(self.cfg))
        engine = await asyncio.to_thread(build_engine, self.cfg, self.inst)
        threads = self.cfg.threads_of(self.inst)
        board = CoreBoard.from_env(threads)  # the launcher's: the host's idle cores, lent (shared/cores.py)
        decoder = self.role in (Role.RLD, Role.MD)
        worker = EngineWorker(
            engine,
            self.on_outputs,
            threads=threads,
            board=board,
            prompt=self.computes_prompt,
            yield_s=self.cfg.yield_to_prefill_s if decoder else 0.0,
        )
        await self.start(bus, worker)
        self.metrics.serve(self.cfg.host, self.inst.metrics_port)
        heap.settle(self.metrics)  # the model's objects out of the collector's reach (shared/heap.py)
        log.info("%s (%s, dc %s) ready", self.inst.id, self.role, self.inst.dc)
        await self._stop.wait()
        await self.shutdown()

    async def start(self, bus: Bus, worker: EngineWorker) -> None:
        self.bus, self.worker = bus, worker
        model_cfg = worker.engine.runner.model.config  # immutable facts of the model, read once
        self.vocab_size, self.context_len = model_cfg.vocab_size, model_cfg.max_position_embeddings
        self.metrics.engine_figures(lambda: worker.figures)
        self.info.started_at = time.time()
        worker.start()
        await self.serve()
        await bus.serve(subjects.ABORT, Abort, self.on_abort)
        await bus.serve(subjects.inspect(self.inst.id), Inspect, self._inspect)
        await bus.serve(subjects.flush_cache(self.inst.id), Inspect, self._flush_cache)
        await self.report_index()
        self.spawn(self._heartbeat())
        self.spawn(self._index_loop())

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        try:
            await self.bus.publish(subjects.leave(self.inst.id), Leave(self.inst.id))
        except Exception:
            pass
        await asyncio.to_thread(self.worker.stop)
        await self.bus.close()

    # -- reporting to the registrar -----------------------------------------------------------
    async def _heartbeat(self) -> None:
        while True:
            sampled_at = time.time()  # before the figures: a task landing meanwhile counts twice, never zero times
            self.figures().report_to(self.info, sampled_at)
            # only requests held for a while: the scheduler records a request before dispatching it
            held = self.holding_since(self.cfg.timeouts.control_s * 2)
            beat = Heartbeat(self.info, list(held), list(held.values()), missed_replies=self._missed)
            try:
                reply = await self.bus.request(
                    subjects.heartbeat(self.inst.id), beat, HeartbeatReply, self.cfg.timeouts.control_s
                )
                self._missed = 0
                self._index_stale |= reply.resync_index
                if reply.forget:
                    log.info("%s: dropping %d request(s) no longer in flight", self.inst.id, len(reply.forget))
                    await self.forget(reply.forget)
            except BusTimeout as e:  # registrar restarting, or the line to it down: keep serving
                self._missed += 1
                log.warning("%s: heartbeat not acknowledged: %s", self.inst.id, e)
            except Exception as e:  # any other failure (a closed or reconnecting bus): beat again
                self._missed += 1
                log.warning("%s: heartbeat failed: %s", self.inst.id, e)
            await asyncio.sleep(self.cfg.heartbeat_s)

    async def report_index(self) -> None:
        """Send the prefix cache's stored/removed blocks (or all of it, when stale) to the registrar.
        A publish, not a request: the final token of a turn waits for no round trip; NATS keeps
        this connection's messages in order, so the registrar has them before the next turn."""
        full = self._index_stale
        events = await self.worker.call(lambda e: e.cache_events(full))
        if not events:
            return
        self._index_stale = False
        for part in index_parts(events):
            self._index_seq += 1
            await self.bus.publish(subjects.index(self.inst.id), IndexUpdate(self.inst.id, part, self._index_seq))

    async def _index_loop(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            if not (self._index_stale or self.worker.engine.has_cache_events):
                continue  # an idle instance costs no call to its engine's thread ten times a second
            try:
                await self.report_index()
            except Exception as e:  # never let the index loop die
                log.warning("%s: index report failed: %s", self.inst.id, e)

    # -- operators ----------------------------------------------------------------------------
    async def _inspect(self, msg: Inspect) -> InstanceState:
        figures = self.figures()
        return InstanceState(
            instance_id=self.inst.id,
            role=self.role,
            requests=self.held_requests(),
            free_blocks=figures.engine.free_blocks,
            total_blocks=figures.engine.total_blocks,
            figures=figures,
            task_names=sorted(t.get_coro().__qualname__ for t in self._tasks),
            # handlers at work, besides the one answering this Inspect
            state={
                **self.state_sizes(),
                "bus_handlers": len(set(getattr(self.bus, "_tasks", ())) - {asyncio.current_task()}),
            },
        )

    async def _flush_cache(self, msg: Inspect) -> InstanceState:
        """Operator command (SGLang's /flush_cache): evict every cached block no request uses."""
        await self.worker.call(lambda e: e.flush_cache())
        await self.report_index()
        return await self._inspect(msg)


def service_main(make_service: Any, role: str, argv: list[str] | None = None) -> None:
    """`python -m services.<role> --config FILE [--instance ID]`."""
    cfg, instance = service_args(role, argv)
    asyncio.run(make_service(cfg, cfg.instance(instance, role)).run())
    # shut down cleanly (tasks ended, LEAVE sent, engine stopped, bus closed): skip tearing down
    # the interpreter, which costs torch's process ~0.8 s of CPU for nothing on every stop
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
