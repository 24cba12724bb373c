"""What every PDD instance process shares: connections, heartbeats, inspect, abort, shutdown.

A role service (prefill, rld, md) subclasses `InstanceService` and fills in `setup()`,
`on_abort()`, `held_requests()`. `run()` connects to NATS and Redis, registers the instance,
heartbeats its load until SIGTERM/SIGINT, then unregisters and closes everything.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

from shared import subjects
from shared.bus import Bus
from shared.config import ClusterConfig, InstanceConfig, service_args
from shared.messages import Abort, Ack, Inspect, InstanceState, Sampling
from shared.registry import InstanceInfo, Registry, connect
from shared.runtime.engine import Engine, TokenOutput
from shared.runtime.kv_pool import KVPool
from shared.runtime.models import kv_layout, load_model, load_tokenizer, parse_dtype
from shared.runtime.provision import provision_default_model
from shared.runtime.radix_cache import KVEvent, RadixCache
from shared.runtime.runner import ModelRunner
from shared.runtime.sampling import SamplingParams
from shared.runtime.worker import EngineWorker

log = logging.getLogger(__name__)


def model_path(cfg: ClusterConfig) -> str:
    return str(provision_default_model()) if cfg.model == "default" else cfg.model


def build_engine(cfg: ClusterConfig, inst: InstanceConfig) -> tuple[Engine, object]:
    """The instance's model, KV pool and engine, as its config says."""
    path = model_path(cfg)
    model = load_model(path, dtype=inst.dtype)
    tokenizer = load_tokenizer(path)
    pool = KVPool.with_capacity(
        kv_layout(model), tokens=inst.kv_tokens, block_size=cfg.block_size, dtype=parse_dtype(inst.dtype)
    )
    eos = model.generation_config.eos_token_id
    eos_ids = tuple(eos if isinstance(eos, list) else [eos]) if eos is not None else ()
    engine = Engine(
        ModelRunner(model, pool),
        max_step_tokens=inst.max_step_tokens,
        max_running=inst.max_running,
        eos_token_ids=eos_ids,
        decode_text=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
        cache=RadixCache(pool.allocator, pool.block_size) if inst.prefix_cache else None,
        namespace=cfg.model,  # the scheduler hashes prompts in the same namespace
    )
    return engine, tokenizer


class InstanceService:
    role = ""

    def __init__(self, cfg: ClusterConfig, inst: InstanceConfig) -> None:
        self.cfg = cfg
        self.inst = inst
        self.bus: Bus | None = None
        self.registry: Registry | None = None
        self.info = InstanceInfo(id=inst.id, role=inst.role, dc=inst.dc, dtype=inst.dtype, block_size=cfg.block_size,
                                 capacity=inst.max_running + inst.max_waiting)  # fmt: skip
        self._stop = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()

    # -- for subclasses -------------------------------------------------------------------
    async def setup(self) -> None: ...

    async def teardown(self) -> None: ...

    async def on_abort(self, msg: Abort) -> None: ...

    def held_requests(self) -> list[str]:
        return []

    def refuse_if_full(self, request_id: str) -> Ack | None:
        """The bounded queue of this stage: a busy refusal once it holds `capacity` requests."""
        held = len(self.held_requests())
        if held < self.info.capacity:
            return None
        return Ack(request_id, ok=False, busy=True, error=f"{self.inst.id} is full ({held} requests held, "
                   f"max_running {self.inst.max_running} + max_waiting {self.inst.max_waiting})")  # fmt: skip

    async def load(self) -> dict[str, int]:
        return {}

    # -- plumbing -------------------------------------------------------------------------
    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        self.bus = await Bus.connect(self.cfg.nats_url, self.inst.id)
        self.registry = Registry(connect(self.cfg.redis_url), self.cfg.heartbeat_ttl_s)
        self.info.started_at = time.time()
        await self.setup()
        await self.bus.serve(subjects.ABORT, Abort, self.on_abort)
        await self.bus.serve(subjects.inspect(self.inst.id), Inspect, self._inspect)
        heartbeat = asyncio.create_task(self._heartbeat())
        log.info("%s (%s, dc %s) ready", self.inst.id, self.role, self.inst.dc)
        await self._stop.wait()
        heartbeat.cancel()
        await self.shutdown()

    async def shutdown(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self.teardown()
        try:
            await self.registry.remove(self.inst.id)
        except Exception:
            pass
        await self.bus.close()
        await self.registry.r.aclose()

    async def _heartbeat(self) -> None:
        while True:
            sampled_at = time.time()  # before the figures: a task landing meanwhile counts twice, never zero times
            for key, value in (await self.load()).items():
                setattr(self.info, key, value)
            try:
                await self.registry.heartbeat(self.info, sampled_at)
            except Exception as e:  # Redis restarting: keep serving, retry next beat
                log.warning("%s: heartbeat failed: %s", self.inst.id, e)
            await asyncio.sleep(self.cfg.heartbeat_s)

    async def _inspect(self, msg: Inspect) -> InstanceState:
        load = await self.load()
        return InstanceState(
            instance_id=self.inst.id,
            role=self.role,
            requests=self.held_requests(),
            free_blocks=load.get("free_blocks", 0),
            total_blocks=load.get("total_blocks", 0),
            extra={**load, "task_names": sorted(t.get_coro().__qualname__ for t in self._tasks)},
        )


def to_params(s: Sampling) -> SamplingParams:
    return SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        seed=s.seed,
        stop_token_ids=tuple(s.stop_token_ids),
        stop=tuple(s.stop),
        ignore_eos=s.ignore_eos,
    )


