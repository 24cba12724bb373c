"""Pipeline choice, the anomalous filter, handoff mode, the oscillation guard, relay-finishes,
the line's backlog and main-decode's suffix, rule by rule."""

from __future__ import annotations

import dataclasses

import pytest

from services.scheduler.policy import NoCapacity, PolicyConfig, Saturated, choose_plan
from shared.messages import BadMessage, Submit
from tests.scheduler.factories import fleet, request

CFG = PolicyConfig()  # auto: SLO 1000 ms, 300 tok/s prefill, 1 Gbps WAN prior, 32 relay slots
RULES = dataclasses.replace(CFG, relay_finishes=True, line_backlog=True)  # both off by default


def warm_prefill_cold_md(**rld) -> list:
    """P holds the prompt (2000 tokens, all but one block); MD's cache fell behind."""
    return fleet(prefill_0={"hit_tokens": 1984}, rld_0=rld)


# -- pipeline choice ------------------------------------------------------------------------
def test_high_hit_goes_straight_to_main_decode():
    d = choose_plan(request(2000), fleet(prefill_0={"hit_tokens": 1984}, md_0={"hit_tokens": 1984}), CFG)
    assert (d.pipeline, d.reason, d.handoff) == ("p-md", "slo-met-md", "none")
    assert d.estimates.ttft_ms["p-md"] <= CFG.ttft_slo_ms and d.starts == {"md": 1984}
    assert set(d.estimates.ttft_ms) == {"p-md", "p-rld-md"}  # both candidates were estimated


def test_low_hit_relays():
    d = choose_plan(request(1500), fleet(), CFG)
    assert (d.pipeline, d.reason) == ("p-rld-md", "slo-miss-relay")
    assert d.estimates.ttft_ms["p-md"] > CFG.ttft_slo_ms
    assert d.estimates.ttft_ms["p-rld-md"] < d.estimates.ttft_ms["p-md"]
    assert (d.prefill, d.rld, d.md) == ("prefill-0", "rld-0", "md-0")


def test_the_live_wan_estimate_decides_when_md_lacks_the_prompt():
    d = choose_plan(request(2000), warm_prefill_cold_md(), CFG)  # 92 MB at the 1 Gbps prior: ~0.9 s TTFT
    assert (d.pipeline, d.reason, d.estimates.wan_mbps) == ("p-md", "slo-met-md", 1000.0)
    d = choose_plan(request(2000), warm_prefill_cold_md(), CFG, wan_mbps=100.0)  # the link sagged
    assert (d.pipeline, d.reason, d.estimates.wan_mbps) == ("p-rld-md", "slo-miss-relay", 100.0)


def test_a_tighter_slo_relays_more():
    views = fleet(prefill_0={"hit_tokens": 1984}, md_0={"hit_tokens": 1984})
    assert choose_plan(request(2000), views, dataclasses.replace(CFG, ttft_slo_ms=100.0)).pipeline == "p-rld-md"


def test_a_requests_own_slo_replaces_the_configured_one_for_its_plan_alone():
    views = fleet(prefill_0={"hit_tokens": 1984}, md_0={"hit_tokens": 1984})
    tight = choose_plan(request(2000, ttft_slo_ms=50.0), views, CFG)  # meets the configured 1000 ms, not 50
    assert (tight.pipeline, tight.reason, tight.estimates.ttft_slo_ms) == ("p-rld-md", "slo-miss-relay", 50.0)
    own = choose_plan(request(2000), views, CFG)
    assert (own.pipeline, own.estimates.ttft_slo_ms) == ("p-md", CFG.ttft_slo_ms)
    loose = choose_plan(request(1500, ttft_slo_ms=60_000.0), fleet(), CFG)  # misses 1000 ms, meets a minute
    assert (loose.pipeline, loose.reason, loose.estimates.as_dict()["ttft_slo_ms"]) == ("p-md", "slo-met-md", 60_000.0)


