"""The decoder's state machine, driven without processes: a relay and a main-decoder on an
in-memory bus around real engines (tiny Llama) that the test steps by hand.

Every transition (pending -> parked -> running / shadow -> handing off -> handed off or
finished), an abort in every state, main-decode gone during the handoff, and duplicate and
late messages. After each scenario nothing is left for the request: no state, no task, no
block, no message handler still waiting.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from shared import subjects
from shared.decode_state import Phase
from shared.messages import Abort, Ack, Drop, FinishOnRelay, HandoffChunk, KVReady, Sampling
from shared.pipelines import Pipeline
from shared.runtime.sequence import Sequence
from tests.decoder.harness import CONFIG, DecoderPair, idle
from tests.helpers import random_prompts, reference_generate, run_to_completion

N = 24


@pytest.fixture
async def pair(tiny):
    p = await DecoderPair(tiny).start()
    yield p
    await p.stop()


@pytest.fixture
def prompt(tiny) -> list[int]:
    return random_prompts(tiny.config.vocab_size, [40], seed=3)[0]


def _expected(tiny_ref, prompt: list[int], n: int = N) -> list[int]:
    return reference_generate(tiny_ref, prompt, n)


async def _relayed(pair: DecoderPair, prompt: list[int], handoff: str, rid: str = "r1", relay_steps: int = 10) -> None:
    """p-rld-md: the relay's KV lands and it streams `relay_steps` tokens before md's KV lands."""
    await pair.dispatch(rid, prompt, N, Pipeline.P_RLD_MD, handoff)
    assert await pair.land("rld", rid, prompt) == ""
    await pair.drive(lambda: len(pair.tokens(rid)) >= relay_steps, roles=("rld",))
    assert await pair.land("md", rid, prompt) == ""


# -- every pipeline to the end ----------------------------------------------------------------
async def test_p_md_runs_pending_running_finished(pair, prompt, tiny_ref):
    acks = await pair.dispatch("r1", prompt, N, Pipeline.P_MD)
    assert acks[0].ok and pair.md.requests["r1"].phase == Phase.PENDING
    assert await pair.land("md", "r1", prompt) == ""
    assert pair.md.requests["r1"].phase == Phase.RUNNING
    await pair.drive(lambda: pair.finished("r1"))
    assert [t for t, _ in pair.tokens("r1").values()] == _expected(tiny_ref, prompt)
    assert {role for _, role in pair.tokens("r1").values()} == {"md"}
    pair.assert_gone("r1")


@pytest.mark.parametrize("handoff", ["oneshot", "catchup"])
async def test_p_rld_md_hands_over_exactly(pair, prompt, tiny_ref, handoff):
    await _relayed(pair, prompt, handoff)
    assert pair.md.requests["r1"].phase == Phase.SHADOW
    await pair.drive(lambda: pair.finished("r1"))
    tokens = pair.tokens("r1")
    assert [t for t, _ in tokens.values()] == _expected(tiny_ref, prompt)
    roles = [role for _, role in tokens.values()]
    assert roles[0] == "rld" and roles[-1] == "md"
    assert roles == sorted(roles, key=lambda r: r == "md"), "relay tokens, then main-decode tokens"
    final = pair.chunks["r1"][-1].stats
    chunks = pair.nats.sent(subjects.handoff_chunk("md-0"))
    if handoff == "catchup":
        assert len(chunks) >= 3 and final.handoff_chunks == len(chunks) and not chunks[0].final
    else:
        assert len(chunks) == 1 and chunks[0].final and final.handoff_chunks == 1
    assert final.local_kv_bytes > 0 and final.wan_kv_bytes > 0  # the relay's figures travelled with it
    pair.assert_gone("r1")


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "seed": 5}, {"temperature": 0.8}])
async def test_the_relay_streams_on_while_its_final_chunk_crosses(pair, prompt, tiny_ref, sampling):
    """Greedy or seeded, main-decode's next tokens are the relay's bit for bit (batch-invariant
    kernels, one precision): the relay keeps decoding and streaming while its final chunk crosses
    the line and main-decode extends it, and stops at the ack, so the stream has no gap of a round
    trip. Unseeded sampling draws differently on each side: the relay stops first, as before."""
    crossing = asyncio.Event()
    send = pair.rld._send

    async def slow_line(req, chunk):  # the final chunk and its ack are on the line until `crossing`
        if chunk.final:
            await crossing.wait()
        return await send(req, chunk)

    pair.rld._send = slow_line
    await pair.dispatch("r1", prompt, N, Pipeline.P_RLD_MD, "oneshot", **sampling)
    assert await pair.land("rld", "r1", prompt) == ""
    await pair.drive(lambda: len(pair.tokens("r1")) >= 4, roles=("rld",))
    assert await pair.land("md", "r1", prompt) == ""  # KVReady: the relay starts its final chunk
    await pair.drive(lambda: pair.rld.requests["r1"].phase == Phase.HANDING_OFF, roles=("rld",))
    before = len(pair.tokens("r1"))
    for _ in range(6):  # six relay steps while the chunk crosses
        pair.rld.worker.step()
        await pair.settle()
    crossing.set()
    await pair.drive(lambda: pair.finished("r1"))
    (final,) = pair.nats.sent(subjects.handoff_chunk("md-0"))
    handed = final.start_index + len(final.token_ids)  # main-decode samples from here
    relay_last = max(c.index + len(c.token_ids) for c in pair.chunks["r1"] if c.role == "rld")
    md_first = min(c.index for c in pair.chunks["r1"] if c.role == "md" and c.token_ids)
    assert md_first == handed
    if sampling.get("temperature") and sampling.get("seed") is None:
        assert relay_last == handed == before, "stopped before the final chunk left"
    else:
        assert relay_last == handed + 6, "streamed on while the chunk crossed"  # and md sent those again
        if not sampling:
            assert [t for t, _ in pair.tokens("r1").values()] == _expected(tiny_ref, prompt)
    assert len(pair.tokens("r1")) == N  # every index once, the same token from either side (tokens())
    pair.assert_gone("r1")


async def test_p_rld_finishes_on_the_relay(pair, prompt, tiny_ref):
    await pair.dispatch("r1", prompt, N, Pipeline.P_RLD)
    assert await pair.land("rld", "r1", prompt) == ""
    await pair.drive(lambda: pair.finished("r1"))
    assert [t for t, _ in pair.tokens("r1").values()] == _expected(tiny_ref, prompt)
    assert not pair.nats.sent(subjects.ABORT), "no main-decode copy to drop"
    pair.assert_gone("r1")


async def _land_all_on_md(pair: DecoderPair, prompts: dict[str, list[int]]) -> None:
    for rid, prompt in prompts.items():
        await pair.dispatch(rid, prompt, N, Pipeline.P_MD)
        assert await pair.land("md", rid, prompt) == ""  # committed: running, or parked for room


def _assert_exact_and_gone(pair: DecoderPair, tiny_ref, prompts: dict[str, list[int]]) -> None:
    for rid, prompt in prompts.items():
        assert [t for t, _ in pair.tokens(rid).values()] == _expected(tiny_ref, prompt)
        pair.assert_gone(rid)


async def test_kv_waits_parked_for_room_then_runs(tiny, tiny_ref):
    pair = await DecoderPair(tiny, md_blocks=4).start()  # room for one request of 40 + 24 tokens
    prompts = dict(zip("ab", random_prompts(tiny.config.vocab_size, [40, 40], seed=5)))
    try:
        await _land_all_on_md(pair, prompts)  # b: committed, it waits in host memory
        assert pair.md.requests["b"].phase == Phase.PARKED and list(pair.md.parked) == ["b"]
        await pair.drive(lambda: pair.finished("a") and pair.finished("b"))
        _assert_exact_and_gone(pair, tiny_ref, prompts)
    finally:
        await pair.stop()


async def test_parked_requests_join_together_at_one_step_boundary(tiny, tiny_ref):
    """A transfer is ACKed once its request joined or parked. Parked requests that fit are admitted
    in one engine call: one call each made the last of many (a killed main-decode's load, moved
    to the other) wait that many steps for its ACK, past prefill's deadline."""
    pair = await DecoderPair(tiny, md_blocks=8).start()  # a (100 + 24 tokens) fills it; b, c fit after
    prompts = dict(zip("abc", random_prompts(tiny.config.vocab_size, [100, 40, 40], seed=7)))
    joined = []  # per admission call, how many parked requests it joined
    worker_call = pair.md.worker.call

    async def counted(fn):
        results = await worker_call(fn)
        if "_admit_parked" in fn.__qualname__:
            joined.append(len(results))
        return results

    pair.md.worker.call = counted
    try:
        await _land_all_on_md(pair, prompts)
        # a joined; b, c tried and parked. The watchdog's retries each second while requests are
        # parked (a slow host) may add calls that join none
        assert list(pair.md.parked) == ["b", "c"] and [n for n in joined if n] == [1], joined
        await pair.drive(lambda: pair.finished("a"))
        await pair.drive(lambda: not pair.md.parked)
        # b and c joined in one call when a's blocks came back
        assert [n for n in joined if n] == [1, 2], joined
        await pair.drive(lambda: pair.finished("b") and pair.finished("c"))
        _assert_exact_and_gone(pair, tiny_ref, prompts)
    finally:
        await pair.stop()


