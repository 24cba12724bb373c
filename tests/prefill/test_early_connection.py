"""Prefill dials main-decode's KV connection when the task arrives, on a real engine stepped by
hand (`ManualWorker`, so the KV is ready only when the test says) and a real KV receiver on
loopback: the connection is open before any prefill step, the push then uses it (one
connection in all), an abort closes it at once without a refusal on the receiver, in-DC targets
are not dialed early, and at most `EARLY_CONNECTIONS_PER_DECODER` wait per decoder. After a push
its connection stands idle (`KVConnections`): the next request's early connection is that one,
no second dial; shutdown closes it."""

from __future__ import annotations

import asyncio

import pytest

from services.prefill.service import EARLY_CONNECTIONS_PER_DECODER, Prefiller
from shared import subjects
from shared.config import config_from_dict
from shared.kv_receive import KVReceiver
from shared.kv_send import alive
from shared.kv_transport import Transfer
from shared.messages import Abort, Ack, KVTarget, Plan, PrefillTask, Sampling
from tests.decoder.harness import CONFIG, engine, idle
from tests.fakes import InMemoryNats, ManualWorker
from tests.helpers import until

DEADLINE_S = 30.0


class Receiver(KVReceiver):
    """main-decode's KV listener (any transfer accepted), counting the connections it took."""

    def __init__(self) -> None:
        super().__init__(self._handle, stall_s=10.0)
        self.accepted = 0
        self.got: list[Transfer] = []

    async def _handle(self, transfer: Transfer) -> str:
        self.got.append(transfer)
        return ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        await super()._serve(reader, writer)

    @property
    def open(self) -> int:
        return sum(self._per_peer.values())

    @property
    def idle(self) -> int:
        """Connections between transfers, waiting for the next HEADER."""
        return sum(len(v) for v in self._idle.values())


class Rig:
    def __init__(self, service: Prefiller, worker: ManualWorker, rx: Receiver) -> None:
        self.service, self.worker, self.rx = service, worker, rx
        self.scheduler = service.nats.client("scheduler")
        self.baseline = self.task_names()  # the service's own loops (heartbeat, ...)

    def task_names(self) -> list[str]:
        return sorted(t.get_coro().__qualname__ for t in self.service._tasks if not t.done())

    def task(self, rid: str, relay: bool = False) -> PrefillTask:
        md = KVTarget("md-0", "md", "127.0.0.1", self.rx.port, transfer_secret=f"md-{rid}", wan=True)
        rld = KVTarget("rld-0", "rld", "127.0.0.1", self.rx.port, transfer_secret=f"rld-{rid}")
        plan = Plan(rid, pipeline="p-rld-md" if relay else "p-md", prefill="prefill-0", md="md-0")
        targets = [rld, md] if relay else [md]
        return PrefillTask(rid, list(range(3, 40)), Sampling(max_tokens=4), targets, plan)

    async def submit(self, task: PrefillTask) -> None:
        ack = await self.scheduler.request(subjects.prefill_task("prefill-0"), task, Ack, DEADLINE_S)
        assert ack.ok, ack

    def early(self, outcome: str) -> float:
        labels = {**self.service.metrics.constant, "outcome": outcome}
        return self.service.metrics.registry.get_sample_value("pdd:kv_early_connections_total", labels) or 0.0

    def connections(self, how: str, decoder: str = "md-0") -> float:
        """prefill's `pdd:kv_connections_total{decoder, how}`: dialed, reused or stale."""
        labels = {**self.service.metrics.constant, "decoder": decoder, "how": how}
        return self.service.metrics.registry.get_sample_value("pdd:kv_connections_total", labels) or 0.0

    async def settled(self) -> None:
        """No request or task left on either side; the only connections left are standing idle
        ones, as many on each side."""
        service = self.service
        await until(lambda: not service.held_requests() and self.task_names() == self.baseline, DEADLINE_S, "no task")
        await until(
            lambda: self.rx.open == self.rx.idle == service.kv_pool.idle(),
            DEADLINE_S,
            "every connection to close or stand idle",
        )
        assert await self.worker.call(idle)