@pytest.mark.parametrize("slo", [0.0, -5.0, float("nan"), float("inf"), 3_600_001.0])
def test_a_submit_with_an_slo_out_of_range_is_a_bad_message(slo):
    raw = {"request_id": "r", "prompt_ids": [1], "sampling": {}, "ttft_slo_ms": slo}
    with pytest.raises(BadMessage, match="ttft_slo_ms"):
        Submit.from_dict(raw)
    assert Submit.from_dict({**raw, "ttft_slo_ms": 250}).ttft_slo_ms == 250.0


def test_no_main_decoder_alive_leaves_datacenter_a_serving_alone():
    views = fleet("prefill-0", "rld-0")
    assert (choose_plan(request(1500), views, CFG).reason, choose_plan(request(3000, 100), views, CFG).reason) == (
        "no-md-alive",
        "anomalous",
    )
    with pytest.raises(NoCapacity, match="md"):
        choose_plan(request(1500), fleet("prefill-0"), CFG)


# -- anomalous traffic ----------------------------------------------------------------------
def test_long_uncached_input_with_short_output_stays_on_relay():
    d = choose_plan(request(3000, 100), fleet(), CFG)
    assert (d.pipeline, d.reason, d.handoff) == ("p-rld", "anomalous", "none")
    assert (d.prefill, d.rld, d.md) == ("prefill-0", "rld-0", "") and d.md_cached_tokens == 0
    assert d.estimates.uncached_tokens == 3000


@pytest.mark.parametrize(
    "prompt_len, max_tokens, anomalous",
    [(2048, 499, True), (2047, 499, False), (2048, 500, False), (8000, 1, True), (8000, 500, False)],
)
def test_anomalous_thresholds_both_sides(prompt_len, max_tokens, anomalous):
    d = choose_plan(request(prompt_len, max_tokens), fleet(), CFG)
    assert (d.pipeline == "p-rld") == anomalous and (d.reason == "anomalous") == anomalous


@pytest.mark.parametrize("holder", ["prefill_0", "md_0"])
def test_a_prefix_hit_on_prefill_or_md_makes_a_long_input_ordinary(holder):
    d = choose_plan(request(3000, 100), fleet(**{holder: {"hit_tokens": 1000}}), CFG)
    assert d.pipeline != "p-rld" and d.estimates.uncached_tokens == 2000


def test_anomalous_thresholds_come_from_the_config():
    cfg = dataclasses.replace(CFG, anomalous_min_uncached=512, anomalous_max_output=64)
    assert choose_plan(request(600, 32), fleet(), cfg).pipeline == "p-rld"
    assert choose_plan(request(600, 64), fleet(), cfg).pipeline == "p-rld-md"


def test_anomalous_without_relay_and_forced_plans():
    assert choose_plan(request(3000, 100), fleet("prefill-0", "md-0"), CFG).reason == "no-relay-alive"
    d = choose_plan(request(3000, 100, pipeline="p-md"), fleet(), CFG)
    assert (d.pipeline, d.reason) == ("p-md", "forced")


def test_anomalous_traffic_goes_to_relay_even_when_it_is_saturated():
    """It never floods the WAN; it holds a slot for fewer than `anomalous_max_output` tokens."""
    assert choose_plan(request(3000, 100), fleet(rld_0={"running": 40}), CFG).pipeline == "p-rld"


# -- handoff mode ---------------------------------------------------------------------------
def test_small_backlog_with_headroom_is_one_shot():
    d = choose_plan(request(1500), fleet(), CFG)  # MD lags RLD by ~0.5 s: ~7 tokens
    assert (d.handoff, d.handoff_reason, d.chunk_tokens) == ("oneshot", "small-backlog", 0)
    assert 0 < d.estimates.backlog_tokens <= CFG.catchup_threshold


def test_big_backlog_with_headroom_catches_up_in_chunks():
    d = choose_plan(request(2000), warm_prefill_cold_md(running=4), CFG, wan_mbps=100.0)  # MD lags ~7 s
    assert (d.handoff, d.handoff_reason, d.chunk_tokens) == ("catchup", "backlog", 64)
    assert d.estimates.backlog_tokens > CFG.catchup_threshold


