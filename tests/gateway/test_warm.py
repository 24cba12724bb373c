"""A finished request's prompt and answer go back to the prefill that served it (`Warm`): the
session's next turn, which holds the answer, finds it in prefill's cache. An unfinished one is
aborted instead, and sends nothing."""

from __future__ import annotations

import asyncio
import dataclasses

from shared import subjects
from shared.messages import Abort, Sampling, TokenChunk, Warm
from tests.fakes import InMemoryNats
from tests.gateway.test_flow_recovery import TOKENS, flow


def closing_flow(nats: InMemoryNats, warm: bool = True):
    f = flow(nats.client("gateway"))
    f.parsed = dataclasses.replace(f.parsed, sampling=Sampling(max_tokens=3))

    async def forget_request(_: str) -> None:
        return None

    f.gw.cfg = dataclasses.replace(f.gw.cfg, warm_prefill=warm)
    f.gw.cache_salt, f.gw.forget_request = (lambda key: "tenant-salt"), forget_request
    return f


async def drain(f) -> None:
    async def run():
        async for _ in f.deltas():
            pass

    await asyncio.wait_for(run(), 10)


async def test_a_finished_request_warms_its_prefill_and_an_unfinished_one_does_not():
    nats = InMemoryNats()
    warmed, aborted = [], []
    listener = nats.client("prefill-0")
    await listener.subscribe(subjects.prefill_warm("prefill-0"), Warm, warmed.append)
    await listener.subscribe(subjects.ABORT, Abort, aborted.append)
    done = closing_flow(nats)
    done._queue.put_nowait(
        TokenChunk(done.attempt_id, 0, TOKENS[:3], role="md", instance_id="md-0", finish_reason="length")
    )
    await drain(done)
    await done.close()
    assert warmed == [Warm(done.attempt_id, [1, 2, *TOKENS[:3]], "tenant-salt")] and not aborted
    gone = closing_flow(nats)  # the client left before the end
    await gone.close()
    assert len(warmed) == 1 and [a.request_id for a in aborted] == [gone.attempt_id]
    off = closing_flow(nats, warm=False)
    off._queue.put_nowait(
        TokenChunk(off.attempt_id, 0, TOKENS[:3], role="md", instance_id="md-0", finish_reason="length")
    )
    await drain(off)
    await off.close()
    assert len(warmed) == 1
