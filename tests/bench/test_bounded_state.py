"""benchmarks/bounded_state.py's verdict: a process is judged on its growth after warm-up net of
its decode mirror (a capped cache), and a per-request map left when idle fails the run. The
run itself (thousands of requests, ~10 minutes) is a benchmark, not a test."""

from __future__ import annotations

import argparse

from benchmarks.bounded_state import _report
from shared.messages import EngineFigures, InstanceFigures, InstanceState

ARGS = argparse.Namespace(requests=10, aborts=100, tolerance=0.05)


def _state(iid: str, mirror_mib: float = 0, **maps: int) -> InstanceState:
    state = {"requests": 0, "parked": 0, "receiving": 0, "bus_handlers": 0, "remembered_aborts": 10_000, **maps}
    figures = InstanceFigures(EngineFigures(mirror_bytes=int(mirror_mib * 2**20)))
    return InstanceState(iid, "md", state=state, figures=figures)


def _run(end_mib: dict[str, float], end_mirror: float = 100, **maps: int) -> int:
    first = {"md-0": 1000.0, "scheduler": 40.0}
    mid = {k: (first[k] + end_mib[k]) / 2 for k in first}
    points = [
        ("after warm-up", first, {"md-0": _state("md-0", 100)}),
        ("at half", mid, {"md-0": _state("md-0", 100)}),
        ("at the end", end_mib, {"md-0": _state("md-0", end_mirror, **maps)}),
    ]
    return _report(ARGS, {"done": 10}, 1.0, points)


def test_flat_processes_pass(capsys):
    assert _run({"md-0": 1030.0, "scheduler": 41.0}) == 0
    assert "bounded: yes" in capsys.readouterr().out


def test_a_process_growing_past_the_tolerance_fails(capsys):
    assert _run({"md-0": 1000.0, "scheduler": 43.0}) == 1  # +7.5%
    assert "grew: ['scheduler']" in capsys.readouterr().out


def test_growth_of_the_mirror_is_not_counted_but_the_rest_is():
    assert _run({"md-0": 1150.0, "scheduler": 40.0}, end_mirror=220) == 0  # +150 MiB, +120 of it the mirror
    assert _run({"md-0": 1150.0, "scheduler": 40.0}, end_mirror=100) == 1


def test_a_per_request_map_left_when_idle_fails(capsys):
    assert _run({"md-0": 1000.0, "scheduler": 40.0}, requests=1) == 1
    assert "per-request state left: {'md-0': {'requests': 1}}" in capsys.readouterr().out