def test_backlog_is_capped_by_the_output_budget():
    no_rule = dataclasses.replace(CFG, relay_finishes=False)  # with it, this request runs p-rld (below)
    d = choose_plan(request(2000, 50), warm_prefill_cold_md(), no_rule, wan_mbps=100.0)
    assert d.estimates.backlog_tokens == 50 and d.handoff == "oneshot"


def test_catchup_chunk_and_threshold_come_from_the_config():
    cfg = dataclasses.replace(CFG, catchup_chunk=16, catchup_threshold=4)
    d = choose_plan(request(1500), fleet(), cfg)
    assert (d.handoff, d.chunk_tokens) == ("catchup", 16)


def test_relay_pressure_hands_off_as_early_as_possible():
    busy = warm_prefill_cold_md(running=20, waiting=4)  # 24 of 32 slots = the 0.75 pressure mark
    d = choose_plan(request(2000), busy, CFG, wan_mbps=100.0)
    assert (d.pipeline, d.handoff, d.handoff_reason) == ("p-rld-md", "oneshot", "rld-pressure")
    assert d.estimates.backlog_tokens > CFG.catchup_threshold and d.estimates.rld_busy == 24
    d = choose_plan(request(2000), warm_prefill_cold_md(running=23), CFG, wan_mbps=100.0)
    assert d.handoff == "catchup"  # one slot below the mark


def test_handoff_hint_and_pinned_handoff_win_over_the_rule():
    d = choose_plan(request(2000, handoff="oneshot"), warm_prefill_cold_md(), CFG, wan_mbps=100.0)
    assert (d.handoff, d.handoff_reason) == ("oneshot", "forced")
    d = choose_plan(request(1500), fleet(), dataclasses.replace(CFG, default_handoff="catchup"))
    assert (d.handoff, d.handoff_reason, d.chunk_tokens) == ("catchup", "default", 64)


# -- relay-finishes: the relay will stream the whole answer before MD's KV lands -------------
def test_the_relay_finishes_alone_exactly_when_its_backlog_covers_the_answer():
    """MD lags the relay by ~7.3 s at 100 Mbps: 98 relay steps. An answer of at most 98 tokens is
    over before MD could take it: p-rld, and no KV crosses for MD to drop. 99 tokens: p-rld-md."""
    views = warm_prefill_cold_md()
    b = choose_plan(request(2000, 10_000), views, RULES, wan_mbps=100.0).estimates.backlog_tokens
    assert b == 98
    for max_tokens in (1, b - 1, b):
        d = choose_plan(request(2000, max_tokens), views, RULES, wan_mbps=100.0)
        assert (d.pipeline, d.reason, d.handoff, d.handoff_reason) == ("p-rld", "relay-finishes", "none", "")
        assert (d.prefill, d.rld, d.md) == ("prefill-0", "rld-0", "") and "md" not in d.starts
        assert (d.estimates.backlog_tokens, d.kv_wire, d.kv_wire_reason) == (max_tokens, "native", "")
    d = choose_plan(request(2000, b + 1), views, RULES, wan_mbps=100.0)
    assert (d.pipeline, d.reason, d.estimates.backlog_tokens) == ("p-rld-md", "slo-miss-relay", b)


def test_relay_finishes_replaces_only_the_slo_miss_relay_answer():
    views = warm_prefill_cold_md()
    fast = choose_plan(request(2000, 1), views, RULES)  # MD meets the SLO: its KV is worth sending
    assert (fast.pipeline, fast.reason, fast.estimates.backlog_tokens) == ("p-md", "slo-met-md", 0)
    forced = choose_plan(request(2000, 1, pipeline="p-rld-md"), views, RULES, wan_mbps=100.0)
    pinned = choose_plan(
        request(2000, 1), views, dataclasses.replace(RULES, default_pipeline="p-rld-md"), wan_mbps=100.0
    )
    assert [(d.pipeline, d.reason) for d in (forced, pinned)] == [("p-rld-md", "forced"), ("p-rld-md", "default")]
    no_relay = choose_plan(
        request(2000, 1), fleet("prefill-0", "md-0", prefill_0={"hit_tokens": 1984}), RULES, wan_mbps=100.0
    )
    assert (no_relay.pipeline, no_relay.reason) == ("p-md", "no-relay-alive")