async def test_the_same_prefix_landing_twice_shares_the_cached_blocks(tiny, prompt, tiny_ref):
    """The second copy reuses the first one's cached prefix instead of hanging cache nodes under
    blocks it does not hold (which once left it waiting forever for a block nobody could evict)."""
    pair = await DecoderPair(tiny, md_blocks=4).start()
    try:
        for rid in ("a", "b"):
            await pair.dispatch(rid, prompt, N, Pipeline.P_MD)
            assert await pair.land("md", rid, prompt) == ""
        assert pair.md.requests["b"].phase == Phase.PARKED  # no room for its own budget until a ends
        await pair.drive(lambda: pair.finished("a") and pair.finished("b"))
        assert pair.chunks["b"][-1].stats.md_hit_tokens >= 32  # a's prefix, not a second copy of it
        for rid in ("a", "b"):
            assert [t for t, _ in pair.tokens(rid).values()] == _expected(tiny_ref, prompt)
            pair.assert_gone(rid)
    finally:
        await pair.stop()


# -- abort in every state ------------------------------------------------------------------------
async def _to_phase(pair: DecoderPair, prompt: list[int], phase: str) -> None:
    if phase == "pending":
        await pair.dispatch("r1", prompt, N, Pipeline.P_RLD_MD, "catchup")
    elif phase == "running":
        await pair.dispatch("r1", prompt, N, Pipeline.P_RLD_MD, "catchup")
        await pair.land("rld", "r1", prompt)
    elif phase == "shadow":  # md has the KV, the relay has not started yet
        await pair.dispatch("r1", prompt, N, Pipeline.P_RLD_MD, "catchup")
        await pair.land("md", "r1", prompt)
        assert pair.md.requests["r1"].phase == Phase.SHADOW
    elif phase == "handing-off":  # a catch-up chunk sent; md extending it, the relay waiting for its ack
        await _relayed(pair, prompt, "catchup")
        await pair.settle()
        assert pair.rld.requests["r1"].phase == Phase.HANDING_OFF


