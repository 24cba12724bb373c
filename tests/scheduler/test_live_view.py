"""The scheduler's in-memory view of the alive instances (services/scheduler/live_view.py):
the registrar's liveness rule on the heartbeats it hears, without reading Redis."""

from __future__ import annotations

from services.scheduler.live_view import LiveView
from services.scheduler.registrar import Liveness, Roster
from shared.config import load_config
from shared.messages import Heartbeat, InstanceInfo, Leave

RULE = Liveness(ttl_s=3.0, control_dc="A", line_delay_s=0.05, heartbeat_s=1.0)


def beat(iid: str, dc: str = "A", missed: int = 0, running: int = 0) -> Heartbeat:
    info = InstanceInfo(iid, "md" if dc == "B" else "rld", dc, kv_host="127.0.0.1", running=running)
    return Heartbeat(info, missed_replies=missed)


def test_the_view_answers_only_after_listening_for_a_whole_ttl():
    view = LiveView(RULE, now=100.0)
    view.heard(beat("rld-0"), now=100.5)
    assert view.alive(now=103.0) is None, "an instance heard of only in Redis so far may be missing"
    assert [i.id for i in view.alive(now=104.1)] == []  # rld-0 expired at 103.5
    view.heard(beat("rld-0", running=3), now=104.2)
    assert [(i.id, i.running) for i in view.alive(now=104.3)] == [("rld-0", 3)]


def test_the_registrars_rule_by_the_hearers_clock():
    view = LiveView(RULE, now=0.0)
    view.heard(beat("rld-0"), now=10.0)
    view.heard(beat("md-0", dc="B"), now=10.0)  # another site's: a heartbeat and two line delays longer
    view.heard(beat("md-1", dc="B", missed=2), now=10.0)  # hears no replies: not refreshed
    assert [i.id for i in view.alive(now=12.9)] == ["md-0", "rld-0"]
    assert [i.id for i in view.alive(now=13.5)] == ["md-0"]
    assert view.alive(now=14.2) == []
    view.heard(beat("md-0", dc="B"), now=20.0)
    (md,) = view.alive(now=20.0)
    assert md.updated_at == 20.0 - 0.05, "sampled a line delay before it was heard"
    view.left(Leave("md-0"))
    assert view.alive(now=20.1) == []


def test_a_view_that_lost_its_connection_answers_again_only_a_whole_ttl_after_it_is_back():
    view = LiveView(RULE, now=0.0)
    view.heard(beat("rld-0"), now=10.0)
    assert [i.id for i in view.alive(now=10.0)] == ["rld-0"]
    view.link(False, now=11.0)  # the heartbeats sent now never reach it
    assert view.alive(now=11.5) is None, "deaf: ask Redis"
    view.link(True, now=20.0)
    view.heard(beat("rld-0"), now=20.5)
    view.heard(beat("rld-0"), now=23.5)
    assert view.alive(now=23.9) is None, "an instance heard only before the loss may be missing"
    assert [i.id for i in view.alive(now=24.1)] == ["rld-0"]


def test_the_view_takes_no_report_the_registrar_would_refuse():
    roster = Roster.of(load_config())  # the shipped fleet: prefill-0, rld-0, md-0
    view = LiveView(RULE, now=0.0, roster=roster)
    view.heard(beat("rld-0"), "md-0", now=10.0)  # md-0 speaking for rld-0
    view.heard(beat("rld-9"), "rld-9", now=10.0)  # not in the config
    assert view.alive(now=10.0) == []
    view.heard(beat("rld-0"), "rld-0", now=10.0)
    view.left(Leave("rld-0"), "md-0")
    assert [i.id for i in view.alive(now=10.0)] == ["rld-0"]