def test_the_guard_still_comes_first():
    d = choose_plan(request(2000, 1), warm_prefill_cold_md(running=32), RULES, wan_mbps=100.0)
    assert (d.pipeline, d.reason) == ("p-md", "rld-saturated")


def test_without_relay_finishes_the_relay_streams_while_mds_kv_crosses_anyway():
    off = dataclasses.replace(RULES, relay_finishes=False)
    d = choose_plan(request(2000, 1), warm_prefill_cold_md(), off, wan_mbps=100.0)
    assert (d.pipeline, d.reason, d.estimates.backlog_tokens) == ("p-rld-md", "slo-miss-relay", 1)


# -- line-backlog: a transfer to MD waits for the KV already on the line --------------------
def test_the_lines_backlog_delays_md_and_flips_the_plan():
    """2000 tokens * 46,080 B at 1 Gbps: 737 ms on an idle line, 876 ms in all, under the 1 s SLO;
    20 MB already dispatched and not landed add 160 ms: over it."""
    views = warm_prefill_cold_md()
    idle = choose_plan(request(2000), views, RULES)
    busy = choose_plan(request(2000), views, RULES, wan_backlog_bytes=20e6)
    assert (idle.pipeline, idle.reason) == ("p-md", "slo-met-md")
    assert (busy.pipeline, busy.reason) == ("p-rld-md", "slo-miss-relay")
    assert busy.estimates.ttft_ms["p-md"] - idle.estimates.ttft_ms["p-md"] == pytest.approx(20e6 / 125_000)
    assert busy.estimates.ttft_ms["p-rld-md"] == idle.estimates.ttft_ms["p-rld-md"]  # the relay is in-DC
    assert (idle.estimates.wan_backlog_bytes, busy.estimates.wan_backlog_bytes) == (0.0, 20e6)
    short = choose_plan(request(2000, 10), views, RULES, wan_backlog_bytes=20e6)  # over before MD's KV lands
    assert (short.pipeline, short.reason) == ("p-rld", "relay-finishes")


def test_without_line_backlog_the_line_looks_idle():
    off = dataclasses.replace(RULES, line_backlog=False)
    d = choose_plan(request(2000), warm_prefill_cold_md(), off, wan_backlog_bytes=20e6)
    assert (d.pipeline, d.reason, d.estimates.wan_backlog_bytes) == ("p-md", "slo-met-md", 0.0)
    assert d.estimates.ttft_ms == choose_plan(request(2000), warm_prefill_cold_md(), RULES).estimates.ttft_ms


def test_a_decoder_that_lacks_nothing_sends_no_kv_and_waits_for_none():
    views = fleet(prefill_0={"hit_tokens": 2000}, md_0={"hit_tokens": 2000})
    idle, busy = (choose_plan(request(2000), views, RULES, wan_backlog_bytes=b) for b in (0.0, 1e9))
    assert busy.estimates.ttft_ms == idle.estimates.ttft_ms and busy.reason == "slo-met-md"


def test_auto_wire_narrows_for_the_lines_backlog_too():
    auto = dataclasses.replace(RULES, kv_wire="auto", wire_bytes_per_token=WIRES)
    idle = choose_plan(request(2000), warm_prefill_cold_md(), auto)
    busy = choose_plan(request(2000), warm_prefill_cold_md(), auto, wan_backlog_bytes=20e6)
    assert (idle.kv_wire, busy.kv_wire, busy.kv_wire_reason, busy.pipeline) == (
        "native",
        "bf16",
        "narrowed-for-slo",
        "p-md",
    )


