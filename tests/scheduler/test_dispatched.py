"""The scheduler's own count of decode tasks its instances' heartbeats have not reported yet."""

from __future__ import annotations

from services.scheduler.inputs import Dispatched


def test_dispatches_count_until_a_later_heartbeat_reports_them():
    d = Dispatched()
    for at in (10.0, 10.2, 10.4):
        d.add("rld-0", at)
    assert d.unseen("rld-0", heartbeat_at=9.9) == 3  # the beat predates all three: none reported
    assert d.unseen("rld-0", heartbeat_at=10.3) == 1  # the beat after two of them counts those two
    assert d.unseen("rld-0", heartbeat_at=10.5) == 0
    assert d.unseen("md-0", heartbeat_at=0.0) == 0


def test_reported_dispatches_are_forgotten():
    d = Dispatched()
    d.add("rld-0", 1.0)
    assert d.unseen("rld-0", heartbeat_at=2.0) == 0
    assert d.unseen("rld-0", heartbeat_at=0.0) == 0  # an older beat read later does not revive it


def test_the_policy_sees_what_the_heartbeat_measured():
    from services.scheduler.inputs import instance_view as _view
    from shared.messages import InstanceInfo

    info = InstanceInfo(
        "prefill-0", "prefill", "A", queued_tokens=900, step_ms=0.0, prefill_tok_s=640.0, held=3, capacity=96, pending=1
    )
    v = _view(info, hit_tokens=32, unseen=2)
    assert (v.queued_tokens, v.prefill_tok_s, v.step_ms) == (900, 640.0, None)  # 0 = not measured: the prior
    assert (v.held, v.pending, v.capacity, v.hit_tokens) == (5, 3, 96, 32)
