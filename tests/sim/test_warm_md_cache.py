"""handoff.warm_md_cache in the simulator: a request the relay finishes before its handoff still
sends main-decode its prompt KV, which lands in MD's DRC only (on, the real default since commit
009d61a); off, that KV is cancelled on the line as before. Timings on the trivial chip
(tests/sim/factories.py): prefill 1 ms/token, 10 ms steps, 1,000 B/token, WAN 1,000 B/ms + 5 ms.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from sim.config import load_sim_config
from sim.run import simulate
from tests.sim.factories import make_config, make_request

RELAY = {"ttft_slo_ms": 1.0, "relay_finishes": False}  # p-md misses the SLO: p-rld-md, always sent


def config(warm: bool | None):
    handoff = {"chunk_tokens": 4, "final_tokens": 2}
    if warm is not None:
        handoff["warm_md_cache"] = warm
    return make_config(scheduler=RELAY, handoff=handoff)


def md_of(cluster):
    return next(d for d in cluster.decoders if d.role == "md")


def session(second_arrival_ms: float = 300.0):
    """Two turns: t1 (100 tokens: 6 full blocks, 3 answer tokens), then t2 = t1's prompt + 2 blocks."""
    first = make_request("t1", prompt=100, output=3)
    second = dataclasses.replace(
        make_request("t2", prompt=128, output=3, arrival_ms=second_arrival_ms),
        blocks=first.blocks + (("t2", 0), ("t2", 1)),
        depends_on="t1",
    )
    return [first, second]


def test_the_knob_is_on_by_default_as_in_the_real_config():
    assert make_config().warm_md_cache and config(None).warm_md_cache and not config(False).warm_md_cache


def test_relay_finishing_first_still_sends_main_decode_its_kv_into_the_drc():
    # prefill's token at 100, RLD's (KV in-DC at 100.1) at 110.1, 120.1: done before MD's KV (left at 100,
    # 100,000 B at 1,000 B/ms + 5 ms: lands at 205). It is not cancelled: all of it crosses and
    # counts, and on landing its 6 prompt blocks enter MD's DRC; MD runs nothing.
    [run], cluster = simulate(config(True), "pdd", [make_request(output=3)])
    assert run.pipeline == "p-rld-md" and run.tokens_by_role == {"prefill": 1, "rld": 2, "md": 0}
    assert run.token_times == pytest.approx([100.0, 110.1, 120.1])
    assert run.wan_bytes == 100_000 and cluster.wan.bytes_sent == 100_000
    assert run.marks["md_cache_warmed"] == pytest.approx(205.0) and "kv_wan_cancelled" not in run.marks
    md = md_of(cluster)
    assert len(md.cache) == 6 and md.cache.match(run.req.blocks) == 6
    assert not md.running and not md.waiting and md.used_tokens == 0 and md.pending == 0
    assert not cluster.pipeline.backlog  # the line's ledger let go of it when it landed, not at the finish


def test_off_the_kv_is_cancelled_as_before():
    # the same request: at 120.1 20,100 B have crossed; the rest never does; MD's DRC stays empty
    [run], cluster = simulate(config(False), "pdd", [make_request(output=3)])
    assert run.wan_bytes == 20_100 and cluster.wan.bytes_sent == 20_100
    assert run.marks["kv_wan_cancelled"] == pytest.approx(120.1) and "md_cache_warmed" not in run.marks
    assert len(md_of(cluster).cache) == 0 and md_of(cluster).pending == 0
    assert not cluster.pipeline.backlog


def test_the_sessions_next_turn_hits_main_decodes_cache():
    # t2 is sent at 300 ms, after t1's KV landed in MD (205): MD holds t1's 6 blocks = 96 tokens,
    # so only t2's last 32 tokens cross (32,000 B); both KVs cross in full: 132,000 B.
    runs, cluster = simulate(config(True), "pdd", session())
    assert [r.pipeline for r in runs] == ["p-rld-md", "p-rld-md"]
    assert runs[1].sent_ms == pytest.approx(300.0)
    assert runs[1].hit["md"] == 96 and runs[1].wan_bytes == 32_000
    assert cluster.wan.bytes_sent == 100_000 + 32_000
    # off: MD never got t1, so t2 misses MD's cache whole (its 128,000 B are cancelled in turn)
    cold, cluster = simulate(config(False), "pdd", session())
    assert cold[1].hit["md"] == 0
    assert cold[0].wan_bytes == 20_100 and cold[1].wan_bytes < 128_000


def test_a_next_turn_sent_before_the_kv_landed_does_not_see_it_yet():
    # t2 follows t1's end at once (120.1 ms): MD's copy of t1 is still on the line, the plan sees no hit
    runs, _ = simulate(config(True), "pdd", session(second_arrival_ms=0.0))
    assert runs[1].sent_ms == pytest.approx(120.1) and runs[1].hit["md"] == 0


def test_a_copy_that_landed_before_the_relay_finished_keeps_its_prompt_in_the_drc():
    # one-shot, 12 tokens: MD has its KV at 205 and admits its shadow; KVReady reaches RLD at 210,
    # mid-step; that step (ending 210.1) emits the 12th and last token: the relay finished first.
    # On: MD's shadow leaves and its prompt blocks stay cached; off: it is dropped, nothing kept.
    # Both ways all 100,000 B had crossed.
    for warm, blocks in ((True, 6), (False, 0)):
        [run], cluster = simulate(config(warm), "pdd-oneshot", [make_request(output=12)])
        assert run.tokens_by_role == {"prefill": 1, "rld": 11, "md": 0} and run.wan_bytes == 100_000
        assert run.token_times[-1] == pytest.approx(210.1)
        md = md_of(cluster)
        assert len(md.cache) == blocks and not md.running and md.used_tokens == 0
        assert ("md_cache_warmed" in run.marks) == warm


def test_a_config_file_reads_the_knob_and_rejects_unknown_handoff_keys(tmp_path: Path):
    src = Path("configs/sim/single-host-cpu.yaml")
    raw = yaml.safe_load(src.read_text())
    raw["profiles"] = [str((src.parent / p).resolve()) for p in raw["profiles"]]
    assert load_sim_config(src).warm_md_cache  # the validation config runs the real default
    raw["handoff"] = {"chunk_tokens": 64, "final_tokens": 8, "warm_md_cache": False}
    (tmp_path / "off.yaml").write_text(yaml.safe_dump(raw))
    assert not load_sim_config(tmp_path / "off.yaml").warm_md_cache
    raw["handoff"] = {"chunk_tokens": 64, "final_tokens": 8, "warm_cache": True}
    (tmp_path / "typo.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="warm_cache"):
        load_sim_config(tmp_path / "typo.yaml")
    raw["handoff"] = {"chunk_tokens": 64, "final_tokens": 8, "warm_md_cache": "yes"}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="warm_md_cache"):
        load_sim_config(tmp_path / "bad.yaml")
