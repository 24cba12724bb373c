"""A lost token chunk (core NATS is at-most-once): the gateway notices the gap within a bound of
the request's step time and the line's round trip, asks the plan's decoders again by index
(`Resend`), and the stream ends whole; a holder that answers it holds nothing moves the request."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace

import pytest

from services.gateway.auth import OPEN
from services.gateway.errors import APIError
from services.gateway.flow import RequestFlow, StreamError
from services.gateway.gaps import GAP_MIN_S, GapWatch
from services.gateway.openai_api import ParsedRequest
from shared import subjects
from shared.config import load_config
from shared.messages import Plan, Resend, Resent, Sampling, TokenChunk
from tests.fakes import InMemoryNats
from tests.gateway.test_flow_timeout import Vocab

TOKENS = list(range(100, 112))


def flow(bus, max_migrations: int = 2) -> RequestFlow:
    async def alive_ids() -> set[str]:
        return {"md-0", "rld-0"}  # nobody died: only a resend can fill the gap

    cfg = dataclasses.replace(load_config(None), max_migrations=max_migrations)
    gw = SimpleNamespace(cfg=cfg, tokenizer=Vocab(), vocab_size=1000, alive_ids=alive_ids, bus=bus)
    parsed = ParsedRequest(
        kind="completion", model="m", prompt_ids=[1, 2], sampling=Sampling(max_tokens=len(TOKENS)), stream=True
    )
    f = RequestFlow(gw, parsed, OPEN, "cmpl-lost")
    plan = Plan("cmpl-lost", prefill="prefill-0", rld="rld-0", md="md-0", dispatch_id="d2")
    f.plan, f.holders = plan, {"md-0"}
    return f


async def serve_resends(nats: InMemoryNats, instance: str, held: bool, asked: list) -> None:
    async def on_resend(msg: Resend) -> Resent:
        asked.append((instance, msg.index))
        if not held:
            return Resent(held=False)
        chunk = TokenChunk(
            msg.request_id, msg.index, TOKENS[msg.index :], role="md", instance_id=instance, finish_reason="length"
        )
        return Resent(held=True, chunk=chunk)

    await nats.client(instance).serve(subjects.decode_resend(instance), Resend, on_resend)


async def test_a_gap_and_a_lost_end_are_asked_about_once_and_filled():
    nats, asked = InMemoryNats(), []
    await serve_resends(nats, "md-0", True, asked)
    await serve_resends(nats, "rld-0", False, asked)  # the relay let go: md alone answers
    f = flow(nats.client("gateway"))
    for i in (0, 1, 3, 4):  # index 2 and everything after 4 (the final chunk) were lost
        f._queue.put_nowait(TokenChunk(f.attempt_id, i, [TOKENS[i]], role="md", instance_id="md-0"))
    # without the resend it would wait for timeouts.request_s (600 s here): the wait_for fails first
    text = await asyncio.wait_for(_text(f), 60)
    assert text == Vocab().decode(TOKENS) and f.finish_reason == "length"
    assert sorted(asked) == [("md-0", 2), ("rld-0", 2)], "asked once, from the first missing index"
    assert f.stats.resends == 1
    assert f.stats.tokens_by_role == {"prefill": 0, "rld": 0, "md": len(TOKENS)}, "each token counted once"


async def test_a_holder_that_holds_nothing_moves_the_request():
    nats, asked = InMemoryNats(), []
    await serve_resends(nats, "md-0", False, asked)  # e.g. it was told to forget it
    f = flow(nats.client("gateway"), max_migrations=0)
    f._queue.put_nowait(TokenChunk(f.attempt_id, 0, [TOKENS[0]], role="md", instance_id="md-0"))
    with pytest.raises(StreamError, match="md-0 no longer holds the request"):
        await asyncio.wait_for(_drain(f), 10)
    assert ("md-0", 1) in asked


async def _text(f: RequestFlow) -> str:
    return "".join([d.text async for d in f.deltas()])


def test_the_gap_bound_follows_the_stream_and_backs_off():
    gaps = [0.2] * 8  # a slow stream: 0.2 s a token
    watch = GapWatch(gaps, rtt_s=0.1, now=0.0)
    assert watch.due(0.6) == pytest.approx(1.0 - 0.6)  # a few token gaps and two round trips: 1.0 s
    assert not watch.ask_now(0.9) and watch.ask_now(1.0)
    assert not watch.ask_now(2.9) and watch.ask_now(3.0), "asked once: the next ask waits twice as long"
    watch.advanced(3.5)  # a token came in order: the bound starts again from 1x
    assert not watch.ask_now(4.4) and watch.ask_now(4.5)
    gaps[:] = [0.01] * 16  # a fast stream: the floor applies
    assert not watch.ask_now(4.5 + 2 * GAP_MIN_S - 0.01) and watch.ask_now(4.5 + 2 * GAP_MIN_S), "twice the floor"


async def _drain(f: RequestFlow) -> None:
    async for _ in f.deltas():
        pass


async def test_the_first_token_comes_from_prefill_and_the_decoders_copy_only_ends_it():
    """Prefill streams index 0 the moment it is sampled (first_token: prefill); the decoder sends
    it again with the finish. One copy reaches the text; a first token from a prefill the plan
    did not choose, or from a dispatch the scheduler dropped and planned again (on the same
    prefill: the dropped copy's sampled first token may differ), is not taken."""
    f = flow(InMemoryNats().client("gateway"))
    f.parsed = dataclasses.replace(f.parsed, sampling=Sampling(max_tokens=1))
    for prefill, dispatch_id, token in (("prefill-9", "d1", 5), ("prefill-0", "d1", 6), ("prefill-0", "d2", 0)):
        chunk = TokenChunk(f.attempt_id, 0, [TOKENS[token]], role="prefill", instance_id=prefill)
        f._queue.put_nowait(dataclasses.replace(chunk, dispatch_id=dispatch_id))
    f._queue.put_nowait(TokenChunk(f.attempt_id, 0, [TOKENS[0]], role="md", instance_id="md-0", finish_reason="length"))
    text = await asyncio.wait_for(_text(f), 10)
    assert text == Vocab().decode(TOKENS[:1]) and f.finish_reason == "length"
    assert f.stats.tokens_by_role == {"prefill": 1, "rld": 0, "md": 0}
    assert f.stats.first_token_at and f._reassembler.duplicates == 1


async def test_chunks_that_cannot_be_this_streams_are_dropped_and_hold_nothing():
    """A chunk from an instance the plan does not name, past the request's budget (index 10^9),
    too long (200k ids) or with ids outside the vocabulary changes nothing: the stream is the
    planned decoders' tokens, and nothing is held for the forged positions."""
    nats = InMemoryNats()
    f = flow(nats.client("gateway"))
    forged = [
        TokenChunk(f.attempt_id, 0, [7] * 3, role="md", instance_id="md-9"),
        TokenChunk(f.attempt_id, 10**9, [7], role="md", instance_id="md-0"),
        TokenChunk(f.attempt_id, 1, [7] * 200_000, role="md", instance_id="md-0"),
        TokenChunk(f.attempt_id, 1, [10**6], role="md", instance_id="md-0"),
        TokenChunk(f.attempt_id, 0, [7], role="md"),  # no sender at all
    ]
    for chunk in forged:
        f._queue.put_nowait(chunk)
    real = TokenChunk(f.attempt_id, 0, TOKENS, role="md", instance_id="md-0", finish_reason="length")
    f._queue.put_nowait(real)
    text = await asyncio.wait_for(_text(f), 30)
    assert text == Vocab().decode(TOKENS) and f.stats.refused_chunks == len(forged)
    assert f._reassembler.buffered == 0 and f._reassembler.conflicts == 0


async def test_a_holder_that_only_dropped_out_of_the_registry_is_planned_again_once_back():
    """NATS A restarts: prefill-0's heartbeats pause, the gateway finds it gone and moves the
    request, but no other prefill is alive (503). The admitted stream waits instead of failing, and
    once prefill-0 is registered again it may be planned: it did not fail, it only went quiet."""
    nats, alive, plans = InMemoryNats(), {"md-0"}, []
    f = flow(nats.client("gateway"))
    f.holders = {"prefill-0", "md-0"}

    async def alive_ids() -> set[str]:
        return set(alive)

    async def forget_request(attempt_id: str) -> None:
        pass

    async def submit(prompt_ids, sampling, pipeline) -> None:
        plans.append(sorted(f.avoid))
        if "prefill-0" in f.avoid or "prefill-0" not in alive:
            if len(plans) == 2:
                alive.add("prefill-0")  # registered again after the first refusals
            raise APIError(503, "no alive prefill instance")

    f.gw.alive_ids, f.gw.forget_request, f._submit = alive_ids, forget_request, submit
    f._sub = await nats.client("gateway").subscribe(subjects.tokens(f.attempt_id), TokenChunk, f._queue.put_nowait)
    f._gap = GapWatch([], 0.02, 0.0)
    assert await f._next_chunk() is None  # found prefill-0 gone and moved the request
    assert plans[:2] == [["prefill-0"], ["prefill-0"]] and plans[-1] == [], plans
    assert f.stats.migrations == 1 and f.attempt_id.startswith("cmpl-lost.m1")


async def test_a_moved_request_with_no_instance_of_a_role_fails_after_a_bounded_wait():
    nats = InMemoryNats()
    f = flow(nats.client("gateway"))
    f.gw.cfg = dataclasses.replace(
        f.gw.cfg, heartbeat_ttl_s=1.0, timeouts=dataclasses.replace(f.gw.cfg.timeouts, control_s=0.2)
    )  # a window of 2.2 s: retries 0.1-0.2 s apart fit several even where each sleep wakes late
    tries = []

    async def forget_request(attempt_id: str) -> None:
        pass

    async def submit(prompt_ids, sampling, pipeline) -> None:
        tries.append(pipeline)
        raise APIError(503, "no alive md instance")

    f.gw.forget_request, f._submit = forget_request, submit
    f._sub = await nats.client("gateway").subscribe(subjects.tokens(f.attempt_id), TokenChunk, f._queue.put_nowait)
    with pytest.raises(StreamError, match="no alive md instance"):
        await f._migrate({"md-0"})
    assert len(tries) > 2  # it waited for one to come back (2.2 s here), then gave up with the reason
