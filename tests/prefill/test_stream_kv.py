"""Prefill streams a long prompt's KV as its engine computes it (`stream_kv`), on a real engine
stepped by hand and a real KV receiver on loopback: the push is under way after the first chunk,
before any token is sampled; it arrives in parts that tile each target's range (a target that
holds a prefix gets only the rest) and carry the very KV a whole push carries; an abort
mid-prompt cuts the push and leaves nothing held; with `stream_kv: false` (the default) the push
waits for the first token and comes whole."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from shared import subjects
from shared.messages import Abort, KVTarget, Plan, PrefillTask, Sampling
from shared.runtime.kv_payload import KVPayload, payload_from_parts
from tests.helpers import until
from tests.prefill.test_early_connection import DEADLINE_S, _rig

CHUNK = 16  # the engine's step budget here: a 40-token prompt prefills in three steps
PROMPT = list(range(3, 43))


@pytest.fixture
async def streaming(tiny):
    rigs = []

    async def make(**settings):
        rig = await _rig(tiny, **{"stream_kv": True, **settings})
        rig.worker.engine.max_step_tokens = CHUNK
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        await rig.service.shutdown()
        await rig.rx.stop()


def task(rig, rid: str, md_start: int = 0) -> PrefillTask:
    """p-rld-md: the relay takes the whole prompt, main-decode [md_start, n) across the line."""
    rld = KVTarget("rld-0", "rld", "127.0.0.1", rig.rx.port, start=0, transfer_secret=f"rld-{rid}")
    md = KVTarget("md-0", "md", "127.0.0.1", rig.rx.port, start=md_start, transfer_secret=f"md-{rid}", wan=True)
    plan = Plan(rid, pipeline="p-rld-md", prefill="prefill-0", rld="rld-0", md="md-0")
    return PrefillTask(rid, PROMPT, Sampling(max_tokens=4), [rld, md], plan)


def sampled(outputs) -> list:
    """The step's outputs that carry a token (not a KV part)."""
    return [o for o in outputs if o.kv_part is None and o.token_id is not None]


def received(rig) -> dict[str, KVPayload]:
    """What each decoder got (by its transfer secret's role), assembled from its parts."""
    return {
        t.head.secret.split("-")[0]: payload_from_parts(t.head.kv, [(p.start, p.end, p.layers) for p in t.parts])
        for t in rig.rx.got
    }


def parts(rig) -> dict[str, list[tuple[int, int]]]:
    return {t.head.secret.split("-")[0]: [(p.start, p.end) for p in t.parts] for t in rig.rx.got}


def fed(rig, decoder: str) -> int:
    """Where r1's push to `decoder` is fed up to (0 before prefill made its pushes)."""
    push = rig.service.requests["r1"].pushes.get(decoder)
    return push.covered if push is not None else 0


def same(a: KVPayload, b: KVPayload) -> bool:
    return a.header == b.header and all(
        torch.equal(ka, kb) and torch.equal(va, vb) for (ka, va), (kb, vb) in zip(a.layers, b.layers)
    )


async def test_a_long_prompts_kv_leaves_chunk_by_chunk_and_equals_a_whole_push(streaming):
    rig = await streaming()
    await rig.submit(task(rig, "r1", md_start=16))
    assert sampled(rig.worker.step()) == []  # the first chunk, [0, 16): no token yet
    # both pushes are under way (their headers vetted, the first part read) before the prompt is done
    await until(lambda: {"r1"} == set(rig.rx._receiving), DEADLINE_S, "the push to start before the first token")
    assert rig.rx.got == [] and rig.service.nats.sent(subjects.tokens("r1")) == []
    rig.worker.step()  # [16, 32)
    [out] = sampled(rig.worker.step())  # [32, 40) and the first token
    await until(lambda: len(rig.rx.got) == 2, DEADLINE_S, "both pushes to land")
    assert parts(rig) == {"rld": [(0, 16), (16, 32), (32, 40)], "md": [(16, 32), (32, 40)]}
    await rig.settled()

    whole = await streaming(stream_kv=False)  # the same prompt pushed the old way, after the first token
    await whole.submit(task(whole, "r1", md_start=16))
    assert whole.worker.step() == [] and whole.worker.step() == []  # no KV part handed out
    assert not whole.rx._receiving and whole.rx.got == []  # nothing leaves before the first token
    [first] = whole.worker.step()
    await until(lambda: len(whole.rx.got) == 2, DEADLINE_S, "both pushes to land")
    assert parts(whole) == {"rld": [(0, 40)], "md": [(16, 40)]}
    assert first.token_id == out.token_id
    streamed, pushed = received(rig), received(whole)
    assert same(streamed["rld"], pushed["rld"]) and same(streamed["md"], pushed["md"])
    assert rig.rx.got[0].first == rig.rx.got[1].first  # one first token for both
    await whole.settled()