async def _rig(tiny, **settings):
    cfg = config_from_dict({**CONFIG, **settings})
    service = Prefiller(cfg, cfg.instance("prefill-0"))
    service.nats = InMemoryNats()
    worker = ManualWorker(engine(tiny), service.on_outputs)
    await service.start(service.nats.client("prefill-0"), worker)
    rx = Receiver()
    await rx.start()
    return Rig(service, worker, rx)


@pytest.fixture
async def rig(tiny):
    rig = await _rig(tiny)
    yield rig
    await rig.service.shutdown()
    await rig.rx.stop()


@pytest.mark.parametrize("first_token", ["prefill", "decoder"])
async def test_the_first_token_goes_to_the_gateway_before_the_kv_lands(tiny, first_token):
    """`first_token: prefill`: index 0 is on the request's token subject while main-decode has not
    taken its KV (its receiver holds the push unanswered); `decoder` (the naive baseline): only
    the decoder streams it, prefill publishes nothing."""
    rig = await _rig(tiny, first_token=first_token)
    release = asyncio.Event()
    taken = rig.rx.handler

    async def held(transfer: Transfer) -> str:
        await release.wait()
        return await taken(transfer)

    rig.rx.handler = held
    try:
        await rig.submit(rig.task("r1"))
        assert rig.worker.step()  # the prefill: its first token
        tokens = lambda: rig.service.nats.sent(subjects.tokens("r1"))  # noqa: E731
        if first_token == "prefill":
            await until(tokens, DEADLINE_S, "the first token on the token subject")
            (chunk,) = tokens()
            assert (chunk.index, chunk.role, chunk.instance_id, len(chunk.token_ids)) == (0, "prefill", "prefill-0", 1)
            assert rig.rx.got == []
        release.set()
        await until(lambda: rig.rx.got, DEADLINE_S, "the KV to land")
        if first_token == "prefill":  # the decoder gets the same token with the KV
            assert rig.rx.got[0].first.token_id == tokens()[0].token_ids[0]
        await rig.settled()
        assert len(tokens()) == (1 if first_token == "prefill" else 0)
    finally:
        release.set()
        await rig.service.shutdown()
        await rig.rx.stop()


async def test_main_decodes_connection_is_open_before_prefill_and_carries_the_push(rig):
    await rig.submit(rig.task("r1"))
    await until(lambda: rig.rx.open == 1, DEADLINE_S, "main-decode to accept the early connection")
    assert rig.worker.engine.find("r1") is not None and rig.rx.got == []  # not one prefill step yet
    assert rig.worker.step()  # the prefill: first token, then the push
    await until(lambda: rig.rx.got, DEADLINE_S, "the KV to arrive")
    (transfer,) = rig.rx.got
    assert (transfer.request_id, transfer.head.secret, transfer.via_wan) == ("r1", "md-r1", True)
    assert rig.rx.accepted == 1  # the push went on the early connection
    await rig.settled()
    assert (rig.early("used"), rig.early("unused")) == (1, 0) and rig.rx.refused == 0
    assert rig.rx.idle == 1 and rig.service.kv_pool.idle() == 1  # it stands, for the next push