@pytest.mark.parametrize("phase", ["pending", "running", "shadow", "handing-off"])
async def test_abort_in_every_phase_leaves_nothing(pair, prompt, phase):
    await _to_phase(pair, prompt, phase)
    await pair.bus.publish(subjects.ABORT, Abort("r1"))
    await pair.settle()
    pair.assert_gone("r1")
    acks = await pair.dispatch("r1", prompt, N, Pipeline.P_RLD_MD, "catchup")  # a late duplicate task
    assert not any(a.ok for a in acks) and all("aborted" in a.error for a in acks)
    pair.assert_gone("r1")


async def test_abort_while_parked_leaves_nothing(tiny):
    pair = await DecoderPair(tiny, md_blocks=4).start()
    try:
        for rid, prompt in zip("ab", random_prompts(tiny.config.vocab_size, [40, 40], seed=5)):
            await pair.dispatch(rid, prompt, N, Pipeline.P_MD)
            await pair.land("md", rid, prompt)
        assert list(pair.md.parked) == ["b"]
        await pair.bus.publish(subjects.ABORT, Abort("b"))
        await pair.bus.publish(subjects.ABORT, Abort("a"))
        await pair.settle()
        pair.assert_gone("a")
        pair.assert_gone("b")
    finally:
        await pair.stop()


async def test_abort_during_catch_up_ends_the_relays_handoff_at_once(pair, prompt):
    """The soak's leftover task: md waits for its shadow to catch up, the client goes. Before
    the fix md's handler and the relay's handoff each waited out the 30 s ack timeout."""
    await _to_phase(pair, prompt, "handing-off")
    handing = [t for t in pair.rld._tasks if "_handoff" in t.get_coro().__qualname__]
    assert handing and not handing[0].done()
    await pair.bus.publish(subjects.ABORT, Abort("r1"))
    await pair.settle()
    assert handing[0].done()
    pair.assert_gone("r1")


# -- main-decode gone, dropped or late ------------------------------------------------------------
async def test_md_gone_during_handoff_leaves_the_relay_serving(tiny, prompt, tiny_ref):
    # the relay gives a chunk up after `ack_timeout_s` of resends: 4 s here, not the harness's 30
    pair = await DecoderPair(tiny, handoff={**CONFIG["handoff"], "ack_timeout_s": 4}).start()
    try:
        await _relayed(pair, prompt, "catchup")
        tries, request = [], pair.rld.bus.request

        def counted(subject, *args):
            tries.append(subject)
            return request(subject, *args)

        pair.rld.bus.request = counted
        await pair.md.bus.close()  # killed: its subjects have no responders, its handlers are gone
        await pair.drive(lambda: pair.finished("r1"), roles=("rld",))
        tokens = pair.tokens("r1")
        assert [t for t, _ in tokens.values()] == _expected(tiny_ref, prompt)
        assert all(role == "rld" for _, role in tokens.values())
        assert "r1" not in pair.rld.requests and pair.rld.requests == {}
        # "no responders" comes back at once: the chunk is sent again after the resend wait
        # (2 s, doubling), not in a tight loop of requests until `ack_timeout_s`
        assert 1 <= tries.count(subjects.handoff_chunk("md-0")) <= 3, len(tries)
    finally:
        await pair.stop()


async def test_md_drops_its_copy_mid_catch_up_and_the_relay_finishes(pair, prompt, tiny_ref):
    await _relayed(pair, prompt, "catchup")
    await pair.bus.publish(subjects.decode_drop("md-0"), Drop("r1", reason="re-planned"))
    await pair.drive(lambda: pair.finished("r1"))
    assert [t for t, _ in pair.tokens("r1").values()] == _expected(tiny_ref, prompt)
    pair.assert_gone("r1")


async def test_shadow_whose_kv_never_comes_hands_the_request_to_the_relay(pair, prompt, tiny_ref):
    await pair.dispatch("r1", prompt, N, Pipeline.P_RLD_MD, "oneshot")
    await pair.land("rld", "r1", prompt)
    pair.md.expire_pending(now=pair.md.requests["r1"].accepted_at + pair.cfg.timeouts.request_s + 1)
    await pair.settle()
    assert "r1" not in pair.md.requests and pair.rld.requests["r1"].alone
    await pair.drive(lambda: pair.finished("r1"))
    assert [t for t, _ in pair.tokens("r1").values()] == _expected(tiny_ref, prompt)
    assert not pair.nats.sent(subjects.ABORT), "md already let go"
    pair.assert_gone("r1")


