"""A relay and a main-decoder on an in-memory bus, each around a real engine on a tiny Llama
that the test steps by hand, and a prefill stand-in that computes real KV.

`DecoderPair.drive(until)` steps both engines and lets the event loop run in between, the way
the two processes run side by side, until a condition holds (a bounded number of rounds: no
clock anywhere, so the outcome is the same on a fast or a slow machine).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable

import torch

from services.md.service import MainDecoder
from services.rld.service import RelayDecoder
from shared import subjects
from shared.config import config_from_dict
from shared.decoder import DecoderService
from shared.kv_receive import Verdict
from shared.kv_transport import FirstToken, Part, Transfer, TransferHead
from shared.messages import Ack, DecodeTask, Logprob, Plan, RequestStats, Sampling, TokenChunk
from shared.runtime.engine import Engine
from shared.runtime.kv_payload import export_kv, layer_to_bytes
from shared.runtime.kv_pool import KVPool
from shared.runtime.models import kv_layout
from shared.runtime.radix_cache import RadixCache
from shared.runtime.runner import ModelRunner
from shared.runtime.sequence import Sequence
from tests.fakes import InMemoryNats, ManualWorker
from tests.helpers import greedy

BLOCK = 16
CONFIG = {
    "model": "tiny",
    "instances": [
        {"id": "prefill-0", "role": "prefill", "dc": "A"},
        {"id": "rld-0", "role": "rld", "dc": "A"},
        {"id": "md-0", "role": "md", "dc": "B", "max_running": 4, "max_waiting": 2},
    ],
    "handoff": {"chunk_tokens": 4, "final_tokens": 2, "ack_timeout_s": 30},
    "timeouts": {"request_s": 60},
}


def engine(model: torch.nn.Module, num_blocks: int = 64) -> Engine:
    pool = KVPool(kv_layout(model), num_blocks, BLOCK, torch.float32, torch.device("cpu"))
    return Engine(ModelRunner(model, pool), max_running=4, cache=RadixCache(pool.allocator, BLOCK), namespace="tiny")


def idle(e: Engine) -> bool:
    """Nothing running or held, every block free or cached."""
    cached = e.cache.num_blocks if e.cache else 0
    return not e.running and not e.waiting and not e.held and e.pool.num_free_blocks + cached == e.pool.num_blocks


class DecoderPair:
    def __init__(self, model: torch.nn.Module, md_blocks: int = 64, **config) -> None:
        self.model = model
        self.cfg = config_from_dict({**CONFIG, **config})
        self.nats = InMemoryNats()
        self.bus = self.nats.client("scheduler and gateway")
        self.rld = RelayDecoder(self.cfg, self.cfg.instance("rld-0"))
        self.md = MainDecoder(self.cfg, self.cfg.instance("md-0"))
        self.engines = {"rld": engine(model), "md": engine(model, md_blocks)}
        self.prefill_engine = engine(model)
        self.chunks: dict[str, list[TokenChunk]] = {}
        self.sampling: dict[str, Sampling] = {}

    async def start(self) -> DecoderPair:
        for name, svc in (("rld", self.rld), ("md", self.md)):
            await svc.start(self.nats.client(name), ManualWorker(self.engines[name], svc.on_outputs))
        self.baseline = {name: self.task_names(name) for name in ("rld", "md")}
        return self

    async def stop(self) -> None:
        for svc in (self.rld, self.md):
            await svc.shutdown()

    def service(self, role: str) -> DecoderService:
        return self.rld if role == "rld" else self.md

    def task_names(self, role: str) -> list[str]:
        return sorted(t.get_coro().__qualname__ for t in self.service(role)._tasks if not t.done())

    # -- what the scheduler and prefill do -------------------------------------------------
    async def dispatch(
        self,
        rid: str,
        prompt: list[int],
        n: int,
        pipeline: str,
        handoff: str = "none",
        roles: tuple[str, ...] = (),
        secret: str = "",
        **sampling,
    ) -> list[Ack]:
        plan = Plan(
            rid,
            pipeline=pipeline,
            handoff=handoff,
            prefill="prefill-0",
            rld="rld-0" if "rld" in pipeline else "",
            md="md-0" if pipeline.endswith("md") else "",
            stream_key=f"key-{rid}",  # the gateway's: the decoders publish the stream under it
        )
        task = DecodeTask(
            rid,
            prompt,
            Sampling(max_tokens=n, ignore_eos=True, **sampling),
            plan,
            transfer_secret=secret or f"secret-{rid}",
        )
        self.sampling[rid] = task.sampling
        self.chunks[rid] = []
        await self.bus.subscribe(subjects.tokens(rid, plan.stream_key), TokenChunk, self.chunks[rid].append)
        roles = roles or tuple(r for r in ("rld", "md") if getattr(plan, r))
        return [await self.bus.request(subjects.decode_task(getattr(plan, r)), task, Ack, 5) for r in roles]

    def transfer(
        self, rid: str, prompt: list[int], via_wan: bool, start: int = 0, wire: str = "native", secret: str = ""
    ) -> Transfer:
        """Prefill's push: the KV of [start, prompt) and the first token, as the receiver gets it."""
        e = self.prefill_engine
        params = self.sampling[rid] if rid in self.sampling else greedy(1)
        seq = Sequence(rid, list(prompt), params, hold_kv=True, max_new=1)
        e.add(seq)
        first = None
        while first is None:
            first = next((o for o in e.step() if o.seq_id == rid), None)
        payload = export_kv(e.pool, e.held[rid].block_table, start, len(prompt))
        e.release(rid)
        layers = [layer_to_bytes(k, v, wire) for k, v in payload.layers]
        head = TransferHead(
            request_id=rid,
            sender="prefill-0",
            secret=secret or f"secret-{rid}",
            kv=dataclasses.replace(payload.header, wire=wire),
            wan=via_wan,
        )
        first_token = FirstToken(first.token_id, RequestStats(prefill_ms=1.0), logprob=first.logprob)
        parts = [Part(start, len(prompt), layers)] if start < len(prompt) else []
        return Transfer(head, parts=parts, first=first_token, wire_bytes=sum(map(len, layers)))

    async def land(self, role: str, rid: str, prompt: list[int], transfer: Transfer | None = None) -> str:
        """What the KV listener does with a transfer: vet its header, then hand it over."""
        svc, t = self.service(role), transfer or self.transfer(rid, prompt, via_wan=role == "md")
        verdict, why = await svc.vet(t)
        if verdict == Verdict.REFUSE:
            return f"refused: {why}"
        return "" if verdict == Verdict.HAVE_IT else await svc.on_transfer(t)

    # -- running both processes ------------------------------------------------------------
    async def settle(self, rounds: int = 20) -> None:
        """Let every ready task run (messages delivered, handlers answered); no time passes."""
        for _ in range(rounds):
            await asyncio.sleep(0)

    async def drive(self, until: Callable[[], bool], rounds: int = 400, roles: tuple[str, ...] = ("rld", "md")) -> None:
        for _ in range(rounds):
            await self.settle()
            if until():
                return
            for role in roles:
                if self.engines[role].has_work:
                    self.service(role).worker.step()
        raise AssertionError("the condition never held")

    def finished(self, rid: str) -> bool:
        return any(c.finish_reason is not None for c in self.chunks.get(rid, ()))

    def logprobs(self, rid: str) -> dict[int, Logprob]:
        """index -> the logprobs its first copy carried (requests that asked for them)."""
        out: dict[int, Logprob] = {}
        for c in self.chunks[rid]:
            for i, lp in enumerate(c.logprobs or ()):
                out.setdefault(c.index + i, lp)
        return out

    def tokens(self, rid: str) -> dict[int, tuple[int, str]]:
        """index -> (token, role that sent it); a repeated index must carry the same token."""
        out: dict[int, tuple[int, str]] = {}
        for c in self.chunks[rid]:
            for i, t in enumerate(c.token_ids):
                if c.index + i in out:
                    assert out[c.index + i][0] == t, f"index {c.index + i} sent twice with different tokens"
                out.setdefault(c.index + i, (t, c.role))
        return out

    def assert_gone(self, rid: str) -> None:
        """No state, no task and no block left for `rid` anywhere."""
        for role in ("rld", "md"):
            svc = self.service(role)
            assert rid not in svc.requests and rid not in svc.parked, (role, svc.requests.get(rid))
            assert self.task_names(role) == self.baseline[role], (role, self.task_names(role))
            assert idle(self.engines[role]), (role, self.engines[role].running, self.engines[role].pool.num_free_blocks)
        assert not [t for t in self.nats.tasks if not t.done()], "a message handler is still running"
