"""The per-request timeout (`timeouts.request_s`): a request whose holders are alive but send no
token for that long fails with a StreamError (the client's SSE `error` event), while one that
keeps receiving tokens runs past it."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import SimpleNamespace

import pytest

from services.gateway.auth import OPEN
from services.gateway.flow import RequestFlow, StreamError
from services.gateway.openai_api import ParsedRequest
from shared.config import load_config
from shared.messages import Plan, Sampling, TokenChunk

LIMIT_S = 0.4


class Vocab:
    """Token i decodes to "t<i> " (enough for the detokenizer)."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return "".join(f"t{i} " for i in ids)


def flow(limit_s: float = LIMIT_S) -> RequestFlow:
    cfg = load_config(None)
    cfg = dataclasses.replace(cfg, timeouts=dataclasses.replace(cfg.timeouts, request_s=limit_s))

    async def alive_ids() -> set[str]:
        return {"md-0"}  # its holder is alive: only the timeout can end it

    gw = SimpleNamespace(cfg=cfg, tokenizer=Vocab(), vocab_size=1000, alive_ids=alive_ids)
    parsed = ParsedRequest(
        kind="completion", model="m", prompt_ids=[1, 2], sampling=Sampling(max_tokens=50), stream=True
    )
    f = RequestFlow(gw, parsed, OPEN, "cmpl-timeout")
    f.plan, f.holders = Plan("cmpl-timeout", prefill="prefill-0", md="md-0"), {"md-0"}
    return f


async def test_a_request_with_no_token_for_request_s_fails():
    f, t0 = flow(), time.perf_counter()

    async def drain() -> None:
        async for _ in f.deltas():
            pass

    with pytest.raises(StreamError, match="no token for"):
        await asyncio.wait_for(drain(), 10)  # without the timeout it would wait here forever
    # the check runs after each quiet second: it fires within a second of the limit
    assert LIMIT_S <= time.perf_counter() - t0 < LIMIT_S + 2.5


async def test_tokens_that_keep_coming_run_past_request_s():
    # a limit of its own, far above the feeder's pace: a sleep that wakes late on a loaded host
    # (0.2 s past a pace of 0.3 s against a limit of 0.4 s failed) must not read as a stall
    limit_s, pace_s = 1.5, 0.3
    f = flow(limit_s)

    async def feed() -> None:
        for i in range(8):  # 8 tokens over ~2.4 s, each well within the limit of the one before
            await asyncio.sleep(pace_s)  # the pace of a slow stream is the scenario, not a wait for state
            finish = "length" if i == 7 else None
            f._queue.put_nowait(
                TokenChunk(f.attempt_id, i, [100 + i], role="md", instance_id="md-0", finish_reason=finish)
            )

    feeder, t0 = asyncio.create_task(feed()), time.perf_counter()
    text = "".join([d.text async for d in f.deltas()])
    await feeder
    assert text == "".join(f"t{100 + i} " for i in range(8)) and f.finish_reason == "length"
    assert time.perf_counter() - t0 > 1.5 * limit_s  # ran past the limit without failing
