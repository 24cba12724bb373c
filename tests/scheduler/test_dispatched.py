"""The scheduler's own count of decode tasks its instances' heartbeats have not reported yet."""

from __future__ import annotations

from services.scheduler.service import Dispatched


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