async def test_a_request_the_relay_finished_still_warms_main_decodes_cache(pair, prompt, tiny_ref):
    """The relay streams the whole answer before md's KV lands (a cold session on a slow line).
    md's copy is over for the user, but its prompt KV still lands, into md's prefix cache only:
    the session's next turn finds it there instead of sending it across again."""
    await pair.dispatch("r1", prompt, N, Pipeline.P_RLD_MD, "oneshot")
    assert await pair.land("rld", "r1", prompt) == ""
    await pair.drive(lambda: pair.finished("r1"), roles=("rld",))
    assert [t for t, _ in pair.tokens("r1").values()] == _expected(tiny_ref, prompt)
    [abort] = pair.nats.sent(subjects.ABORT)
    assert abort.keep_kv and pair.md.requests["r1"].cache_only and pair.md.requests["r1"].phase == Phase.PENDING
    md = pair.engines["md"]
    assert md.cache.match(prompt, "tiny") == []
    assert await pair.land("md", "r1", prompt) == ""  # the push still lands
    await pair.settle()
    full = len(prompt) // pair.cfg.block_size
    assert len(md.cache.match(prompt, "tiny")) == full  # every full prompt block, cached
    assert [c.role for c in pair.chunks["r1"]].count("md") == 0  # and nothing streamed from md
    pair.assert_gone("r1")


async def test_without_warming_the_finished_requests_kv_is_refused(tiny, prompt, tiny_ref):
    pair = await DecoderPair(tiny, handoff={"chunk_tokens": 4, "final_tokens": 2, "warm_md_cache": False}).start()
    try:
        await pair.dispatch("r1", prompt, N, Pipeline.P_RLD_MD, "oneshot")
        await pair.land("rld", "r1", prompt)
        await pair.drive(lambda: pair.finished("r1"), roles=("rld",))
        [abort] = pair.nats.sent(subjects.ABORT)
        await pair.settle()
        assert not abort.keep_kv and "r1" not in pair.md.requests
        assert "no decode task" in await pair.land("md", "r1", prompt)
        assert pair.engines["md"].cache.match(prompt, "tiny") == []
        pair.assert_gone("r1")
    finally:
        await pair.stop()


async def test_a_client_abort_after_the_relay_finished_still_drops_mds_copy(pair, prompt):
    await pair.dispatch("r1", prompt, N, Pipeline.P_RLD_MD, "oneshot")
    await pair.land("rld", "r1", prompt)
    await pair.drive(lambda: pair.finished("r1"), roles=("rld",))
    await pair.bus.publish(subjects.ABORT, Abort("r1"))  # e.g. the gateway, for a client that went
    await pair.settle()
    assert "r1" not in pair.md.requests
    pair.assert_gone("r1")


async def test_a_push_failed_late_leaves_main_decode_running_after_the_handoff(pair, prompt, tiny_ref):
    """Prefill gave up on main-decode's ACK (it came late) after the relay had handed over: the
    relay, told to finish, no longer holds the request, and main-decode's copy is the only one."""
    await _relayed(pair, prompt, "oneshot")
    await pair.drive(lambda: pair.md.requests["r1"].phase == Phase.RUNNING and "r1" not in pair.rld.requests)
    await pair.bus.publish(subjects.finish_on_relay("rld-0"), FinishOnRelay("r1", reason="push failed"))
    await pair.bus.publish(subjects.decode_drop("md-0"), Drop("r1", reason="KV push failed"))
    await pair.drive(lambda: pair.finished("r1"))
    assert [t for t, _ in pair.tokens("r1").values()] == _expected(tiny_ref, prompt)
    pair.assert_gone("r1")


async def test_finish_on_relay_after_a_failed_wan_push(pair, prompt, tiny_ref):
    await pair.dispatch("r1", prompt, N, Pipeline.P_RLD_MD, "oneshot")
    await pair.land("rld", "r1", prompt)
    await pair.bus.publish(subjects.finish_on_relay("rld-0"), FinishOnRelay("r1", reason="push failed"))
    await pair.bus.publish(subjects.decode_drop("md-0"), Drop("r1", reason="KV push failed"))
    await pair.drive(lambda: pair.finished("r1"))
    assert [t for t, _ in pair.tokens("r1").values()] == _expected(tiny_ref, prompt)
    pair.assert_gone("r1")


# -- duplicate and late messages --------------------------------------------------------------------
async def test_duplicates_and_late_messages_change_nothing(pair, prompt, tiny_ref):
    await pair.dispatch("r1", prompt, N, Pipeline.P_RLD_MD, "oneshot")
    again = await pair.dispatch("r1", prompt, N, Pipeline.P_RLD_MD, "oneshot")
    assert all(a.ok for a in again) and len(pair.rld.requests) == 1
    assert await pair.land("rld", "r1", prompt) == ""
    assert await pair.land("rld", "r1", prompt) == ""  # a retried push that landed twice
    await pair.bus.publish(subjects.handoff_ready("rld-0"), KVReady("nobody", "md-0"))
    unknown = await pair.bus.request(subjects.handoff_chunk("md-0"), HandoffChunk("nobody", 1, [5]), Ack, 5)
    assert not unknown.ok
    await pair.land("md", "r1", prompt)
    await pair.bus.publish(subjects.handoff_ready("rld-0"), KVReady("r1", "md-0"))  # a duplicate KVReady
    await pair.drive(lambda: pair.finished("r1"))
    assert [t for t, _ in pair.tokens("r1").values()] == _expected(tiny_ref, prompt)
    late = await pair.bus.request(subjects.handoff_chunk("md-0"), HandoffChunk("r1", 1, [5], final=True), Ack, 5)
    assert late.ok  # a final chunk sent again after the end (its ack was lost): acked, nothing runs
    late = await pair.bus.request(subjects.handoff_chunk("md-0"), HandoffChunk("r1", 1, [5]), Ack, 5)
    assert not late.ok
    assert "no decode task" in await pair.land("md", "r1", prompt)  # KV after the end is refused
    await pair.bus.publish(subjects.ABORT, Abort("r1"))  # an abort after the end
    await pair.settle()
    pair.assert_gone("r1")


