"""The simulator against timings computed by hand on the trivial chip (tests/sim/factories.py)."""

from __future__ import annotations

import dataclasses

import pytest

import services.scheduler.policy as policy
import sim.cluster
from sim.events import EventLoop
from sim.link import BandwidthSchedule, SharedLink
from sim.run import simulate
from tests.sim.factories import make_config, make_request


def test_the_simulator_plans_with_the_schedulers_own_function(monkeypatch):
    assert sim.cluster.POLICY is policy.choose_plan
    calls = []
    monkeypatch.setattr(
        sim.cluster, "POLICY", lambda *a, **k: calls.append(a[0].request_id) or policy.choose_plan(*a, **k)
    )
    simulate(make_config(), "pdd", [make_request("a"), make_request("b", arrival_ms=1.0)])
    assert calls == ["a", "b"]


def test_p_md_one_prefill_one_wan_transfer_then_steps():
    # prefill 100 tokens x 1 ms = [0, 100]; 100 x 1000 B at 1000 B/ms = 100 ms + 5 ms delay -> KV at 205;
    # MD idle: token 0 at 205, then a 10 ms step per token.
    [run], _ = simulate(make_config(), "pd-wan", [make_request(output=3)])
    assert run.pipeline == "p-md"
    assert run.token_times == pytest.approx([205.0, 215.0, 225.0])
    assert run.wan_bytes == 100_000
    assert run.marks["prefill_end"] == pytest.approx(100.0)


def test_control_messages_between_the_sites_pay_the_lines_delay():
    # as test_p_md_one_prefill_one_wan_transfer_then_steps, with the NATS link across the line:
    # prefill is dispatched beside MD, not after its ack, so prefill is still [0, 100] and the KV
    # lands at 205; each of MD's tokens reaches the gateway 5 ms after MD sampled it.
    wan = {"bandwidth_mbps": 8.0, "delay_ms": 5.0, "jitter_ms": 0.0, "control_crosses": True}
    [run], _ = simulate(make_config(wan=wan), "pd-wan", [make_request(output=3)])
    assert run.marks["prefill_end"] == pytest.approx(100.0)
    assert run.token_times == pytest.approx([210.0, 220.0, 230.0])
    # a push that opens its connection first (one round trip, 10 ms) lands 10 ms later
    [tls], _ = simulate(make_config(wan={**wan, "connect_rtts": 1}), "pd-wan", [make_request(output=1)])
    assert tls.token_times == pytest.approx([220.0])
    # prefill's own first token (pdd) waits only for the plan, back once MD acked (2 x 5 ms)
    short = dataclasses.replace(make_request(output=2), prompt_len=5)
    [fast], _ = simulate(make_config(wan=wan), "pdd", [short])
    assert fast.tokens_by_role["prefill"] == 1 and fast.token_times[0] == pytest.approx(10.0)
    # pd-local's decoder sits with the gateway: nothing crosses, nothing changes
    [local], _ = simulate(make_config(wan=wan), "pd-local", [make_request(output=2)])
    assert local.token_times == pytest.approx([100.0, 110.1])


def test_pd_local_keeps_the_kv_in_datacenter_a():
    # prefill streams token 0 as it ends (100); in-DC: 100,000 B at 1,000,000 B/ms = 0.1 ms, no
    # delay, then MD's first step gives token 1
    [run], _ = simulate(make_config(), "pd-local", [make_request(output=2)])
    assert run.token_times == pytest.approx([100.0, 110.1]) and run.tokens_by_role["prefill"] == 1
    assert run.wan_bytes == 0 and run.local_bytes == 100_000


def test_two_transfers_share_the_wan():
    loop, done = EventLoop(), {}
    link = SharedLink(loop, BandwidthSchedule(8.0), delay_ms=5.0)
    link.send(100_000, lambda at, s: done.setdefault("big", at))
    link.send(50_000, lambda at, s: done.setdefault("small", at))
    loop.run()
    # both at 500 B/ms: the small one has its bytes at 100 ms; the big one then has 50,000 B
    # left at the full 1000 B/ms: 150 ms. Each plus the 5 ms delay.
    assert done == pytest.approx({"small": 105.0, "big": 155.0})


def test_one_shot_handoff_relay_streams_then_main_decode_extends():
    cfg = make_config(scheduler={"ttft_slo_ms": 1.0})  # p-md misses the SLO: relay
    [run], _ = simulate(cfg, "pdd-oneshot", [make_request(output=20)])
    assert (run.pipeline, run.handoff) == ("p-rld-md", "oneshot")
    # prefill streams token 0 at 100; RLD: KV in-DC at 100.1, one token per 10 ms step. MD has its KV at 205 and says
    # so (KVReady, 5 ms): at 210 RLD is mid-step; it stops after it, at 210.1, holding 12 tokens.
    # The final chunk (12 ids) reaches MD at 215.1; one step extends them: 10 + 11 x 1 ms.
    rld = [100.1 + 10 * k for k in range(1, 12)]
    md = [236.1 + 10 * k for k in range(8)]
    assert run.token_times == pytest.approx([100.0, *rld, *md])
    assert run.tokens_by_role == {"prefill": 1, "rld": 11, "md": 8}
    assert run.marks["final_chunk"] == pytest.approx(215.1)


def test_catch_up_hands_chunks_while_the_relay_keeps_streaming():
    cfg = make_config(scheduler={"ttft_slo_ms": 1.0})
    [run], _ = simulate(cfg, "pdd-catchup", [make_request(output=40)])
    assert run.handoff == "catchup"
    assert run.handoff_chunks >= 3  # chunks of 4 while the backlog is over 2, then the final one
    assert run.tokens_by_role["prefill"] == 1 and sum(run.tokens_by_role.values()) == 40
    gaps = [b - a for a, b in zip(run.token_times, run.token_times[1:])]
    assert max(gaps) < 20.0  # no one-shot stall: every extend was small