# -- main-decode's suffix: computed there rather than pushed through the line ---------------
def warm_md(**md) -> list:
    """Prefill and MD hold the prompt (1000 tokens) but its last 40; MD's measured prefill rate,
    2,000 tok/s, makes their extend 20 ms."""
    return fleet(prefill_0={"hit_tokens": 960}, md_0={"hit_tokens": 960, "prefill_tok_s": 2000.0, **md})


PUSH_40_AT_100_MBPS = 40 * 46_080 / 12_500  # 147 ms of float32 KV on the line


def test_md_computes_a_short_suffix_when_its_extend_beats_the_line():
    d = choose_plan(request(1000), warm_md(), CFG, wan_mbps=100.0)
    assert (d.pipeline, d.md_computes_suffix, d.md_suffix_reason) == ("p-md", 40, "extend-cheaper")
    assert d.starts == {"md": 1000} and d.md_cached_tokens == 960  # its start is the prompt's end
    assert (d.estimates.md_push_ms, d.estimates.md_extend_ms) == (pytest.approx(PUSH_40_AT_100_MBPS), 20.0)
    pushed = choose_plan(request(1000), warm_md(), dataclasses.replace(CFG, md_suffix_max_tokens=0), wan_mbps=100.0)
    saved = pushed.estimates.ttft_ms["p-md"] - d.estimates.ttft_ms["p-md"]
    assert saved == pytest.approx(PUSH_40_AT_100_MBPS - 20.0)  # MD's estimate has its extend, not the push


def test_a_suffix_over_the_cap_is_pushed():
    capped = choose_plan(request(1000), warm_md(), dataclasses.replace(CFG, md_suffix_max_tokens=39), wan_mbps=100.0)
    assert (capped.md_computes_suffix, capped.md_suffix_reason, capped.starts) == (0, "over-cap", {"md": 960})
    views = fleet(md_0={"hit_tokens": 704, "prefill_tok_s": 2000.0})  # 296 tokens: over the default 256
    long = choose_plan(request(1000), views, CFG, wan_mbps=100.0)
    assert (long.md_computes_suffix, long.md_suffix_reason, long.starts["md"]) == (0, "over-cap", 704)
    at_cap = choose_plan(request(1000), warm_md(), dataclasses.replace(CFG, md_suffix_max_tokens=40), wan_mbps=100.0)
    assert at_cap.md_computes_suffix == 40


def test_a_cap_of_zero_turns_the_path_off():
    d = choose_plan(request(1000), warm_md(), dataclasses.replace(CFG, md_suffix_max_tokens=0), wan_mbps=100.0)
    assert (d.md_computes_suffix, d.md_suffix_reason, d.starts["md"]) == (0, "off", 960)
    assert (d.estimates.md_push_ms, d.estimates.md_extend_ms) == (0.0, 0.0)


def test_a_fast_line_pushes_the_suffix():
    """At the 1 Gbps prior the 40 tokens' KV crosses in 15 ms, sooner than MD's 20 ms extend."""
    d = choose_plan(request(1000), warm_md(), CFG)
    assert (d.md_computes_suffix, d.md_suffix_reason, d.starts["md"]) == (0, "push-cheaper", 960)
    assert (d.estimates.md_push_ms, d.estimates.md_extend_ms) == (pytest.approx(PUSH_40_AT_100_MBPS / 10), 20.0)


def test_the_lines_backlog_counts_against_the_push_when_the_estimates_count_it():
    """The fast line with 20 MB on it: the suffix's KV would land 175 ms from now."""
    d = choose_plan(request(1000), warm_md(), RULES, wan_backlog_bytes=20e6)
    assert (d.md_computes_suffix, d.md_suffix_reason, d.estimates.md_push_ms) == (
        40,
        "extend-cheaper",
        pytest.approx((40 * 46_080 + 20e6) / 125_000),
    )
    assert choose_plan(request(1000), warm_md(), CFG, wan_backlog_bytes=20e6).md_suffix_reason == "push-cheaper"


