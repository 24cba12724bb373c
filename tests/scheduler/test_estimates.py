"""Estimate arithmetic and the live WAN bandwidth estimator."""

from __future__ import annotations

import pytest

from services.scheduler.estimates import (
    BandwidthEstimator,
    InstanceView,
    Link,
    decode_queue_ms,
    estimate_ttft,
    extend_ms,
    prefill_ms,
    push_ms,
    transfer_ms,
)
from services.scheduler.policy import PolicyConfig
from tests.scheduler.factories import view

CFG = PolicyConfig()  # 46,080 B/token, 300 tok/s, 75 ms step, 10 Gbps in-DC, 10 ms WAN delay
WAN = Link(1000.0, 10.0)


def test_transfer_is_bytes_over_bandwidth_plus_delay():
    assert transfer_ms(1000, 1000, Link(8.0, 10.0)) == pytest.approx(1010.0)  # 1 MB at 8 Mbps = 1 s
    assert transfer_ms(0, 46_080, WAN) == pytest.approx(10.0)  # nothing lacking: the delay still counts
    assert transfer_ms(100, 46_080, WAN) == pytest.approx(4_608_000 / 125_000 + 10)  # 100 tokens, 1 Gbps


def test_prefill_counts_what_is_queued_ahead():
    assert prefill_ms(300, 0, 300.0) == pytest.approx(1000.0)
    assert prefill_ms(300, 300, 300.0) == pytest.approx(2000.0)
    assert prefill_ms(-5, 0, 300.0) == 0.0


def test_decoder_queue_is_one_step_per_waiting_request():
    assert decode_queue_ms(0, 75.0) == 0.0
    assert decode_queue_ms(3, 50.0) == pytest.approx(150.0)


def test_main_decode_ttft_pays_the_wan_for_what_md_lacks():
    prefill = view("prefill-0", hit_tokens=900)
    md = view("md-0", hit_tokens=600, waiting=2)
    e = estimate_ttft("p-md", 1000, prefill, md, CFG, WAN)
    assert e.prefill_ms == pytest.approx(100 / 300 * 1000)
    assert e.transfer_ms == pytest.approx(400 * 46_080 / 125_000 + 10)
    assert (e.queue_ms, e.step_ms) == (pytest.approx(150.0), 75.0)
    assert e.total_ms == pytest.approx(e.prefill_ms + e.transfer_ms + 150 + 75)


def test_relay_ttft_pays_the_in_dc_link_only():
    e = estimate_ttft("p-rld-md", 1000, view("prefill-0"), view("rld-0"), CFG, WAN)
    assert e.transfer_ms == pytest.approx(1000 * 46_080 / (10_000 * 125))  # no WAN delay, 10 Gbps
    assert estimate_ttft("p-rld", 1000, view("prefill-0"), view("rld-0"), CFG, WAN) == e


def test_a_main_decoder_in_the_same_datacenter_uses_the_local_link():
    local_md = InstanceView("md-0", "md", "A")  # e.g. the pd-local baseline
    e = estimate_ttft("p-md", 1000, view("prefill-0"), local_md, CFG, Link(1.0, 500.0))
    assert e.transfer_ms == pytest.approx(1000 * 46_080 / (10_000 * 125))


def test_measured_figures_win_over_priors():
    prefill = view("prefill-0", prefill_tok_s=1000.0, queued_tokens=500)
    e = estimate_ttft("p-md", 1000, prefill, view("md-0", step_ms=20.0, waiting=1), CFG, WAN)
    assert e.prefill_ms == pytest.approx(1500.0) and e.step_ms == 20.0 and e.queue_ms == 20.0


def test_a_main_decoder_computing_what_it_lacks_pays_its_extend_and_the_delay_alone():
    """The suffix path: the transfer's header crosses (the delay), no KV and no backlog; MD extends
    the 400 tokens at its measured 2,000 tok/s."""
    md = view("md-0", hit_tokens=600, prefill_tok_s=2000.0)
    e = estimate_ttft("p-md", 1000, view("prefill-0"), md, CFG, WAN, wan_backlog_bytes=1e9, computes=True)
    assert (e.transfer_ms, e.extend_ms) == (pytest.approx(10.0), pytest.approx(200.0))
    assert e.total_ms == pytest.approx(e.prefill_ms + 10 + 200 + 75)
    assert estimate_ttft("p-md", 1000, view("prefill-0"), md, CFG, WAN).extend_ms == 0.0