@pytest.mark.parametrize("pipeline", ["p-md", "p-rld-md"])
async def test_under_p_md_the_last_chunk_leaves_layer_by_layer_before_the_first_token(streaming, pipeline):
    """`p-md`: main-decode across the line makes the second token, so the prompt's last chunk goes
    into its push layer by layer while the forward runs: all of main-decode's 24 tokens' KV was
    pushed before the first token, and it is a whole push's bits. `p-rld-md` keeps the last chunk
    for after the first token (two pushes beside the forward took prefill's cores)."""

    def planned(rig) -> PrefillTask:
        relayed = task(rig, "r1", md_start=16)
        if pipeline == "p-rld-md":
            return relayed
        plan = dataclasses.replace(relayed.plan, pipeline="p-md", rld="")
        return dataclasses.replace(relayed, targets=relayed.targets[1:], plan=plan)

    got = []
    for rig in (await streaming(), await streaming(stream_kv=False, stream_layers_max_tokens=0)):
        sent = planned(rig)
        await rig.submit(sent)
        while not sampled(rig.worker.step()):
            pass
        await until(lambda r=rig, n=len(sent.targets): len(r.rx.got) == n, DEADLINE_S, "the pushes to land")
        [md] = [t for t in rig.rx.got if t.head.secret.startswith("md")]
        got.append((md.first.stats.streamed_kv_tokens, [(p.start, p.end) for p in md.parts], received(rig)["md"]))
        await rig.settled()
    (streamed, parts, kv), (none, whole_parts, whole_kv) = got
    # prefill's count: the most any push had before the first token (p-md: all of [16, 40); p-rld-md:
    # the relay's [0, 32), the last chunk's 8 tokens left after the first token)
    assert streamed == (24 if pipeline == "p-md" else 32) and parts == [(16, 32), (32, 40)]
    assert none == 0 and whole_parts == [(16, 40)] and same(kv, whole_kv)


@pytest.mark.parametrize("cap", [24, 23])
async def test_without_stream_kv_a_short_range_under_p_md_still_leaves_layer_by_layer(streaming, cap):
    """`stream_kv: false`: the prompt prefills in one step and nothing leaves chunk by chunk, but
    main-decode's 24 tokens of KV, within `stream_layers_max_tokens`, go layer by layer during that
    step's forward; one token over the cap, they go whole after the first token."""
    rig = await streaming(stream_kv=False, stream_layers_max_tokens=cap)
    rig.worker.engine.max_step_tokens = len(PROMPT)
    relayed = task(rig, "r1", md_start=16)
    plan = dataclasses.replace(relayed.plan, pipeline="p-md", rld="")
    await rig.submit(dataclasses.replace(relayed, targets=relayed.targets[1:], plan=plan))
    assert sampled(rig.worker.step())
    await until(lambda: len(rig.rx.got) == 1, DEADLINE_S, "the push to land")
    [md] = rig.rx.got
    assert [(p.start, p.end) for p in md.parts] == [(16, 40)]
    assert md.first.stats.streamed_kv_tokens == (24 if cap == 24 else 0)
    await rig.settled()


async def test_a_short_prompt_goes_in_one_part(streaming):
    rig = await streaming()
    short = dataclasses.replace(task(rig, "r1"), prompt_ids=PROMPT[:12])
    await rig.submit(short)
    rig.worker.step()
    await until(lambda: len(rig.rx.got) == 2, DEADLINE_S, "both pushes to land")
    assert parts(rig) == {"rld": [(0, 12)], "md": [(0, 12)]}
    await rig.settled()


async def test_an_abort_mid_prompt_cuts_the_streaming_push_and_holds_nothing(streaming, refusals):
    rig = await streaming()
    await rig.submit(task(rig, "r1"))
    rig.worker.step()
    await until(lambda: {"r1"} == set(rig.rx._receiving), DEADLINE_S, "the push to start")
    await rig.scheduler.publish(subjects.ABORT, Abort("r1", reason="the client left"))
    await until(lambda: not rig.rx._receiving, DEADLINE_S, "the receiver to see the push cut")
    assert rig.rx.got == [] and rig.worker.step() == []  # the sequence is gone: nothing left to compute
    await rig.settled()
    assert all("KV connection closed mid-transfer" in line or "reset" in line for line in refusals())


