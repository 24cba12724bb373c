"""The scheduling policy on constructed inputs: no servers."""

from __future__ import annotations

import pytest

from services.scheduler.policy import InstanceView, NoCapacity, PlanRequest, PolicyConfig, choose_plan

CFG = PolicyConfig()


def fleet(**hits) -> list[InstanceView]:
    loads = {"prefill-0": 0.2, "prefill-1": 0.1, "rld-0": 0.0, "md-0": 0.3, "md-1": 0.1}
    roles = {"prefill-0": "prefill", "prefill-1": "prefill", "rld-0": "rld", "md-0": "md", "md-1": "md"}
    return [InstanceView(i, roles[i], "B" if roles[i] == "md" else "A", loads[i], hits.get(i.replace("-", "_"), 0))
            for i in loads]  # fmt: skip


def test_default_is_relay_then_main_on_the_least_loaded_instances():
    d = choose_plan(PlanRequest("r", 100, 10), fleet(), CFG)
    assert d.pipeline == "p-rld-md" and d.handoff == "oneshot" and d.reason == "default"
    assert d.instances == {"prefill": "prefill-1", "rld": "rld-0", "md": "md-1"}
    assert d.starts == {"rld": 0, "md": 0}


def test_prefix_hit_outweighs_a_small_load_difference():
    d = choose_plan(PlanRequest("r", 1000, 10), fleet(md_0=960, prefill_0=960), CFG)
    assert d.instances["md"] == "md-0" and d.instances["prefill"] == "prefill-0"
    assert d.md_cached_tokens == 960 and d.starts["md"] == 960


def test_a_much_busier_warm_instance_loses():
    views = [v if v.id != "md-0" else InstanceView("md-0", "md", "B", 3.0, 960) for v in fleet()]
    assert choose_plan(PlanRequest("r", 1000, 10), views, CFG).instances["md"] == "md-1"


def test_forced_plan_is_honoured():
    d = choose_plan(PlanRequest("r", 10, 5, pipeline="p-md"), fleet(), CFG)
    assert d.pipeline == "p-md" and d.handoff == "none" and d.reason == "forced" and "rld" not in d.instances
    d = choose_plan(PlanRequest("r", 10, 5, pipeline="p-rld-md", handoff="catchup"), fleet(), CFG)
    assert d.handoff == "catchup"
    d = choose_plan(PlanRequest("r", 10, 5, pipeline="p-rld"), fleet(), CFG)
    assert set(d.instances) == {"prefill", "rld"} and d.md_cached_tokens == 0


def test_without_relay_the_default_falls_back_to_main_decode():
    views = [v for v in fleet() if v.role != "rld"]
    d = choose_plan(PlanRequest("r", 10, 5), views, CFG)
    assert d.pipeline == "p-md" and d.reason == "no-relay-alive"


def test_avoided_and_missing_instances():
    d = choose_plan(PlanRequest("r", 10, 5, avoid=frozenset({"md-1"})), fleet(), CFG)
    assert d.instances["md"] == "md-0"
    with pytest.raises(NoCapacity, match="md"):
        choose_plan(PlanRequest("r", 10, 5, avoid=frozenset({"md-0", "md-1"})), fleet(), CFG)


def test_policy_module_imports_no_io_library():
    import services.scheduler.policy as policy

    source = open(policy.__file__).read()
    for lib in ("nats", "redis", "torch", "asyncio", "httpx"):
        assert f"import {lib}" not in source