def test_without_a_measured_rate_the_prior_stands_in():
    """MD has not measured its prefill rate: at the 300 tok/s prior the 40 tokens take 133 ms."""
    views = fleet(prefill_0={"hit_tokens": 960}, md_0={"hit_tokens": 960})
    assert choose_plan(request(1000), views, CFG, wan_mbps=100.0).md_suffix_reason == "extend-cheaper"  # 147 ms
    assert choose_plan(request(1000), views, CFG, wan_mbps=200.0).md_suffix_reason == "push-cheaper"  # 74 ms


def test_never_when_prefill_and_md_run_in_different_dtypes():
    """The shipped fleet (prefill float32, MD bfloat16): MD's own bfloat16 KV of the suffix is
    not prefill's float32 KV, so the answer would change. Pushed, however slow the line."""
    d = choose_plan(request(1000), warm_md(dtype="bfloat16"), CFG, wan_mbps=1.0)
    assert (d.md_computes_suffix, d.md_suffix_reason, d.starts["md"]) == (0, "dtypes-differ", 960)
    both = fleet(prefill_0={"hit_tokens": 960, "dtype": "bfloat16"}, md_0={"hit_tokens": 960, "dtype": "bfloat16"})
    assert choose_plan(request(1000), both, CFG, wan_mbps=1.0).md_computes_suffix == 40


def test_the_relay_still_gets_its_kv_while_md_computes_its_suffix():
    d = choose_plan(request(1000, pipeline="p-rld-md"), warm_md(), CFG, wan_mbps=100.0)
    assert (d.pipeline, d.md_computes_suffix, d.starts) == ("p-rld-md", 40, {"rld": 0, "md": 1000})


def test_nothing_to_weigh_without_a_suffix_or_without_md():
    whole = fleet(prefill_0={"hit_tokens": 992}, md_0={"hit_tokens": 992, "prefill_tok_s": 2000.0})
    d = choose_plan(request(992), whole, CFG, wan_mbps=100.0)  # MD holds the whole prompt
    assert (d.md_computes_suffix, d.md_suffix_reason, d.starts["md"]) == (0, "", 992)
    relay_only = choose_plan(request(3000, 100), fleet(), CFG)  # anomalous: p-rld, no MD in the plan
    assert (relay_only.pipeline, relay_only.md_computes_suffix, relay_only.md_suffix_reason) == ("p-rld", 0, "")


# -- oscillation guard (relay admission control) --------------------------------------------
def test_saturated_relay_sends_low_hit_to_main_with_the_penalty():
    d = choose_plan(request(1500), fleet(rld_0={"running": 30, "waiting": 2}), CFG)
    assert (d.pipeline, d.reason) == ("p-md", "rld-saturated") and not d.rld
    assert d.estimates.ttft_ms["p-md"] > CFG.ttft_slo_ms  # the penalty, taken knowingly


def test_without_the_guard_a_saturated_relay_is_used_anyway():
    d = choose_plan(request(1500), fleet(rld_0={"running": 30, "waiting": 2}), dataclasses.replace(CFG, guard=False))
    assert (d.pipeline, d.reason, d.handoff_reason) == ("p-rld-md", "slo-miss-relay", "rld-pressure")


def test_one_slot_free_is_not_saturated_and_slots_come_from_the_config():
    assert choose_plan(request(1500), fleet(rld_0={"running": 31}), CFG).pipeline == "p-rld-md"
    small = dataclasses.replace(CFG, rld_slots=4)
    assert choose_plan(request(1500), fleet(rld_0={"running": 4}), small).reason == "rld-saturated"


def test_requests_planned_onto_the_relay_count_before_their_kv_lands():
    """A burst: the relay runs nothing yet, but 32 planned requests have their KV on the way."""
    d = choose_plan(request(1500), fleet(rld_0={"pending": 32}), CFG)
    assert (d.pipeline, d.reason, d.estimates.rld_busy) == ("p-md", "rld-saturated", 32)
    views = fleet("prefill-0", "rld-0", "rld-1", "md-0", rld_0={"pending": 3}, rld_1={"running": 2})
    assert choose_plan(request(1500), views, CFG).rld == "rld-1"


