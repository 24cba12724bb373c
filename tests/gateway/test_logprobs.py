"""Logprobs on the gateway: each token's, from whichever role sampled it, joined in stream order
(the first copy of a position wins, as its token does), and rendered in each endpoint's shape."""

from __future__ import annotations

import asyncio
import dataclasses

from services.gateway.flow import RequestFlow
from services.gateway.responses import LogprobsView, chunk, whole
from shared.messages import Logprob, Sampling, TokenChunk
from tests.fakes import InMemoryNats
from tests.gateway.test_flow_recovery import TOKENS, flow
from tests.gateway.test_flow_timeout import Vocab


def lp(token: int, value: float) -> Logprob:
    return Logprob(value, [token, token + 1], [value, value - 1.0])


def asking(kind: str = "completion", logprobs: int | None = 2, max_tokens: int = 4) -> RequestFlow:
    f = flow(InMemoryNats().client("gateway"))
    sampling = Sampling(max_tokens=max_tokens, logprobs=logprobs)
    f.parsed = dataclasses.replace(f.parsed, kind=kind, sampling=sampling)
    return f


async def deltas(f: RequestFlow) -> list:
    async def collect():
        return [d async for d in f.deltas()]

    return await asyncio.wait_for(collect(), 10)


async def test_logprobs_from_every_role_join_in_stream_order():
    f = asking()
    t = TOKENS
    f._queue.put_nowait(
        TokenChunk(
            f.attempt_id,
            0,
            [t[0]],
            role="prefill",
            instance_id="prefill-0",
            dispatch_id="d2",
            logprobs=[lp(t[0], -0.5)],
        )
    )
    # the relay, then main-decode after a catch-up handoff, resending position 2 (its copy is not taken)
    f._queue.put_nowait(
        TokenChunk(f.attempt_id, 1, t[1:3], role="rld", instance_id="rld-0", logprobs=[lp(t[1], -1.0), lp(t[2], -1.5)])
    )
    f._queue.put_nowait(
        TokenChunk(f.attempt_id, 10**9, [t[5]], role="md", instance_id="md-0", logprobs=[lp(t[5], -9.0)])
    )  # no room kept
    last = TokenChunk(
        f.attempt_id,
        2,
        t[2:4],
        role="md",
        instance_id="md-0",
        finish_reason="length",
        logprobs=[lp(t[2], -7.0), lp(t[3], -2.0)],
    )
    f._queue.put_nowait(last)
    out = await deltas(f)
    joined = [pair for d in out for pair in d.logprobs]
    assert joined == [(t[0], lp(t[0], -0.5)), (t[1], lp(t[1], -1.0)), (t[2], lp(t[2], -1.5)), (t[3], lp(t[3], -2.0))]
    assert not f._logprobs  # nothing kept past the end


async def test_a_request_that_did_not_ask_gets_none():
    f = asking(logprobs=None, max_tokens=1)
    f._queue.put_nowait(TokenChunk(f.attempt_id, 0, [TOKENS[0]], role="md", instance_id="md-0", finish_reason="length"))
    out = await deltas(f)
    assert all(not d.logprobs for d in out)
    assert LogprobsView(f, Vocab()).render([]) is None


def test_chat_and_completions_shapes():
    tokens = [(100, lp(100, -0.25)), (101, lp(101, -0.5))]
    view = LogprobsView(asking("chat"), Vocab())
    content = view.render(tokens)["content"]
    assert content[0] == {
        "token": "t100 ",
        "logprob": -0.25,
        "bytes": list(b"t100 "),
        "top_logprobs": [
            {"token": "t100 ", "logprob": -0.25, "bytes": list(b"t100 ")},
            {"token": "t101 ", "logprob": -1.25, "bytes": list(b"t101 ")},
        ],
    }
    completion = LogprobsView(asking("completion"), Vocab())
    first, second = completion.render(tokens[:1]), completion.render(tokens[1:])  # two deltas
    assert first == {
        "tokens": ["t100 "],
        "token_logprobs": [-0.25],
        "top_logprobs": [{"t100 ": -0.25, "t101 ": -1.25}],
        "text_offset": [0],
    }
    assert second["text_offset"] == [5]  # counted across the deltas
    f = asking("chat")
    assert (
        chunk(f, "m", "x", None, True, view.render(tokens))["choices"][0]["logprobs"]["content"][1]["logprob"] == -0.5
    )
    assert whole(f, "m", "x", "stop", None, {"content": []})["choices"][0]["logprobs"] == {"content": []}