@pytest.mark.parametrize("order", ["drop-first", "task-first"])
async def test_a_re_plan_onto_the_same_decoder_keeps_the_new_copy_whatever_the_order(pair, prompt, tiny_ref, order):
    """Prefill missed its ack, so the scheduler dropped the plan's copies and planned again, onto
    the same main-decoder: a new task with a new transfer token. The drop and the new task travel
    on two subjects, so either may come first; both ways only the new copy remains."""
    drop = Drop("r1", reason="re-planned", transfer_secret="old")
    await pair.dispatch("r1", prompt, N, Pipeline.P_MD, secret="old")
    if order == "drop-first":
        await pair.bus.publish(subjects.decode_drop("md-0"), drop)
        await pair.settle()
    (ack,) = await pair.dispatch("r1", prompt, N, Pipeline.P_MD, secret="new")
    assert ack.ok and pair.md.requests["r1"].task.transfer_secret == "new"
    if order == "task-first":
        await pair.bus.publish(subjects.decode_drop("md-0"), drop)
        await pair.settle()
    old_push = pair.transfer("r1", prompt, via_wan=True, secret="old")
    assert "wrong transfer secret" in await pair.land("md", "r1", prompt, old_push)
    assert await pair.land("md", "r1", prompt, pair.transfer("r1", prompt, via_wan=True, secret="new")) == ""
    await pair.drive(lambda: pair.finished("r1"))
    assert [t for t, _ in pair.tokens("r1").values()] == _expected(tiny_ref, prompt)
    pair.assert_gone("r1")


async def test_a_drop_naming_the_held_copy_drops_it(pair, prompt):
    await pair.dispatch("r1", prompt, N, Pipeline.P_MD, secret="this")
    await pair.bus.publish(subjects.decode_drop("md-0"), Drop("r1", reason="re-planned", transfer_secret="this"))
    await pair.settle()
    pair.assert_gone("r1")


async def test_a_push_that_overtakes_its_task_waits_for_it(pair, prompt, tiny_ref):
    """The scheduler sends prefill its task beside the decoders' (no round trip through the line
    before prefill starts), so on a short prefill the push can reach main-decode before the task
    does: the push waits for the task, then lands and runs as if it had come second."""
    landing = asyncio.create_task(pair.land("md", "r1", prompt))
    await pair.settle()
    assert not landing.done() and "r1" in pair.md._awaited  # the header is in; no byte is taken yet
    assert (await pair.dispatch("r1", prompt, N, Pipeline.P_MD))[0].ok
    assert await landing == ""
    await pair.drive(lambda: pair.finished("r1"))
    assert [t for t, _ in pair.tokens("r1").values()] == _expected(tiny_ref, prompt)
    pair.assert_gone("r1")
    assert not pair.md._awaited


async def test_a_push_whose_task_never_comes_is_refused_after_the_control_timeout(tiny, prompt):
    """Waiting is bounded as the scheduler's wait for the ack is."""
    pair = await DecoderPair(tiny, timeouts={"request_s": 60, "control_s": 0.05}).start()
    try:
        assert "no decode task" in await pair.land("md", "r1", prompt)
        assert not pair.md._awaited and idle(pair.engines["md"])
    finally:
        await pair.stop()


async def test_an_abort_ends_a_pushs_wait_for_its_task_at_once(pair, prompt):
    landing = asyncio.create_task(pair.land("md", "r1", prompt))
    await pair.settle()
    assert not landing.done()
    await pair.bus.publish(subjects.ABORT, Abort("r1"))
    await pair.settle()  # no time passes: only the abort's handler runs
    assert landing.done() and "no decode task" in landing.result()
    assert not pair.md._awaited and idle(pair.engines["md"])


