"""The previous answer, prefilled ahead (services/prefill/warm.py), on a real engine thread: a
finished request's prompt and answer come back as token ids and land in prefill's prefix cache,
only while nothing else is held here, so the session's next turn prefills only what is new."""

from __future__ import annotations

import asyncio

from shared import subjects
from shared.messages import Abort, Ack, Inspect, Warm
from shared.prefix_hash import namespace_of
from tests.decoder.harness import BLOCK
from tests.prefill.test_task import DEADLINE_S, _task, _until

PROMPT = list(range(3, 40))  # test_task's prompt: 37 tokens
ANSWER = list(range(60, 100))  # 40 tokens main-decode generated, which this cache never saw


async def cached_tokens(prefill, tokens: list[int], salt: str = "") -> int:
    def match(e) -> int:
        blocks = e.cache.match(tokens, namespace_of(prefill.cfg.model, salt))
        e.pool.allocator.free(blocks)  # the match's own references
        return len(blocks) * BLOCK

    return await prefill.worker.call(match)


async def test_a_finished_answer_lands_in_the_cache_once_prefill_is_idle(prefill):
    scheduler, gateway = prefill.nats.client("scheduler"), prefill.nats.client("gateway")
    # a decoder that takes the push and never answers it: the request stays held here until aborted
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    task = _task("busy")
    task.targets[0].port = server.sockets[0].getsockname()[1]
    try:
        assert (await scheduler.request(subjects.prefill_task("prefill-0"), task, Ack, DEADLINE_S)).ok
        whole = PROMPT + ANSWER
        await gateway.publish(subjects.prefill_warm("prefill-0"), Warm("r0", whole))
        await _until(
            lambda: prefill.warmer.queue and prefill.requests["busy"].tasks, "the offer queued, the push begun"
        )
        assert await cached_tokens(prefill, whole) <= len(PROMPT) and prefill.warmer.warmed == 0  # it waits
        await scheduler.publish(subjects.ABORT, Abort("busy"))
    finally:
        server.close()
    await _until(lambda: prefill.warmer.warmed == 1, "the answer to be warmed")
    assert await cached_tokens(prefill, whole) == len(whole) // BLOCK * BLOCK  # every full block, answer too
    assert await cached_tokens(prefill, whole, salt="other-tenant") == 0  # tenants stay apart
    assert not prefill.held_requests() and not prefill.warmer.queue


async def test_a_bad_offer_is_dropped_and_the_next_one_goes_on(prefill):
    gateway = prefill.nats.client("gateway")
    await gateway.publish(subjects.prefill_warm("prefill-0"), Warm("bad", [10**9]))  # not in the vocabulary
    await gateway.publish(subjects.prefill_warm("prefill-0"), Warm("r1", PROMPT + ANSWER))
    await _until(lambda: prefill.warmer.warmed == 1, "the good answer to be warmed")
    await asyncio.sleep(0)
    assert prefill.warmer.warmed == 1 and not prefill.warmer.queue


async def test_a_cache_flush_drops_the_answers_waiting_to_be_warmed(prefill):
    """An operator's flush leaves nothing to land in the cache after it (the bench flushes
    between modes and expects a cold cache)."""
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    task = _task("busy")
    task.targets[0].port = server.sockets[0].getsockname()[1]
    scheduler, gateway = prefill.nats.client("scheduler"), prefill.nats.client("gateway")
    try:
        assert (await scheduler.request(subjects.prefill_task("prefill-0"), task, Ack, DEADLINE_S)).ok
        await gateway.publish(subjects.prefill_warm("prefill-0"), Warm("r0", PROMPT + ANSWER))
        await _until(lambda: prefill.warmer.queue, "the offer to be queued")
        await scheduler.publish(subjects.ABORT, Abort("busy"))
        await _until(lambda: not prefill.held_requests(), "the request to be let go")
        state = await prefill._flush_cache(Inspect())
    finally:
        server.close()
    assert state.figures.engine.cached_blocks == 0 and not prefill.warmer.queue
    assert await cached_tokens(prefill, PROMPT + ANSWER) == 0 and prefill.warmer.warmed in (0, 1)