class EngineService(InstanceService):
    """An instance that runs the model: the engine lives on its worker thread."""

    def __init__(self, cfg: ClusterConfig, inst: InstanceConfig) -> None:
        super().__init__(cfg, inst)
        self.worker: EngineWorker | None = None
        self.tokenizer = None
        self._index_stale = False

    async def setup(self) -> None:
        engine, self.tokenizer = await asyncio.to_thread(build_engine, self.cfg, self.inst)
        self.worker = EngineWorker(engine, self.on_outputs, threads=self.inst.threads, observe=_engine_load)
        self.worker.start()
        await self.registry.clear_kv(self.inst.id)  # a restarted instance holds nothing yet
        self.spawn(self._index_loop())
        await self.bus.serve(subjects.flush_cache(self.inst.id), Inspect, self._flush_cache)

    async def _flush_cache(self, msg: Inspect) -> InstanceState:
        """Operator command (SGLang's /flush_cache): evict every cached block no request uses."""
        await self.worker.call(lambda e: e.cache.evict(e.pool.num_blocks) if e.cache else 0)
        await self.flush_index()
        return await self._inspect(msg)

    async def flush_index(self) -> None:
        """Publish the prefix cache's stored/removed blocks to the Redis index. After a failed
        update, or when Redis lost the index (restart), publish the whole cache instead."""
        full = self._index_stale or not await self._index_present()
        events = await self.worker.call(lambda e: _cache_events(e, full))
        if not events:
            return
        try:
            await self.registry.apply_kv_events(self.inst.id, events)
            self._index_stale = False
        except Exception as e:
            log.warning("%s: prefix index update failed (resync follows): %s", self.inst.id, e)
            self._index_stale = True

    async def _index_present(self) -> bool:
        try:
            return await self.registry.kv_present(self.inst.id)
        except Exception:
            return True  # cannot tell; the update below fails and marks the index stale

    async def _index_loop(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            try:
                await self.flush_index()
            except Exception as e:  # never let the index loop die
                log.warning("%s: index loop: %s", self.inst.id, e)

    async def teardown(self) -> None:
        if self.worker is not None:
            await asyncio.to_thread(self.worker.stop)

    def on_outputs(self, outputs: list[TokenOutput]) -> None:
        """Called on the event loop with each step's outputs, in step order."""

    async def load(self) -> dict[str, int]:
        """As of the last step boundary: never waits for the engine (heartbeats go on mid-step)."""
        return {**self.worker.figures, "held": len(self.held_requests()), "tasks": len(self._tasks)}


def _cache_events(engine: Engine, full: bool) -> list:
    if engine.cache is None:
        return []
    if full:
        engine.cache.drain_events()
        return [KVEvent("cleared"), KVEvent("stored", engine.cache.all_hashes())]
    return engine.cache.drain_events()


def _engine_load(engine: Engine) -> dict[str, int]:
    return {
        "running": len(engine.running),
        "waiting": len(engine.waiting),
        "free_blocks": engine.pool.num_free_blocks,
        "total_blocks": engine.pool.num_blocks,
        "cached_blocks": engine.cache.num_blocks if engine.cache else 0,
        "queued_tokens": sum(s.num_pending for s in engine.waiting)
        + sum(s.num_pending for s in engine.running.values() if s.num_pending > 1),  # prompt left to compute
    }


def service_main(service_cls: type[InstanceService], role: str, argv: list[str] | None = None) -> None:
    """`python -m services.<role> --config FILE [--instance ID]`."""
    cfg, instance = service_args(role, argv)
    asyncio.run(service_cls(cfg, cfg.instance(instance, role)).run())