@pytest.mark.parametrize("handoff", ["oneshot", "catchup"])
async def test_logprobs_are_the_same_whichever_role_sampled_the_token(pair, prompt, tiny_ref, handoff):
    """Prefill samples token 0, the relay the next ones, main-decode the rest after the handoff:
    each token's logprobs come from the role that sampled it, and equal, to the last bit, those of
    the same request decoded on main-decode alone, and the model's own log-softmax."""
    await pair.dispatch("alone", prompt, N, Pipeline.P_MD, logprobs=3)
    assert await pair.land("md", "alone", prompt) == ""
    await pair.drive(lambda: pair.finished("alone"))
    await pair.dispatch("r1", prompt, N, Pipeline.P_RLD_MD, handoff, logprobs=3)
    assert await pair.land("rld", "r1", prompt) == ""
    await pair.drive(lambda: len(pair.tokens("r1")) >= 10, roles=("rld",))
    assert await pair.land("md", "r1", prompt) == ""
    await pair.drive(lambda: pair.finished("r1"))
    by_role = {role for _, role in pair.tokens("r1").values()}
    assert by_role == {"rld", "md"}, "the relay and main-decode each sampled some"
    alone, relayed = pair.logprobs("alone"), pair.logprobs("r1")
    assert sorted(alone) == sorted(relayed) == list(range(N))
    assert relayed == alone  # every field, exactly
    tokens = [t for t, _ in pair.tokens("r1").values()]
    with torch.no_grad():
        logits = tiny_ref(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    ref = torch.log_softmax(logits, dim=-1)
    for i, t in enumerate(tokens):
        assert relayed[i].logprob == pytest.approx(float(ref[i, t]), abs=1e-4)
        assert relayed[i].top_ids == ref[i].topk(3).indices.tolist() and len(relayed[i].top_logprobs) == 3
    pair.assert_gone("r1")


async def test_a_malformed_message_fails_nothing(pair, prompt, tiny_ref):
    await pair.dispatch("r1", prompt, N, Pipeline.P_MD)
    await pair.land("md", "r1", prompt)
    for sub in list(pair.nats.subs[subjects.decode_task("md-0")]):
        sub.deliver(b"\xc1garbage", (subjects.decode_task("md-0"), None))
    for sub in list(pair.nats.subs[subjects.handoff_chunk("md-0")]):
        wrong_type = HandoffChunk("r1", "x", [1])  # start_index of the wrong type
        sub.deliver(wrong_type.encode(), (subjects.handoff_chunk("md-0"), None))
    await pair.drive(lambda: pair.finished("r1"))
    assert [t for t, _ in pair.tokens("r1").values()] == _expected(tiny_ref, prompt)
    pair.assert_gone("r1")


# -- transfers that are not what the scheduler planned -------------------------------------------------
@pytest.mark.parametrize(
    "forge, why",
    [
        (lambda t: setattr(t.head, "secret", "guessed"), "wrong transfer secret"),
        (lambda t: _forge_kv(t, start=16), "differs from its task"),  # a range the plan did not send
        (lambda t: _forge_kv(t, end=999), "differs from its task"),
        (lambda t: _forge_kv(t, num_layers=10**5), "does not fit this model"),
        (lambda t: setattr(t.first, "token_id", 10**9), "not in the vocabulary"),
        (lambda t: setattr(t.first, "token_id", -1), "not in the vocabulary"),
    ],
)
async def test_a_forged_transfer_is_refused_and_leaves_the_request_pending(pair, prompt, tiny_ref, forge, why):
    """Fields of the wrong type or out of range never get this far: the KV plane's typed frames
    refuse them on decode (tests/transport/test_kv_receiver.py)."""
    await pair.dispatch("r1", prompt, N, Pipeline.P_MD)
    t = pair.transfer("r1", prompt, via_wan=True)
    forge(t)
    assert why in await pair.land("md", "r1", prompt, t)
    assert pair.md.requests["r1"].phase == Phase.PENDING and idle(pair.engines["md"])
    assert await pair.land("md", "r1", prompt) == ""  # the real push still lands
    await pair.drive(lambda: pair.finished("r1"))
    assert [t for t, _ in pair.tokens("r1").values()] == _expected(tiny_ref, prompt)
    pair.assert_gone("r1")


async def test_a_request_the_registrar_says_is_gone_is_dropped(pair, prompt):
    """The line was down, the request moved to the relay and its abort was lost: the heartbeat
    reply names it (forget) and main-decode drops everything it held for it."""
    await pair.dispatch("r1", prompt, N, Pipeline.P_MD)
    await pair.land("md", "r1", prompt)
    await pair.drive(lambda: len(pair.tokens("r1")) >= 3, roles=("md",))
    await pair.md.forget(["r1"])
    await pair.settle()
    pair.assert_gone("r1")


async def test_a_bad_control_message_fails_only_itself(pair, prompt, tiny_ref):
    """One out-of-range token id would fail the forward of every batched sequence: such tasks
    and chunks are refused before the engine sees them, and the request running beside them
    finishes exactly."""
    await pair.dispatch("good", prompt, N, Pipeline.P_RLD_MD, "oneshot")
    await pair.land("md", "good", prompt)
    for bad in ([10**9, 5], [-1], [], list(range(3000))):
        acks = await pair.dispatch("bad", bad, N, Pipeline.P_MD)
        assert not acks[0].ok and "refused the task" in acks[0].error, bad
    ack = await pair.bus.request(subjects.handoff_chunk("md-0"), HandoffChunk("good", 1, [10**9]), Ack, 5)
    assert not ack.ok and "token id" in ack.error
    ack = await pair.bus.request(subjects.handoff_chunk("md-0"), HandoffChunk("good", -3, [5]), Ack, 5)
    assert not ack.ok
    assert await pair.land("rld", "good", prompt) == ""
    await pair.drive(lambda: pair.finished("good"))
    assert [t for t, _ in pair.tokens("good").values()] == _expected(tiny_ref, prompt)
    pair.assert_gone("good")
    assert "bad" not in pair.md.requests


async def test_kv_that_can_never_fit_fails_its_request_at_once(tiny, prompt):
    """A budget larger than the whole pool would wait parked forever: it fails instead."""
    pair = await DecoderPair(tiny, md_blocks=4).start()
    try:
        await pair.dispatch("big", prompt, 200, Pipeline.P_MD)
        assert "more than the pool holds (64)" in await pair.land("md", "big", prompt)
        await pair.settle()
        assert pair.finished("big") and "pool holds" in pair.chunks["big"][-1].error
        pair.assert_gone("big")
    finally:
        await pair.stop()


@pytest.mark.parametrize("handoff", ["oneshot", "catchup"])
async def test_penalties_continue_exactly_across_the_handoff(tiny, pair, prompt, handoff):
    """Penalties depend on the token ids alone: main-decode, handed the relay's ids, goes on as
    one engine running the whole request would."""
    knobs = {"frequency_penalty": 0.8, "presence_penalty": 0.4, "repetition_penalty": 1.3}
    expected = _one_engine(tiny, prompt, Sampling(max_tokens=N, ignore_eos=True, **knobs))
    assert expected != _one_engine(tiny, prompt, Sampling(max_tokens=N, ignore_eos=True))
    await pair.dispatch("r1", prompt, N, Pipeline.P_RLD_MD, handoff, **knobs)
    assert await pair.land("rld", "r1", prompt) == ""
    await pair.drive(lambda: len(pair.tokens("r1")) >= 10, roles=("rld",))
    assert await pair.land("md", "r1", prompt) == ""
    await pair.drive(lambda: pair.finished("r1"))
    tokens = pair.tokens("r1")
    assert [t for t, _ in tokens.values()] == expected and {r for _, r in tokens.values()} == {"rld", "md"}
    pair.assert_gone("r1")


def _one_engine(model, prompt: list[int], params: Sampling) -> list[int]:
    from tests.helpers import make_engine, run_to_completion

    e = make_engine(model)
    e.add(Sequence("solo", list(prompt), params))
    return run_to_completion(e)["solo"]


@pytest.mark.parametrize("wire", ["bf16", "fp8", "int8"])
async def test_narrowed_kv_lands_and_decodes_as_one_process_would(tiny, pair, prompt, wire):
    """Main-decode restores KV sent in a narrower wire format into its pool; the output is what
    one process computes from the same KV round-tripped through that format."""
    from shared.runtime.kv_payload import KVPayload, export_kv, import_kv, layer_from_bytes, layer_to_bytes
    from tests.decoder.harness import engine as cached_engine

    await pair.dispatch("r1", prompt, N, Pipeline.P_MD)
    t = pair.transfer("r1", prompt, via_wan=True, wire=wire)
    assert await pair.land("md", "r1", prompt, t) == ""
    await pair.drive(lambda: pair.finished("r1"))
    e = cached_engine(tiny)  # the reference: prefill, the KV through `wire`, then decode, in one process
    seq = Sequence("p", list(prompt), Sampling(max_tokens=1, ignore_eos=True), hold_kv=True, max_new=1)
    e.add(seq)
    first = run_to_completion(e)["p"][0]
    payload = export_kv(e.pool, e.held["p"].block_table, 0, len(prompt))
    header = dataclasses.replace(payload.header, wire=wire)
    layers = [layer_from_bytes(header, layer_to_bytes(k, v, wire)) for k, v in payload.layers]
    d = cached_engine(tiny)
    ref = Sequence("d", list(prompt) + [first], Sampling(max_tokens=N, ignore_eos=True), prompt_len=len(prompt))
    ref.block_table = d.allocate(d.pool.blocks_for(len(prompt) + N))
    import_kv(d.pool, ref.block_table, KVPayload(header, layers))
    ref.num_computed = len(prompt)
    d.add(ref)
    expected = [first] + run_to_completion(d)["d"]
    assert [t for t, _ in pair.tokens("r1").values()] == expected
    assert pair.chunks["r1"][-1].stats.wan_kv_bytes < sum(
        len(x) for p in pair.transfer("r2", prompt, True).parts for x in p.layers
    )
    pair.assert_gone("r1")


def _forge_kv(t, **fields) -> None:
    t.head.kv = dataclasses.replace(t.head.kv, **fields)


# -- failures around the stream -----------------------------------------------------------------
async def test_the_stream_survives_failing_publishes_and_index_reports(pair, prompt, tiny_ref, monkeypatch):
    """A publish that fails (a reconnecting bus) is tried again; an index report that cannot go
    (a full report over the bus's payload limit) is logged and left to the index loop. The stream
    still arrives whole and in order, and the publisher lives on for the next request."""
    from shared import decoder

    monkeypatch.setattr(decoder, "PUBLISH_RETRY_S", 0.0)
    bus, svc, tries = pair.md.bus, pair.md, {"n": 0}
    publish = bus.publish

    async def flaky(subject, msg):
        if subject.startswith(subjects.tokens("")):
            tries["n"] += 1
            if tries["n"] % 2:  # every chunk's first try fails
                raise ConnectionError("nats: connection reconnecting")
        await publish(subject, msg)

    async def too_large():
        raise ValueError("nats: maximum payload exceeded")

    monkeypatch.setattr(bus, "publish", flaky)
    monkeypatch.setattr(svc, "report_index", too_large)
    for rid in ("r1", "r2"):
        await pair.dispatch(rid, prompt, N, Pipeline.P_MD)
        assert await pair.land("md", rid, prompt) == ""
        await pair.drive(lambda rid=rid: pair.finished(rid))
        assert [t for t, _ in pair.tokens(rid).values()] == _expected(tiny_ref, prompt)
        assert "DecoderService._publisher" in " ".join(pair.task_names("md"))
    assert tries["n"] >= 4 * N


async def test_the_heartbeat_loop_survives_a_failing_bus(pair, monkeypatch):
    """Not only a timeout: any error from the bus is logged and the next beat goes out."""
    import asyncio

    calls = {"n": 0}

    async def failing(subject, msg, reply_type, timeout):
        calls["n"] += 1
        raise ConnectionError("nats: connection closed")

    monkeypatch.setattr(pair.md.bus, "request", failing)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10 * pair.cfg.heartbeat_s + 5
    while calls["n"] < 2 and loop.time() < deadline:  # poll: the loop beats every heartbeat_s
        await asyncio.sleep(0.05)
    assert calls["n"] >= 2, "the heartbeat loop died on its first failure"
    assert any("_heartbeat" in name for name in pair.task_names("md"))


# -- a lost chunk, sent again ----------------------------------------------------------------
@pytest.mark.parametrize("handoff", ["none", "oneshot"])
async def test_what_was_lost_is_sent_again_while_it_runs_and_after_it_ended(
    pair, prompt, tiny_ref, monkeypatch, handoff
):
    """Core NATS is at-most-once: one token chunk and the final chunk vanish (failpoints); asked
    by index (`Resend`), the decoders send them again from what they keep, during the request
    and after it ended; an id they never held is answered `held=False`."""
    from shared import failpoints
    from shared.messages import Resend, Resent

    lost = failpoints.Failpoints("decoder.token_chunk=drop@3;decoder.final_chunk=drop@1")
    monkeypatch.setattr(failpoints, "_active", lost)
    expected = _expected(tiny_ref, prompt)
    if handoff == "none":
        await pair.dispatch("r1", prompt, N, Pipeline.P_MD)
        assert await pair.land("md", "r1", prompt) == ""
    else:
        await _relayed(pair, prompt, handoff, relay_steps=6)
    await pair.drive(lambda: 10 in pair.tokens("r1"))
    assert 2 not in pair.tokens("r1"), "the third chunk was lost"

    async def resend(instance: str, rid: str, index: int) -> Resent:
        return await pair.bus.request(subjects.decode_resend(instance), Resend(rid, index), Resent, 5)

    holder = "md-0" if handoff == "none" else "rld-0"
    again = await resend(holder, "r1", 2)  # while it runs: what it sent so far
    assert again.held and again.chunk.index == 2 and again.chunk.finish_reason is None
    assert again.chunk.token_ids == expected[2 : 2 + len(again.chunk.token_ids)] and len(again.chunk.token_ids) >= 1
    await pair.drive(lambda: "r1" not in pair.md.requests and "r1" not in pair.rld.requests)
    assert not pair.finished("r1"), "the final chunk was lost"
    tail = await resend("md-0", "r1", len(expected) - 3)  # after it ended: the end, with its stats
    assert tail.held and tail.chunk.token_ids == expected[-3:] and tail.chunk.finish_reason == "length"
    assert tail.chunk.stats is not None and tail.chunk.role == "md"
    if handoff == "oneshot":  # the relay keeps its part after it let go
        head = await resend("rld-0", "r1", 0)
        assert head.held and head.chunk.token_ids == expected[: len(head.chunk.token_ids)]
    assert (await resend("md-0", "never-seen", 0)) == Resent(held=False)
    pair.assert_gone("r1")


@pytest.mark.parametrize("lost", ["chunk", "ack"])
@pytest.mark.parametrize("handoff", ["oneshot", "catchup"])
async def test_a_lost_handoff_chunk_or_ack_is_sent_again_and_taken_once(
    tiny, prompt, tiny_ref, monkeypatch, lost, handoff
):
    """The relay's first handoff chunk (or main-decode's ack of it) vanishes: the relay sends it
    again after a few round trips; main-decode takes a chunk it already has as once, so the
    stream is exact and main-decode, not the relay, finishes it."""
    import asyncio

    from services.rld import service as rld_service
    from shared import failpoints
    from shared.bus import BusTimeout

    monkeypatch.setattr(rld_service, "HANDOFF_RESEND_S", 0.02)
    pair = await DecoderPair(tiny, wan={"delay_ms": 0}).start()
    try:
        if lost == "chunk":
            monkeypatch.setattr(failpoints, "_active", failpoints.Failpoints("rld.handoff_chunk=drop@1"))
        else:
            request, dropped = pair.rld.bus.request, []

            async def ack_lost(subject, msg, reply_type, timeout):
                reply = await request(subject, msg, reply_type, timeout)
                if subject == subjects.handoff_chunk("md-0") and not dropped:
                    dropped.append(reply)
                    raise BusTimeout("no reply (lost)")
                return reply

            monkeypatch.setattr(pair.rld.bus, "request", ack_lost)
        await _relayed(pair, prompt, handoff)
        for _ in range(2000):  # real time passes: the relay waits for its resend
            await asyncio.sleep(0.002)
            for role in ("rld", "md"):
                if pair.engines[role].has_work:
                    pair.service(role).worker.step()
            if pair.finished("r1"):
                break
        tokens = pair.tokens("r1")
        assert [t for t, _ in tokens.values()] == _expected(tiny_ref, prompt)
        assert [role for _, role in tokens.values()][-1] == "md", "main-decode finished it"
        sent = pair.nats.sent(subjects.handoff_chunk("md-0"))
        assert len(sent) >= (2 if lost == "ack" else 1) and (lost == "chunk" or sent[0] == sent[1])
        await pair.settle()
        pair.assert_gone("r1")
    finally:
        await pair.stop()


async def test_a_forgotten_request_says_so_to_the_gateway(pair, prompt):
    """The registrar names a held request no longer recorded: the decoder drops it, and a
    gateway that still waits (the record was lost, not the request) gets an error blaming this
    copy, on which it moves the request, instead of waiting for `request_s`."""
    await pair.dispatch("r1", prompt, N, Pipeline.P_MD)
    assert await pair.land("md", "r1", prompt) == ""
    await pair.drive(lambda: len(pair.tokens("r1")) >= 3)
    await pair.md.forget(["r1"])
    await pair.settle()
    last = pair.chunks["r1"][-1]
    assert "no longer recorded" in last.error and last.blame == "md-0"
    pair.assert_gone("r1")
