"""A KV connection dialed before its KV exists (`EarlyConnection`), through the real line with
mutual TLS: the handshakes cross the WAN while prefill would still be computing, the push then
runs on that very connection, and one that goes unused is closed cleanly by the sender, which
the receiver does not count as a refused transfer."""

from __future__ import annotations

import asyncio

import pytest

from pdd.servers import free_port
from shared.kv_receive import KVReceiver
from shared.kv_send import EarlyConnection, send_kv
from shared.kv_transport import Part
from shared.messages import WanControl
from tests.wanlink.conftest import until
from tests.wanlink.test_tls import KV, LAYERS, push, receiver


def connections(link) -> int:
    return link.control(WanControl()).connections.get("md-0", 0)


def accepted(link) -> int:
    return link.control(WanControl()).accepted.get("md-0", 0)


async def settle(rx: KVReceiver, link) -> None:
    await until(lambda: not rx._per_peer and not connections(link), what="every KV connection to close")


async def test_the_push_runs_on_the_connection_dialed_before_its_kv(make_link, secrets, refusals):
    rx, got = await receiver(secrets)
    link = await make_link({"md-0": ("A", rx.port)}, delay_ms=20.0)
    early = EarlyConnection("127.0.0.1", link.ports["md-0"], 10.0, secrets.kv_client_context("prefill-0"), "md-0")
    # handshakes done, across the line, with no KV to send yet: the receiver holds the connection
    await until(lambda: sum(rx._per_peer.values()) == 1, what="md-0 to accept the early connection")
    assert accepted(link) == 1 and got == []
    conn = await early.take()
    assert conn is not None and early.outcome == "used"
    sent_push = push()
    await send_kv("127.0.0.1", link.ports["md-0"], sent_push, 10.0, conn=conn)
    [transfer] = got
    assert transfer.head == sent_push.head and transfer.parts == [Part(0, KV.end, LAYERS)]
    assert transfer.first == sent_push.first
    assert accepted(link) == 1  # no second connection: the push went on the early one
    await settle(rx, link)
    assert rx.refused == 0 and refusals() == []
    await rx.stop()


async def test_an_early_connection_unused_past_its_hold_is_closed_quietly(make_link, secrets, refusals):
    rx, got = await receiver(secrets)  # waits 10 s for a header
    link = await make_link({"md-0": ("A", rx.port)}, delay_ms=5.0)
    tls = secrets.kv_client_context("prefill-0")
    early = EarlyConnection("127.0.0.1", link.ports["md-0"], 10.0, tls, "md-0", hold_s=0.3)
    await until(lambda: early.settled, what="the sender to give the unused connection up")
    assert early.outcome == "unused"
    await settle(rx, link)  # closed cleanly, well before the receiver's own 10 s: not a refusal
    assert rx.refused == 0 and refusals() == [] and got == []
    assert await early.take() is None  # too late: the push dials its own
    await send_kv("127.0.0.1", link.ports["md-0"], push(), 10.0, tls=tls, server_name="md-0")
    assert len(got) == 1 and accepted(link) == 2
    await rx.stop()


async def test_by_default_the_sender_gives_up_before_the_receiver_would(make_link, secrets, refusals):
    """Both sides run with the same stall deadline (the cluster's kv_stall_s): the receiver waits
    that long for a header, the sender holds an unused connection for half of it."""
    # 3 s between the sender's give-up and the receiver's: a stalled loop on a loaded host fired
    # both in one turn with 0.3 s between them
    rx, got = await receiver(secrets, stall_s=6.0)
    link = await make_link({"md-0": ("A", rx.port)})
    early = EarlyConnection("127.0.0.1", link.ports["md-0"], 6.0, secrets.kv_client_context("prefill-0"), "md-0")
    await until(lambda: early.settled, what="the sender to give the unused connection up")
    await settle(rx, link)
    assert rx.refused == 0 and refusals() == [] and got == []
    await rx.stop()


async def test_an_early_connection_closed_by_its_request_ends_at_once(make_link, secrets, refusals):
    rx, _ = await receiver(secrets)
    link = await make_link({"md-0": ("A", rx.port)})
    early = EarlyConnection("127.0.0.1", link.ports["md-0"], 10.0, secrets.kv_client_context("prefill-0"), "md-0")
    await until(lambda: sum(rx._per_peer.values()) == 1, what="md-0 to accept the early connection")
    early.close()  # the request was aborted before its KV was ready
    await settle(rx, link)
    assert early.outcome == "unused" and early.settled and rx.refused == 0 and refusals() == []
    assert await early.take() is None
    await rx.stop()


async def test_a_failed_early_dial_leaves_the_push_to_dial_its_own(secrets):
    port = free_port()  # nothing listens there yet
    early = EarlyConnection("127.0.0.1", port, 5.0, secrets.kv_client_context("prefill-0"), "md-0")
    assert await early.take() is None and early.outcome == "failed"


async def test_a_push_cancelled_while_its_early_connection_dials_cancels_the_dial(make_link, secrets):
    rx, _ = await receiver(secrets)
    link = await make_link({"md-0": ("A", rx.port)}, delay_ms=200.0)  # the handshakes take ~0.8 s
    early = EarlyConnection("127.0.0.1", link.ports["md-0"], 10.0, secrets.kv_client_context("prefill-0"), "md-0")
    taking = asyncio.create_task(early.take())
    await until(lambda: accepted(link) == 1, what="the dial to reach the line")
    taking.cancel()  # the request's push task, aborted
    with pytest.raises(asyncio.CancelledError):
        await taking
    assert early.settled
    await settle(rx, link)
    await rx.stop()


async def test_a_connection_ready_just_as_its_push_is_cancelled_is_closed(make_link, secrets, refusals):
    rx, _ = await receiver(secrets, stall_s=30.0)  # it would hold an orphaned connection that long
    link = await make_link({"md-0": ("A", rx.port)})
    early = EarlyConnection("127.0.0.1", link.ports["md-0"], 10.0, secrets.kv_client_context("prefill-0"), "md-0")
    taking: asyncio.Task | None = None
    # the push is cancelled in the very turn the dial completes, before `take` resumes with the result
    early._task.add_done_callback(lambda _: taking.cancel())
    taking = asyncio.create_task(early.take())
    with pytest.raises(asyncio.CancelledError):
        await taking
    assert early.outcome == "used"  # handed over, then its taker went away: `take` closes it
    await settle(rx, link)
    assert rx.refused == 0 and refusals() == []
    await rx.stop()
