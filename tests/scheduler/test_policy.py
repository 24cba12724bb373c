"""Instance choice, forced and pinned plans, avoid, and the module's walls: constructed inputs, no servers."""

from __future__ import annotations

import pytest

from services.scheduler.policy import InstanceView, NoCapacity, PlanRequest, PolicyConfig, Saturated, choose_plan
from tests.scheduler.factories import fleet as plain_fleet
from tests.scheduler.factories import view

PINNED = PolicyConfig("p-rld-md", "oneshot")  # what the cluster config gives until it says "auto"
AUTO = PolicyConfig()


def fleet(**hits) -> list[InstanceView]:
    loads = {"prefill-0": 0.2, "prefill-1": 0.1, "rld-0": 0.0, "md-0": 0.3, "md-1": 0.1}
    roles = {"prefill-0": "prefill", "prefill-1": "prefill", "rld-0": "rld", "md-0": "md", "md-1": "md"}
    return [
        InstanceView(i, roles[i], "B" if roles[i] == "md" else "A", loads[i], hits.get(i.replace("-", "_"), 0))
        for i in loads
    ]


def test_pinned_default_is_relay_then_main_on_the_least_loaded_instances():
    d = choose_plan(PlanRequest("r", 100, 10), fleet(), PINNED)
    assert d.pipeline == "p-rld-md" and d.handoff == "oneshot" and d.reason == "default"
    assert d.handoff_reason == "default" and d.chunk_tokens == 0
    assert (d.prefill, d.rld, d.md) == ("prefill-1", "rld-0", "md-1")
    assert d.starts == {"rld": 0, "md": 0}


def test_pinned_main_decode_ignores_the_slo_rules():
    d = choose_plan(PlanRequest("r", 1500, 10), fleet(), PolicyConfig("p-md", "oneshot"))
    assert (d.pipeline, d.handoff, d.reason) == ("p-md", "none", "default")
    assert d.estimates.ttft_ms["p-md"] > PolicyConfig().ttft_slo_ms  # it would have relayed


def test_prefix_hit_outweighs_a_small_load_difference():
    d = choose_plan(PlanRequest("r", 1000, 10), fleet(md_0=960, prefill_0=960), PINNED)
    assert d.md == "md-0" and d.prefill == "prefill-0"
    assert d.md_cached_tokens == 960 and d.starts["md"] == 960


def test_a_much_busier_warm_instance_loses():
    views = [v if v.id != "md-0" else InstanceView("md-0", "md", "B", 3.0, 960) for v in fleet()]
    assert choose_plan(PlanRequest("r", 1000, 10), views, PINNED).md == "md-1"


def test_richer_figures_warm_beats_slightly_busier_and_busy_loses():
    figures = {"total_blocks": 1000, "free_blocks": 900}
    warm = {**figures, "hit_tokens": 960, "running": 3}
    views = plain_fleet("prefill-0", "rld-0", "md-0", "md-1", md_0=warm, md_1={**figures, "running": 1})
    assert choose_plan(PlanRequest("r", 1000, 10), views, AUTO).md == "md-0"
    busy = {**warm, "running": 12, "waiting": 4}
    views = plain_fleet("prefill-0", "rld-0", "md-0", "md-1", md_0=busy, md_1={**figures, "running": 1})
    assert choose_plan(PlanRequest("r", 1000, 10), views, AUTO).md == "md-1"


def test_richer_figures_override_a_bare_occupancy_figure():
    views = plain_fleet(
        "prefill-0", "rld-0", "md-0", "md-1", md_0={"occupancy": 0.0, "running": 8}, md_1={"occupancy": 0.5}
    )
    assert choose_plan(PlanRequest("r", 100, 10), views, AUTO).md == "md-1"


def test_an_instance_without_room_for_the_request_loses():
    # md-0 is idle but its pool cannot hold 1000 prompt + 500 output tokens (94 blocks of 16)
    views = plain_fleet(
        "prefill-0",
        "rld-0",
        "md-0",
        "md-1",
        md_0={"total_blocks": 1000, "free_blocks": 50},
        md_1={"total_blocks": 1000, "free_blocks": 500, "running": 5},
    )
    assert choose_plan(PlanRequest("r", 1000, 500), views, AUTO).md == "md-1"


