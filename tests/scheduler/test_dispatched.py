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


def test_counting_without_filtering_agrees_with_the_filter():
    """The count skips its filter while every dispatch held is newer than the heartbeat: the same
    counts as filtering each time, clock steps back included."""
    d = Dispatched()
    times = [5.0, 5.1, 4.0, 5.3, 6.0]  # 4.0: the wall clock stepped back
    for at in times:
        d.add("rld-0", at)
    for beat_at in (3.0, 3.0, 4.5, 4.5, 5.2, 7.0):
        expected = sum(1 for t in times if t > beat_at)
        assert d.unseen("rld-0", heartbeat_at=beat_at) == expected, beat_at
        times = [t for t in times if t > beat_at]
    d.add("rld-0", 8.0)
    assert d.unseen("rld-0", heartbeat_at=7.0) == 1  # a dispatch after everything was reported


def test_views_are_the_instance_views_and_follow_each_heartbeat():
    from services.scheduler.inputs import Views, instance_view
    from shared.messages import InstanceInfo

    infos = [InstanceInfo(f"md-{k}", "md", "B", running=k, updated_at=1.0, capacity=96) for k in range(4)]
    d, views = Dispatched(), Views()
    d.add("md-2", 2.0)
    hits = {"md-1": 64}
    expected = [instance_view(i, hits.get(i.id, 0), 1 if i.id == "md-2" else 0) for i in infos]
    assert views.of(infos, hits, d) == expected
    assert views.of(infos, hits, d) == expected  # made once, reused
    d.add("md-0", 2.5)  # a task sent since: counted at once
    assert views.of(infos, {}, d)[0].pending == 1 and views.of(infos, {}, d)[1].hit_tokens == 0
    beat = InstanceInfo("md-3", "md", "B", running=9, updated_at=3.0, capacity=96)  # a new heartbeat: a new row
    assert views.of([*infos[:3], beat], {}, d)[3].running == 9
    assert [v.pending for v in views.of([*infos[:3], beat], {}, d)] == [1, 0, 1, 0]
