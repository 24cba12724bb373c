"""The engine worker's measured pace, which heartbeats carry to the scheduler's estimates."""

from __future__ import annotations

import pytest

from shared.runtime.worker import StepRates


def test_nothing_measured_reads_zero_so_the_priors_apply():
    r = StepRates()
    assert (r.step_ms, r.prefill_tok_s) == (0.0, 0.0)


def test_moving_averages_of_step_time_and_prefill_throughput():
    r = StepRates(alpha=0.5, min_prefill_tokens=32)
    r.add(100.0, 512)  # a prefill chunk: 5,120 tok/s
    r.add(60.0, 4)  # a decode step of 4 sequences: too small to say anything about prefill
    assert r.step_ms == pytest.approx(80.0)
    assert r.prefill_tok_s == pytest.approx(5120.0)
    r.add(200.0, 512)  # 2,560 tok/s
    assert r.prefill_tok_s == pytest.approx(3840.0)