def test_the_least_busy_relay_is_the_one_the_guard_checks():
    views = fleet("prefill-0", "rld-0", "rld-1", "md-0", rld_0={"running": 32}, rld_1={"running": 10})
    d = choose_plan(request(1500), views, CFG)
    assert (d.pipeline, d.rld) == ("p-rld-md", "rld-1")


# -- bounded queues -------------------------------------------------------------------------
def test_a_full_instance_is_skipped_for_one_with_room():
    views = fleet(
        "prefill-0",
        "prefill-1",
        "rld-0",
        "md-0",
        "md-1",
        md_0={"hit_tokens": 1400, "held": 8, "capacity": 8},
        md_1={"held": 7, "capacity": 8},
    )
    d = choose_plan(request(1500), views, dataclasses.replace(CFG, default_pipeline="p-md"))
    assert d.md == "md-1"  # the warm one has no room left


def test_every_instance_of_a_role_full_is_saturated_not_dead():
    views = fleet(md_0={"held": 8, "capacity": 8})
    with pytest.raises(Saturated, match="every md instance is full") as e:
        choose_plan(request(1500), views, CFG)
    assert e.value.status == 429
    with pytest.raises(NoCapacity) as dead:
        choose_plan(request(1500), fleet("prefill-0"), CFG)
    assert dead.value.status == 503 and not isinstance(dead.value, Saturated)


def test_a_full_relay_sends_the_request_to_main_decode():
    d = choose_plan(request(1500), fleet(rld_0={"held": 4, "capacity": 4}), dataclasses.replace(CFG, guard=False))
    assert (d.pipeline, d.reason) == ("p-md", "rld-full")


def test_unbounded_instances_are_never_full():
    assert choose_plan(request(1500), fleet(md_0={"held": 10_000}), CFG).md == "md-0"


# -- the KV wire format over the WAN --------------------------------------------------------
WIRES = {"native": 46_080, "bf16": 23_040, "fp8": 12_240, "int8": 12_240}


def test_a_configured_wire_format_is_used_and_its_bytes_estimated():
    narrow = dataclasses.replace(CFG, kv_wire="int8", wire_bytes_per_token=WIRES)
    d = choose_plan(request(2000), warm_prefill_cold_md(), narrow, wan_mbps=100.0)
    wide = choose_plan(request(2000), warm_prefill_cold_md(), CFG, wan_mbps=100.0)
    assert (d.kv_wire, d.kv_wire_reason) == ("int8", "configured") and wide.kv_wire == "native"
    assert d.estimates.ttft_ms["p-md"] < wide.estimates.ttft_ms["p-md"] / 2  # a quarter of the bytes cross


def test_auto_narrows_only_as_far_as_the_slo_needs():
    auto = dataclasses.replace(CFG, kv_wire="auto", wire_bytes_per_token=WIRES)
    fast = choose_plan(request(2000), warm_prefill_cold_md(), auto)  # native meets the SLO at 1 Gbps
    assert (fast.kv_wire, fast.kv_wire_reason) == ("native", "slo-met")
    sagged = choose_plan(request(2000), warm_prefill_cold_md(), auto, wan_mbps=300.0)
    assert (sagged.kv_wire, sagged.kv_wire_reason, sagged.pipeline) == ("int8", "narrowed-for-slo", "p-md")
    hopeless = choose_plan(request(2000), warm_prefill_cold_md(), auto, wan_mbps=20.0)
    assert (hopeless.kv_wire, hopeless.kv_wire_reason, hopeless.pipeline) == ("int8", "narrowest", "p-rld-md")
    relay_only = choose_plan(request(3000, 100), fleet(), auto)  # anomalous: nothing crosses
    assert (relay_only.pipeline, relay_only.kv_wire) == ("p-rld", "native")