def test_forced_plan_is_honoured_pinned_or_auto():
    for cfg in (PINNED, AUTO):
        d = choose_plan(PlanRequest("r", 10, 5, pipeline="p-md"), fleet(), cfg)
        assert d.pipeline == "p-md" and d.handoff == "none" and d.reason == "forced" and not d.rld
        d = choose_plan(PlanRequest("r", 10, 5, pipeline="p-rld-md", handoff="catchup"), fleet(), cfg)
        assert (d.pipeline, d.handoff, d.handoff_reason, d.reason) == ("p-rld-md", "catchup", "forced", "forced")
        assert d.chunk_tokens == cfg.catchup_chunk
        d = choose_plan(PlanRequest("r", 10, 5, pipeline="p-rld"), fleet(), cfg)
        assert d.instance_ids == [d.prefill, d.rld] and not d.md and d.md_cached_tokens == 0 and d.handoff == "none"


def test_without_relay_the_default_falls_back_to_main_decode():
    views = [v for v in fleet() if v.role != "rld"]
    for cfg in (PINNED, AUTO):
        d = choose_plan(PlanRequest("r", 1500, 5), views, cfg)
        assert d.pipeline == "p-md" and d.reason == "no-relay-alive" and "p-rld-md" not in d.estimates.ttft_ms


def test_avoided_and_missing_instances():
    d = choose_plan(PlanRequest("r", 10, 5, avoid=frozenset({"md-1"})), fleet(), AUTO)
    assert d.md == "md-0"
    with pytest.raises(NoCapacity, match="md"):  # no relay to fall back on either
        choose_plan(PlanRequest("r", 10, 5, avoid=frozenset({"md-0", "md-1", "rld-0"})), fleet(), AUTO)
    with pytest.raises(NoCapacity, match="prefill"):
        choose_plan(PlanRequest("r", 10, 5), [v for v in fleet() if v.role != "prefill"], AUTO)


def test_without_a_main_decoder_datacenter_a_serves_alone():
    """The line to datacenter B is down: every md's heartbeat expired. The relay finishes
    requests (p-rld) rather than the cluster answering 503; a forced pipeline is still honoured."""
    alone = [v for v in fleet() if v.role != "md"]
    d = choose_plan(PlanRequest("r", 1500, 600), alone, AUTO)
    assert (d.pipeline, d.reason, bool(d.prefill and d.rld), d.md) == ("p-rld", "no-md-alive", True, "")
    d = choose_plan(PlanRequest("r", 10, 5, avoid=frozenset({"md-0", "md-1"})), fleet(), AUTO)
    assert d.pipeline == "p-rld" and d.reason == "no-md-alive"
    with pytest.raises(NoCapacity, match="md"):
        choose_plan(PlanRequest("r", 10, 5, pipeline="p-md"), alone, AUTO)
    full = [*alone, view("md-0", held=4, capacity=4)]  # alive but full: 429, not the relay
    with pytest.raises(Saturated):
        choose_plan(PlanRequest("r", 10, 5), full, AUTO)


def test_an_avoided_relay_counts_as_dead():
    d = choose_plan(PlanRequest("r", 1500, 600, avoid=frozenset({"rld-0"})), fleet(), AUTO)
    assert d.pipeline == "p-md" and d.reason == "no-relay-alive"


def test_an_avoided_instance_lends_no_prefix_hit_to_the_anomalous_filter():
    views = plain_fleet("prefill-0", "rld-0", "md-0", "md-1", md_1={"hit_tokens": 3000})
    req = PlanRequest("r", 3000, 100)
    assert choose_plan(req, views, AUTO).pipeline != "p-rld"  # md-1 holds it all: not uncached
    d = choose_plan(PlanRequest("r", 3000, 100, avoid=frozenset({"md-1"})), views, AUTO)
    assert d.pipeline == "p-rld" and d.estimates.uncached_tokens == 3000


def test_config_validation_names_the_bad_value():
    with pytest.raises(ValueError, match="p-rld"):
        PolicyConfig(default_pipeline="p-rld")
    with pytest.raises(ValueError, match="later"):
        PolicyConfig(default_handoff="later")
    with pytest.raises(ValueError, match="rld_slots"):
        PolicyConfig(rld_slots=0)
    with pytest.raises(ValueError, match="rld_pressure"):
        PolicyConfig(rld_pressure=1.5)


def test_service_call_shapes_still_work():
    """The scheduler builds these positionally today; the new fields must come after."""
    cfg = PolicyConfig("p-rld-md", "oneshot", 1.0)
    d = choose_plan(
        PlanRequest("r", 10, 5, None, None),
        [InstanceView("p", "prefill", "A", 0.1, 0), view("rld-0"), view("md-0")],
        cfg,
    )
    assert d.pipeline == "p-rld-md" and d.prefill == "p"