async def test_the_next_request_pushes_on_the_standing_connection_without_a_handshake(rig):
    """Two requests in a row to main-decode: the second's early connection is the first's, taken
    idle (no dial, no TCP or TLS handshake), and both transfers arrive on it whole, in order."""
    for i, rid in enumerate(("r1", "r2")):
        await rig.submit(rig.task(rid))
        assert rig.worker.step()
        await until(lambda i=i: len(rig.rx.got) == i + 1, DEADLINE_S, f"the KV of {rid} to arrive")
        await rig.settled()
    assert [(t.request_id, t.head.secret) for t in rig.rx.got] == [("r1", "md-r1"), ("r2", "md-r2")]
    assert rig.rx.accepted == 1 and rig.rx.transfers == 2  # one connection carried both
    assert (rig.connections("dialed"), rig.connections("reused"), rig.connections("stale")) == (1, 1, 0)
    assert rig.early("used") == 2 and rig.rx.refused == 0
    await rig.service.shutdown()  # closes the standing connection, cleanly: no refusal
    await until(lambda: not rig.rx.open, DEADLINE_S, "the receiver to see it closed")
    assert rig.rx.refused == 0


async def test_a_standing_connection_the_decoder_closed_is_dialed_again(rig):
    """main-decode ends the idle connection (its idle time passed, or it restarted): prefill finds
    it closed when the next task comes, drops it, and dials."""
    await rig.submit(rig.task("r1"))
    assert rig.worker.step()
    await until(lambda: rig.rx.got, DEADLINE_S, "the KV of r1 to arrive")
    await rig.settled()
    await rig.rx.stop()  # closes its idle connections
    await until(lambda: not rig.rx.open, DEADLINE_S, "the receiver to close it")
    rig.rx.server = None
    await rig.rx.start(port=rig.rx.port)  # serving again on the same port
    [standing] = rig.service.kv_pool._idle.values()
    await until(lambda: not alive(standing[0].conn), DEADLINE_S, "prefill's end of it to see the close")
    await rig.submit(rig.task("r2"))  # its early connection: the standing one is dead, dropped; dialed
    assert rig.worker.step()
    await until(lambda: len(rig.rx.got) == 2, DEADLINE_S, "the KV of r2 to arrive")
    await rig.settled()
    assert (rig.connections("dialed"), rig.connections("reused"), rig.connections("stale")) == (2, 0, 1)
    assert rig.rx.accepted == 2 and rig.rx.refused == 0 and rig.early("used") == 2


async def test_an_abort_before_the_kv_closes_the_early_connection_quietly(rig):
    await rig.submit(rig.task("r1"))
    await until(lambda: rig.rx.open == 1, DEADLINE_S, "main-decode to accept the early connection")
    await rig.scheduler.publish(subjects.ABORT, Abort("r1", reason="the client left"))
    await until(lambda: not rig.rx.open, 5.0, "the connection to close (unused, it would last 15 s)")
    await rig.settled()
    assert rig.rx.refused == 0 and rig.rx.got == []
    assert (rig.early("used"), rig.early("unused")) == (0, 1)


async def test_only_wan_targets_dial_early_and_at_most_a_few_per_decoder(rig):
    n = EARLY_CONNECTIONS_PER_DECODER + 2
    for i in range(n):
        await rig.submit(rig.task(f"r{i}", relay=True))
    early = [sorted(s.early) for s in rig.service.requests.values()]
    assert early == [["md-0"]] * EARLY_CONNECTIONS_PER_DECODER + [[]] * 2  # the relay's, in-DC: none
    await until(lambda: rig.rx.open == EARLY_CONNECTIONS_PER_DECODER, DEADLINE_S, "the early connections")
    while len(rig.rx.got) < 2 * n:  # every request prefills and pushes to both decoders
        rig.worker.step()
        await until(lambda: rig.task_names() == rig.baseline or len(rig.rx.got) == 2 * n, DEADLINE_S, "the pushes")
    await rig.settled()
    # one connection per push at a time (the early ones carried theirs), dialed or standing idle
    dialed = rig.connections("dialed", "md-0") + rig.connections("dialed", "rld-0")
    reused = rig.connections("reused", "md-0") + rig.connections("reused", "rld-0")
    assert rig.rx.accepted == dialed and dialed + reused == 2 * n and rig.rx.transfers == 2 * n
    assert rig.early("used") == EARLY_CONNECTIONS_PER_DECODER and rig.rx.refused == 0
