"""The pure shaping arithmetic, on a fake clock: rate cap, swings, delay and jitter."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from services.wanlink.shaper import (
    MBPS,
    BandwidthProfile,
    DelayLine,
    RandomWalk,
    TokenBucket,
    check_config,
    control_error,
    one_way_delay,
    schedule_mbps,
)
from shared.config import WanConfig
from shared.messages import WanControl

CHUNK = 64 * 1024


def drain_through(bucket: TokenBucket, nbytes: int, rate: float, now: float, oversleep: float = 0.0) -> float:
    """Push `nbytes` through in chunks, sleeping exactly as told (plus `oversleep`); returns the end time."""
    rng = random.Random(1)
    while nbytes > 0:
        n = min(CHUNK, nbytes)
        now += bucket.reserve(n, rate, now) + rng.uniform(0, oversleep)
        nbytes -= n
    return now


@pytest.mark.parametrize("oversleep", [0.0, 0.002])
def test_bucket_holds_the_rate(oversleep):
    rate = 40 * MBPS  # 5 MB/s
    bucket = TokenBucket(CHUNK, 0.0)
    end = drain_through(bucket, 20_000_000, rate, 0.0, oversleep)
    # 20 MB at 5 MB/s = 4 s, less the one chunk of burst credit; oversleeping is paid back from the credit
    assert end == pytest.approx((20_000_000 - CHUNK) / rate, rel=0.03)


def test_bucket_idle_credit_is_capped_at_the_burst():
    bucket = TokenBucket(CHUNK, 0.0)
    bucket.reserve(0, 1e6, 0.0)
    assert bucket.reserve(CHUNK, 1e6, 100.0) == 0.0  # a long idle gives one chunk of credit, no more
    assert bucket.reserve(CHUNK, 1e6, 100.0) == pytest.approx(CHUNK / 1e6)


def test_bucket_credit_scales_with_the_rate():
    bucket = TokenBucket(1000, 0.0, burst_s=0.01)
    bucket.reserve(0, 1e6, 0.0)
    assert bucket.reserve(10_000, 1e6, 5.0) == 0.0  # 10 ms at 1 MB/s of credit after an idle spell
    assert bucket.reserve(1000, 1e6, 5.0) == pytest.approx(1000 / 1e6)


def test_bucket_serves_reservations_in_order():
    bucket = TokenBucket(0, 0.0)
    waits = [bucket.reserve(1000, 1000.0, 0.0) for _ in range(3)]  # three connections at once
    assert waits == pytest.approx([1.0, 2.0, 3.0])  # each waits for the ones ahead: the cap is shared


def test_bucket_follows_a_rate_change():
    bucket = TokenBucket(0, 0.0)
    assert bucket.reserve(1000, 1000.0, 0.0) == pytest.approx(1.0)
    assert bucket.reserve(1000, 500.0, 1.0) == pytest.approx(2.0)  # the first 1000 went at 1000/s
    assert bucket.reserve(500, 250.0, 1.5) == pytest.approx((750 + 500) / 250)  # 750 of the 2nd left, at 250/s


def test_schedule_steps_and_repeats():
    points = ((0.0, 1000.0), (5.0, 100.0))
    got = [schedule_mbps(points, t, base=1.0) for t in (0, 4.9, 5, 9.9, 10, 15, 21)]
    assert got == [1000, 1000, 100, 100, 1000, 100, 1000]


def test_schedule_base_before_first_point_and_single_point():
    points = ((2.0, 10.0), (4.0, 20.0))  # period 6 s; the base rate holds for [0, 2) of each
    assert [schedule_mbps(points, t, base=7.0) for t in (0, 2, 4, 5.9, 6, 8)] == [7, 10, 20, 20, 7, 10]
    assert [schedule_mbps(((3.0, 10.0),), t, base=7.0) for t in (0, 3, 100)] == [7, 10, 10]


def test_profile_from_config_and_pin():
    cfg = WanConfig(bandwidth_mbps=500, swing="schedule", schedule=((0, 300), (1, 30)))
    profile = BandwidthProfile(cfg)
    assert [profile.mbps(t) for t in (0.5, 1.5, 2.5)] == [300, 30, 300]
    profile.pin(77)
    assert [profile.mbps(t) for t in (0.5, 1.5)] == [77, 77]
    assert BandwidthProfile(WanConfig(bandwidth_mbps=123)).mbps(999) == 123


def test_random_walk_is_seeded_clamped_and_per_second():
    walk = {"walk_step": 0.2, "walk_min_mbps": 200, "walk_max_mbps": 900, "seed": 7}
    cfg = WanConfig(bandwidth_mbps=500, swing="random_walk", **walk)
    a, b = BandwidthProfile(cfg), BandwidthProfile(cfg)
    backwards = [b.mbps(t) for t in range(299, -1, -1)][::-1]  # query order does not matter
    values = [a.mbps(t) for t in range(300)]
    assert values == backwards
    assert values[0] == 500
    assert a.mbps(3.2) == a.mbps(3.9) == values[3]
    assert all(200 <= v <= 900 for v in values)
    assert min(values) < 400 and max(values) > 600  # it does walk
    for prev, cur in itertools.pairwise(values):
        if 200 < cur < 900:
            assert 1 / 1.2 - 1e-9 <= cur / prev <= 1.2 + 1e-9
    other = BandwidthProfile(WanConfig(**{**cfg.__dict__, "seed": 8}))
    assert [other.mbps(t) for t in range(300)] != values


def test_random_walk_clamps_its_start():
    assert RandomWalk(5000, 0.2, 50, 2000, seed=0).mbps(0) == 2000


def test_jitter_is_bounded_and_seeded():
    draws = [one_way_delay(0.010, 0.004, random.Random(3)) for _ in range(2)]
    assert draws[0] == draws[1]
    rng = random.Random(0)
    samples = [one_way_delay(0.010, 0.004, rng) for _ in range(2000)]
    assert all(0.006 <= s <= 0.014 for s in samples)
    assert max(samples) - min(samples) > 0.007  # it does jitter
    assert all(one_way_delay(0.001, 0.005, rng) >= 0 for _ in range(200))


def test_delay_line_never_reorders():
    rng, line = random.Random(0), DelayLine()
    dues, sent = [], 0.0
    for _ in range(2000):
        sent += rng.uniform(0, 0.004)
        d = one_way_delay(0.010, 0.008, rng)
        due = line.due(sent, d)
        assert due >= sent + 0.002 - 1e-12  # never earlier than delay - jitter
        assert due == sent + d or due == dues[-1]  # its own delay, or held behind its predecessor
        dues.append(due)
    assert dues == sorted(dues)


BAD_CONTROLS = [
    (WanControl(bandwidth_mbps=0), "bandwidth_mbps"),
    (WanControl(bandwidth_mbps=-5), "bandwidth_mbps"),
    (WanControl(bandwidth_mbps=math.nan), "bandwidth_mbps"),
    (WanControl(bandwidth_mbps=math.inf), "bandwidth_mbps"),
    (WanControl(bandwidth_mbps="fast"), "bandwidth_mbps"),
    (WanControl(delay_ms=-1), "delay_ms"),
    (WanControl(jitter_ms=-0.1), "jitter_ms"),
    (WanControl(stall_s=-2), "stall_s"),
    (WanControl(direction="a-c"), "direction"),
    (WanControl(forward="md-0", delay_ms=5), "forward"),
]


@pytest.mark.parametrize("msg, word", BAD_CONTROLS)
def test_control_errors_name_the_bad_value(msg, word):
    assert word in control_error(msg)


def test_control_ok():
    assert control_error(WanControl()) == ""
    assert control_error(WanControl(bandwidth_mbps=10, delay_ms=0, jitter_ms=0, stall_s=1, drop=True)) == ""
    assert control_error(WanControl(direction="b-a", forward="md-0", stall_s=1, down=True, drop=True)) == ""


@pytest.mark.parametrize(
    "kwargs, word",
    [
        ({"swing": "sine"}, "swing"),
        ({"swing": "schedule"}, "schedule"),
        ({"bandwidth_mbps": 0}, "bandwidth"),
        ({"delay_ms": -1}, "delay_ms"),
        ({"swing": "random_walk", "walk_min_mbps": 10, "walk_max_mbps": 5}, "walk_min"),
    ],
)
def test_bad_config_is_refused(kwargs, word):
    with pytest.raises(ValueError, match=word):
        check_config(WanConfig(**kwargs))
