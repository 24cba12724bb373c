"""The oscillation guard in the simulator (the queue model it replaces, services/scheduler/simulate.py,
had these checks): a burst of fresh prompts that miss the TTFT SLO via MD, onto a one-slot relay.

Trivial chip (tests/sim/factories.py) on a line at half the trivial rate (4 Mbps, 500 B/ms): a
20-token prompt prefills in 20 ms and its 20,000 B of KV take 40 ms on the line, so prefill hands out
a request every 20 ms while the line drains one every 40 ms. A relayed request stays on the relay
until MD has its KV and says so: without the guard those stays grow with the line's backlog and the
relay holds ever more requests; with it the relay holds at most its one slot. The scheduler's
relay-finishes and line-backlog rules are off unless a test says so: these are the guard's checks.
"""

from __future__ import annotations

from sim.run import simulate
from tests.sim.factories import make_config, make_request

SLOTS = 1


def _burst(n: int, guard: bool = True, slo_ms: float = 1.0, gap_ms: float = 20.0, rules: bool = False):
    cfg = make_config(
        roles={"rld": {"max_running": SLOTS}},
        scheduler={"ttft_slo_ms": slo_ms, "guard": guard, "relay_finishes": rules, "line_backlog": rules},
        wan={"bandwidth_mbps": 4.0, "delay_ms": 5.0},
    )
    reqs = [make_request(f"r{i:03d}", prompt=20, output=50, arrival_ms=i * gap_ms) for i in range(n)]
    runs, cluster = simulate(cfg, "pdd", reqs, sample_every_ms=5.0)
    reasons: dict[str, int] = {}
    for r in runs:
        reasons[r.reason] = reasons.get(r.reason, 0) + 1
    return runs, reasons, max(s["rld_busy"] for s in cluster.samples)


def test_with_the_guard_the_relay_never_holds_more_than_its_slots():
    runs, reasons, max_busy = _burst(40)
    assert max_busy <= SLOTS
    assert reasons["rld-saturated"] > 0 and reasons["slo-miss-relay"] > 0
    assert all(r.estimates["rld_busy"] < SLOTS for r in runs if r.reason == "slo-miss-relay")
    runs, reasons, max_busy = _burst(40, rules=True)  # the guard still bounds the relay with the rules on
    assert max_busy <= SLOTS and reasons["rld-saturated"] > 0


def test_without_the_guard_the_relay_queue_grows_with_the_burst():
    _, reasons, short = _burst(20, guard=False)
    _, _, long = _burst(60, guard=False)
    assert reasons == {"slo-miss-relay": 20}
    assert short > 2 * SLOTS and long > 2 * short
    assert _burst(60)[2] == _burst(20)[2] <= SLOTS  # the guard's bound does not depend on the burst


def test_a_relay_that_keeps_up_never_needs_the_guard():
    on, off = _burst(10, gap_ms=1000.0), _burst(10, guard=False, gap_ms=1000.0)
    assert on[1] == off[1] == {"slo-miss-relay": 10}
    assert [r.token_times for r in on[0]] == [r.token_times for r in off[0]]


def test_traffic_that_meets_the_slo_via_md_never_touches_the_relay():
    runs, reasons, max_busy = _burst(30, guard=False, slo_ms=60_000.0)
    assert reasons == {"slo-met-md": 30} and max_busy == 0


def test_the_burst_is_deterministic():
    a, b = _burst(30, guard=False), _burst(30, guard=False)
    assert [r.token_times for r in a[0]] == [r.token_times for r in b[0]]
