"""One table of what each mode means (benchmarks/modes.py): the bench's cluster configs and the
simulator's fleets both follow it."""

from __future__ import annotations

import pytest

from benchmarks.modes import MODE_TABLE, MODES, mode_config, parse_modes
from shared.config import config_from_dict
from sim.config import policy_config
from tests.sim.factories import make_config


@pytest.mark.parametrize("name", MODES)
def test_the_bench_cluster_follows_the_table(name):
    m, cfg = MODE_TABLE[name], mode_config(name)
    by_role = {i["role"]: i for i in cfg["instances"]}
    assert ("rld" in by_role) == m.relay
    assert by_role["md"]["dc"] == m.md_dc and by_role["md"]["prefix_cache"] == m.drc
    assert (cfg["scheduler"]["default_pipeline"], cfg["scheduler"]["default_handoff"]) == (m.pipeline, m.handoff)
    assert (config_from_dict(cfg).scheduler.md_suffix_max_tokens > 0) == m.md_suffix


@pytest.mark.parametrize("name", MODES)
def test_the_simulated_fleet_follows_the_table(name):
    m, cfg = MODE_TABLE[name], make_config()
    groups = {g.role: g for g in cfg.groups(name)}
    assert ("rld" in groups) == m.relay
    assert groups["md"].dc == m.md_dc and groups["md"].prefix_cache == m.drc
    p = policy_config(cfg, name)
    assert (p.default_pipeline, p.default_handoff) == (m.pipeline, m.handoff)
    assert p.md_suffix_max_tokens == 0  # the simulated decoder does not model computing a suffix


def test_the_table_names_the_ten_modes_and_the_parser_refuses_others():
    pdds = ("pdd", "pdd-oneshot", "pdd-catchup", "pdd-push", "pdd-stream", "pdd-own-cores", "pdd-no-layers")
    assert MODES == ("pd-local", "pd-wan", "pd-wan-drc", *pdds)
    wan = ["pd-wan", "pd-wan-drc", *pdds]
    assert [n for n in MODES if MODE_TABLE[n].wan] == wan
    assert [n for n in MODES if not MODE_TABLE[n].md_suffix] == ["pd-wan", "pd-wan-drc", "pdd-push"]
    assert [n for n in MODES if MODE_TABLE[n].stream_kv] == ["pdd-stream"]
    assert [mode_config(n)["stream_kv"] for n in ("pdd", "pdd-stream")] == [False, True]
    assert [n for n in MODES if not mode_config(n)["lend_idle_cores"]] == ["pdd-own-cores"]
    layers = {n: config_from_dict(mode_config(n)).stream_layers_max_tokens for n in MODES}
    assert [n for n, cap in layers.items() if not cap] == ["pd-wan", "pd-wan-drc", "pdd-no-layers"]
    assert parse_modes(" pd-wan, pdd ") == ["pd-wan", "pdd"]
    with pytest.raises(ValueError, match="pdd-fast"):
        parse_modes("pdd,pdd-fast")
