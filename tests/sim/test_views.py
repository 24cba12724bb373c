"""What the policy sees (sim/views.py): heartbeats up to `heartbeat_s` old plus unseen dispatches,
and only the figures the real heartbeat carries; what the client sees of an EOS (sim/records.py); what
the WAN estimator is fed."""

from __future__ import annotations

import dataclasses

import pytest

from sim.cluster import SimCluster
from sim.records import record
from sim.run import simulate
from sim.views import ViewSpec
from tests.sim.factories import make_config, make_request


def _cluster(**views) -> SimCluster:
    cluster = SimCluster(make_config(views=views), "pd-wan", 16, horizon_ms=10_000.0)
    cluster.loop.at(9_000.0, lambda: None)  # something still to happen, so heartbeats go on
    cluster.registry.start()
    return cluster


def _view(cluster: SimCluster, iid: str):
    return next(v for v in cluster.registry.views({}) if v.id == iid)


def test_the_policy_sees_the_last_heartbeat_plus_what_it_dispatched_since():
    cluster = _cluster(heartbeat_s=1.0)
    md = cluster.decoders[0]
    cluster.loop.run(until=1_000.0)  # every instance has heartbeaten once (phases in [0, 1 s))
    md.pending = 2  # changed after its heartbeat: not visible yet
    assert _view(cluster, md.id).pending == 0
    cluster.registry.dispatch([md.id])  # ... but the scheduler counts its own dispatch
    assert (_view(cluster, md.id).pending, _view(cluster, md.id).held) == (1, 1)
    cluster.loop.run(until=2_000.0)  # the next heartbeat reports both; the dispatch is not counted twice
    assert (_view(cluster, md.id).pending, _view(cluster, md.id).held) == (2, 2)


def test_live_views_see_every_change_at_once():
    cluster = _cluster()
    cluster.decoders[0].pending = 2
    assert _view(cluster, cluster.decoders[0].id).pending == 2


def test_heartbeats_carry_no_measured_figures_unless_asked():
    cluster = _cluster(heartbeat_s=1.0, measured=False)
    cluster.decoders[0].last_step_ms = 42.0
    cluster.prefills[0].queued_tokens = 500
    cluster.loop.run(until=1_000.0)
    md, prefill = _view(cluster, cluster.decoders[0].id), _view(cluster, cluster.prefills[0].id)
    assert (md.step_ms, prefill.prefill_tok_s, prefill.queued_tokens) == (None, None, 0)
    live = _cluster(measured=True)
    live.decoders[0].last_step_ms = 42.0
    assert _view(live, live.decoders[0].id).step_ms == 42.0


def test_heartbeats_stop_when_nothing_else_can_happen():
    cfg = make_config(views={"heartbeat_s": 0.5})
    [run], _ = simulate(cfg, "pd-wan", [make_request(output=3)])  # returns: the heartbeat chain ended
    assert run.token_times == pytest.approx([205.0, 215.0, 225.0])


def test_a_bad_views_value_is_named():
    with pytest.raises(ValueError, match="views.heartbeat_s"):
        ViewSpec(heartbeat_s=-1)
    with pytest.raises(ValueError, match="unknown key"):
        ViewSpec.from_dict({"heartbeat": 1})


def test_an_answer_ending_on_eos_shows_the_client_one_chunk_fewer():
    # p-md as in test_timings: tokens at 205, 215, 225; the last is EOS, which has no text
    req = dataclasses.replace(make_request(output=3), eos=True)
    [run], _ = simulate(make_config(), "pd-wan", [req])
    rec = record(run, "pd-wan")
    assert rec["token_times_s"] == pytest.approx([0.205, 0.215])
    assert rec["output_tokens"] == 3  # usage still counts it: TPOT = (215 - 205) / 2
    [plain], _ = simulate(make_config(), "pd-wan", [make_request(output=3)])
    assert record(plain, "pd-wan")["token_times_s"] == pytest.approx([0.205, 0.215, 0.225])


def test_the_wan_estimator_is_fed_what_the_receiver_times_first_byte_to_last():
    # 2,000 tokens x 1,000 B = 2 MB at 8 Mbps: 2,000 ms on the wire + 5 ms delay. The receiver's
    # clock starts at the first byte (2,000 ms); the estimator takes the 5 ms delay off again,
    # so it reads 8 x 2000 / 1995 Mbps, a little over the line's rate, as the real one does.
    [run], cluster = simulate(make_config(), "pd-wan", [make_request(prompt=2000, output=1)])
    assert run.marks["kv_wan"] == pytest.approx(2000.0 + 2005.0)
    assert cluster.estimator.mbps(10.0) == pytest.approx(8.0 * 2000 / 1995)
