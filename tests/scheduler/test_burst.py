"""The burst simulation behind the oscillation demo: the guard bounds RLD's queue."""

from __future__ import annotations

from services.scheduler.policy import PolicyConfig
from services.scheduler.simulate import percentile, simulate_burst

CFG = PolicyConfig()  # a 1024-token fresh prompt misses the SLO through MD: every request wants the relay


def test_overload_without_the_guard_grows_the_relay_queue_and_the_tail():
    out = simulate_burst(200, arrival_gap_ms=50, rld_slots=4, rld_service_ms=2000, config=CFG)
    on, off = out["guard_on"], out["guard_off"]
    assert out["offered_rld_load"] == 10.0
    assert on["max_rld_queue"] == 0 and on["max_rld_busy"] <= 4
    assert on["reasons"]["rld-saturated"] > 0 and on["reasons"]["slo-miss-relay"] > 0
    assert off["max_rld_queue"] > 150 and off["reasons"] == {"slo-miss-relay": 200}
    assert off["ttft_p99_ms"] > 10 * on["ttft_p99_ms"]


def test_the_queue_is_unbounded_without_the_guard_and_bounded_with_it():
    short = simulate_burst(100, 50, 4, 2000, CFG)
    long = simulate_burst(400, 50, 4, 2000, CFG)
    assert long["guard_off"]["max_rld_queue"] > 3 * short["guard_off"]["max_rld_queue"]
    assert long["guard_on"]["max_rld_queue"] == short["guard_on"]["max_rld_queue"] == 0
    assert long["guard_on"]["ttft_p99_ms"] == short["guard_on"]["ttft_p99_ms"]  # the p-md penalty, flat


def test_a_relay_that_keeps_up_never_needs_the_guard():
    out = simulate_burst(100, arrival_gap_ms=1000, rld_slots=4, rld_service_ms=2000, config=CFG)
    assert out["offered_rld_load"] == 0.5
    assert out["guard_on"] == out["guard_off"]
    assert out["guard_on"]["reasons"] == {"slo-miss-relay": 100} and out["guard_on"]["max_rld_queue"] == 0


def test_high_hit_traffic_never_touches_the_relay():
    fast = PolicyConfig(ttft_slo_ms=60_000)  # every request meets the SLO through MD
    out = simulate_burst(50, 10, 2, 5000, fast)
    assert out["guard_off"]["reasons"] == {"slo-met-md": 50} and out["guard_off"]["max_rld_busy"] == 0


def test_the_simulation_is_deterministic():
    assert simulate_burst(150, 30, 3, 1500, CFG) == simulate_burst(150, 30, 3, 1500, CFG)


def test_nearest_rank_percentile():
    assert percentile([], 99) == 0.0
    assert percentile([5.0], 99) == 5.0
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (50.0, 99.0, 100.0)
