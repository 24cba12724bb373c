"""`pdd bench grammar` runs on the real model and prints its figures; it fails (exit 1) if an
unconstrained row's tokens changed beside constrained ones."""

from __future__ import annotations

import argparse

import pytest
import torch

from benchmarks import grammar_cost

pytestmark = pytest.mark.model


def test_the_grammar_bench_runs_and_reports(capsys):
    threads = torch.get_num_threads()
    try:
        args = argparse.Namespace(batch=2, tokens=6, reps=1, threads=1)
        assert grammar_cost.main(args) == 0
    finally:
        torch.set_num_threads(threads)  # the bench sets its own
    out = capsys.readouterr().out
    assert "mixed / plain, median of the reps:" in out and "grammar mask per constrained token:" in out
    assert "unconstrained rows' tokens identical in both runs: True" in out