async def test_a_target_that_starts_later_is_sent_only_from_its_own_first_part(streaming):
    """Main-decode holding [0, 32) gets nothing while prefill computes [0, 16) and [16, 32): its
    push goes out with its first part (its decoder allows a HEADER only `stall_s` without one),
    here the last chunk's, which comes with the first token; the relay's goes out at once."""
    rig = await streaming()
    await rig.submit(task(rig, "r1", md_start=32))
    rig.worker.step()
    await until(lambda: {"r1"} == set(rig.rx._receiving), DEADLINE_S, "the relay's push to start")
    rig.worker.step()
    await until(lambda: fed(rig, "rld-0") == 32, DEADLINE_S, "[16, 32) fed")
    assert set(rig.service.requests["r1"].sending) == {"rld-0"}  # nothing of main-decode's range yet
    rig.worker.step()  # [32, 40) and the first token
    await until(lambda: len(rig.rx.got) == 2, DEADLINE_S, "both pushes to land")
    assert parts(rig) == {"rld": [(0, 16), (16, 32), (32, 40)], "md": [(32, 40)]}
    await rig.settled()


async def test_the_suffix_paths_push_goes_out_with_the_first_token_and_no_kv(streaming):
    rig = await streaming()
    await rig.submit(task(rig, "r1", md_start=len(PROMPT)))  # main-decode computes [its hit, n) itself
    rig.worker.step()
    rig.worker.step()
    await until(lambda: fed(rig, "rld-0") == 32, DEADLINE_S, "[0, 32) fed")
    assert set(rig.service.requests["r1"].sending) == {"rld-0"}
    [out] = sampled(rig.worker.step())
    await until(lambda: len(rig.rx.got) == 2, DEADLINE_S, "both pushes to land")
    [md] = [t for t in rig.rx.got if t.head.secret.startswith("md")]
    assert (md.head.kv.start, md.head.kv.end, md.parts, md.first.token_id) == (40, 40, [], out.token_id)
    await rig.settled()


async def test_a_push_that_cannot_be_encoded_fails_the_request_once_and_holds_nothing(tiny, monkeypatch):
    """The default path (nothing streamed): the KV is exported after the first token; an error
    there reaches the gateway as the request's error, and no push is left waiting for it."""
    rig = await _rig(tiny)
    try:

        def broken(k, v, wire):
            raise RuntimeError("no such wire")

        monkeypatch.setattr("services.prefill.service.layer_to_bytes", broken)
        await rig.submit(task(rig, "r1"))
        rig.worker.step()
        errors = lambda: [c for c in rig.service.nats.sent(subjects.tokens("r1")) if c.error]  # noqa: E731
        await until(errors, DEADLINE_S, "the request's error")
        [chunk] = errors()
        assert chunk.finish_reason == "error" and "KV export failed: no such wire" in chunk.error
        assert rig.rx.got == []
        await rig.settled()
    finally:
        await rig.service.shutdown()
        await rig.rx.stop()


async def test_the_relays_push_leaves_before_main_decodes_bytes_are_made_and_equal_ranges_share_them(tiny, monkeypatch):
    """The default path: after the first token the in-DC target's part is encoded and its push
    sent first; main-decode's part (another range here) is encoded while that push goes out,
    not before it leaves (the relay's next token waits for its KV alone). Two targets of the same
    range and wire format are encoded once."""
    from services.prefill import service

    calls: list[int] = []  # tokens of each layer encoded
    relay_landed = threading.Event()
    held: list[bool] = []

    def encode(k, v, wire):
        if k.shape[0] == len(PROMPT) - 16 and not held:  # main-decode's [16, 40): wait for the relay
            held.append(relay_landed.wait(DEADLINE_S))
        calls.append(k.shape[0])
        return real(k, v, wire)

    real = service.layer_to_bytes
    monkeypatch.setattr("services.prefill.service.layer_to_bytes", encode)
    layers = tiny.config.num_hidden_layers

    async def push(md_start: int) -> dict[str, KVPayload]:
        rig = await _rig(tiny)
        try:
            calls.clear()
            await rig.submit(task(rig, "r1", md_start=md_start))
            rig.worker.step()
            if md_start:
                relay = ["rld-r1"]
                await until(lambda: [t.head.secret for t in rig.rx.got] == relay, DEADLINE_S, "the relay's push")
                relay_landed.set()
            await until(lambda: len(rig.rx.got) == 2, DEADLINE_S, "both pushes to land")
            await rig.settled()
            return received(rig)
        finally:
            await rig.service.shutdown()
            await rig.rx.stop()

    await push(16)
    assert held == [True]  # the relay's push landed while main-decode's bytes were held back
    assert calls == [len(PROMPT)] * layers + [len(PROMPT) - 16] * layers
    got = await push(0)
    assert calls == [len(PROMPT)] * layers  # one encoding for both
    assert same(got["rld"], got["md"])