def test_push_and_extend_of_a_suffix():
    assert push_ms(100, 46_080, WAN) == pytest.approx(4_608_000 / 125_000)  # no delay: paid either way
    assert push_ms(100, 46_080, WAN, wan_backlog_bytes=1e6) == pytest.approx(5_608_000 / 125_000)
    assert push_ms(0, 46_080, WAN, wan_backlog_bytes=1e6) == 0.0  # nothing to push waits for nothing
    assert extend_ms(100, view("md-0"), CFG) == pytest.approx(100 / 300 * 1000)  # the prior
    assert extend_ms(100, view("md-0", prefill_tok_s=2000.0), CFG) == pytest.approx(50.0)


def test_the_first_decoder_must_match_the_pipeline():
    with pytest.raises(ValueError, match="md"):
        estimate_ttft("p-md", 10, view("prefill-0"), view("rld-0"), CFG, WAN)


def _sample(mbps: float, nbytes: int = 10_000_000, delay_ms: float = 10.0) -> tuple[int, float]:
    return nbytes, (nbytes / (mbps * 125.0) + delay_ms) / 1000.0


def test_estimator_uses_the_prior_until_it_has_samples():
    est = BandwidthEstimator(prior_mbps=750.0, delay_ms=10.0)
    assert est.mbps(now=0.0) == 750.0 and len(est) == 0
    assert est.add(*_sample(400.0), at=1.0)
    assert est.mbps(now=1.0) == pytest.approx(400.0)


def test_estimator_converges_and_shrugs_off_a_stalled_transfer():
    est = BandwidthEstimator(prior_mbps=1000.0, delay_ms=10.0)
    for t, mbps in enumerate([380.0, 420.0, 400.0, 390.0, 410.0]):
        est.add(*_sample(mbps), at=float(t))
    est.add(*_sample(5.0), at=5.0)  # one transfer stalled for seconds
    assert est.mbps(now=5.0) == pytest.approx(400.0, rel=0.03)


def test_estimator_follows_a_change_in_the_link():
    est = BandwidthEstimator(prior_mbps=1000.0, delay_ms=10.0, window=8)
    for t in range(8):
        est.add(*_sample(800.0), at=float(t))
    for t in range(8, 13):  # five of the last eight samples at the new rate
        est.add(*_sample(200.0), at=float(t))
    assert est.mbps(now=13.0) == pytest.approx(200.0)


def test_estimator_prefers_fresh_samples_and_keeps_stale_ones_over_the_prior():
    est = BandwidthEstimator(prior_mbps=1000.0, delay_ms=10.0, max_age_s=60.0)
    for t in range(5):
        est.add(*_sample(800.0), at=float(t))
    est.add(*_sample(200.0), at=100.0)
    assert est.mbps(now=100.0) == pytest.approx(200.0)  # the 800s are over a minute old
    assert est.mbps(now=1000.0) == pytest.approx(800.0)  # all stale: the median of what it saw


def test_estimator_ignores_small_and_latency_dominated_transfers():
    est = BandwidthEstimator(prior_mbps=1000.0, delay_ms=10.0, min_bytes=1 << 20)
    assert not est.add(100_000, 0.0108, at=0.0)  # 100 KB: under min_bytes
    assert not est.add(2_000_000, 0.019, at=0.0)  # 9 ms moving vs 10 ms delay: latency-dominated
    assert not est.add(2_000_000, 0.005, at=0.0)  # faster than the delay allows: clock noise
    assert len(est) == 0 and est.mbps(now=0.0) == 1000.0


def test_estimator_rejects_a_bad_prior():
    with pytest.raises(ValueError, match="prior_mbps"):
        BandwidthEstimator(prior_mbps=0.0)