def test_relay_finishing_first_drops_main_decodes_copy_and_cancels_its_kv():
    # prefill streams token 0 at 100, RLD 2 more at 110.1, 120.1; MD's KV left at 100 at 1000 B/ms: at 120.1 it has
    # sent 20,100 of its 100,000 B, and the rest never crosses (as the real transfer is aborted).
    # relay-finishes off: with it the policy foresees this and sends no KV at all (below).
    # warm_md_cache off: the behaviour before it (on, the KV lands in MD's DRC: tests/sim/test_warm_md_cache.py)
    cfg = make_config(
        scheduler={"ttft_slo_ms": 1.0, "relay_finishes": False},
        handoff={"chunk_tokens": 4, "final_tokens": 2, "warm_md_cache": False},
    )
    [run], cluster = simulate(cfg, "pdd", [make_request(output=3)])
    assert run.tokens_by_role == {"prefill": 1, "rld": 2, "md": 0}
    assert run.wan_bytes == 20_100 and run.marks["kv_wan_cancelled"] == pytest.approx(120.1)
    assert "kv_wan" not in run.marks and cluster.wan.bytes_sent == 20_100
    md = next(d for d in cluster.decoders if d.role == "md")
    assert not md.running and md.used_tokens == 0 and md.pending == 0


def test_drc_keeps_prompt_and_answer_for_the_next_turn():
    first = make_request("t1", prompt=160, output=32)
    second = dataclasses.replace(
        make_request("t2", prompt=224, output=4), blocks=first.done_blocks + (("t2", 0),) * 2, depends_on="t1"
    )
    runs, _ = simulate(make_config(), "pd-wan-drc", [first, second])
    assert runs[1].hit["md"] == 192  # 12 blocks: the first prompt and its answer
    assert runs[1].wan_bytes == (224 - 192) * 1000
    assert runs[1].sent_ms == pytest.approx(runs[0].token_times[-1])  # waits for the turn before
    no_drc, _ = simulate(make_config(), "pd-wan", [first, second])
    assert no_drc[1].hit["md"] == 0 and no_drc[1].wan_bytes == 224_000


def test_relay_finishes_keeps_the_kv_that_main_decode_would_drop_off_the_line():
    # p-md's estimated TTFT: prefill 100 ms + 100,000 B at 1000 B/ms + 5 ms + a 10 ms step = 215 ms;
    # p-rld-md's: 100 + 0.1 + 10 = 110.1 ms. The relay's lead, ~105 ms, is 11 steps: an answer of 3
    # tokens is over before MD could take it (p-rld, no WAN bytes, the same token times); 20 is not.
    cfg = make_config(scheduler={"ttft_slo_ms": 1.0, "relay_finishes": True})  # off by default
    [short], _ = simulate(cfg, "pdd", [make_request(output=3)])
    assert (short.pipeline, short.reason, short.estimates["backlog_tokens"]) == ("p-rld", "relay-finishes", 3)
    assert short.wan_bytes == 0 and short.token_times == pytest.approx([100.0, 110.1, 120.1])
    [long], _ = simulate(cfg, "pdd", [make_request(output=20)])
    assert (long.pipeline, long.reason, long.estimates["backlog_tokens"]) == ("p-rld-md", "slo-miss-relay", 11)


def test_line_backlog_counts_the_kv_already_on_its_way():
    # two 100-token prompts sent together. b's p-md estimate: prefill (its 100 + a's 100 queued
    # tokens) 200 ms + 100,000 B at 1000 B/ms 100 ms + 5 + a 10 ms step = 315 ms: under a 400 ms SLO.
    # Counting a's 100,000 B still owed to the line, b's transfer takes 200 ms: 415 ms, over it.
    reqs = [make_request("a"), make_request("b")]
    off = {"ttft_slo_ms": 400.0, "line_backlog": False, "relay_finishes": False}
    plain, _ = simulate(make_config(scheduler=off), "pdd", reqs)
    assert [(r.pipeline, r.estimates["ttft_ms"]["p-md"]) for r in plain] == [("p-md", 215.0), ("p-md", 315.0)]
    ruled, cluster = simulate(make_config(scheduler={**off, "line_backlog": True}), "pdd", reqs)
    assert [(r.pipeline, r.estimates["ttft_ms"]["p-md"]) for r in ruled] == [("p-md", 215.0), ("p-rld-md", 415.0)]
    assert [r.estimates["wan_backlog_bytes"] for r in ruled] == [0, 100_000]
    assert cluster.pipeline.backlog.total(cluster.loop.now) == 0 and not cluster.pipeline.backlog  # all landed
    # both rules on: b's 3 tokens are over long before MD's KV lands
    both, _ = simulate(make_config(scheduler={**off, "line_backlog": True, "relay_finishes": True}), "pdd", reqs)
    assert [(r.pipeline, r.reason) for r in both] == [("p-md", "slo-met-md"), ("p-rld", "relay-finishes")]


def test_the_lines_price_scales_with_its_capacity():
    cfg = make_config(prices={"wan_line": 0.3, "wan_line_gbps": 40}, wan={"bandwidth_mbps": 140_000.0})
    assert cfg.settings_prices()["wan_line"] == pytest.approx(0.3 * 140 / 40)
    assert make_config(prices={"wan_line": 0.3}).settings_prices()["wan_line"] == 0.3  # no size: flat
