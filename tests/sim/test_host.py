"""The shared-host model (sim/host.py) against timings computed by hand on the trivial chip."""

from __future__ import annotations

import dataclasses

import pytest

from sim.events import EventLoop
from sim.host import HostSpec, Processor, SharedHost
from sim.run import simulate
from tests.sim.factories import TRIVIAL, make_config, make_request


def _two_jobs(cores: float) -> dict[str, float]:
    loop, done = EventLoop(), {}
    host = SharedHost(HostSpec(cores=cores))
    a, b = Processor(loop, host, "a"), Processor(loop, host, "b")
    a.start(100.0, lambda: done.setdefault("a", loop.now))
    b.start(100.0, lambda: done.setdefault("b", loop.now))
    loop.run()
    return done


def test_two_busy_instances_on_one_core_each_take_twice_as_long():
    assert _two_jobs(cores=1) == pytest.approx({"a": 200.0, "b": 200.0})
    assert _two_jobs(cores=2) == pytest.approx({"a": 100.0, "b": 100.0})
    assert _two_jobs(cores=0) == pytest.approx({"a": 100.0, "b": 100.0})  # unshared: GPU fleets


def test_a_job_speeds_up_when_the_other_instance_goes_idle():
    loop, done = EventLoop(), {}
    host = SharedHost(HostSpec(cores=1))
    a, b = Processor(loop, host, "a"), Processor(loop, host, "b")
    a.start(100.0, lambda: done.setdefault("a", loop.now))
    b.start(20.0, lambda: done.setdefault("b", loop.now))
    loop.run()
    # both at half speed until b's 20 ms of work are done at 40; a has 80 left, alone: 120
    assert done == pytest.approx({"b": 40.0, "a": 120.0})


def test_request_overhead_is_paid_once_per_request():
    # test_timings' p-md case (tokens at 205, 215, 225), each request 7 ms later; the second
    # request's own overhead does not delay the first
    cfg = make_config(host={"request_overhead_ms": 7.0})
    runs, _ = simulate(cfg, "pd-wan", [make_request("a", output=3), make_request("b", output=1, arrival_ms=1000.0)])
    assert runs[0].token_times == pytest.approx([212.0, 222.0, 232.0])
    assert runs[1].token_times[0] - runs[1].sent_ms == pytest.approx(212.0)


def test_a_fresh_process_pays_its_cold_start_on_its_first_work_only():
    # prefill's first forward (+50: prefill ends at 150) and MD's first import (+50): token 0 at
    # 150 + 105 + 50; the second request pays neither
    cfg = make_config(host={"cold_start_ms": 50.0})
    runs, _ = simulate(cfg, "pd-wan", [make_request("a", output=1), make_request("b", output=1, arrival_ms=1000.0)])
    assert runs[0].marks["prefill_end"] == pytest.approx(150.0)
    assert runs[0].token_times == pytest.approx([305.0])
    assert runs[1].token_times == pytest.approx([1205.0])


def test_interleaved_prefill_shares_the_instance_and_misses_the_unfinished_prefix():
    # two 96-token prompts sharing their first 4 blocks, sent together: one after the other
    # the second hits 64 tokens (done at 96 + 32); interleaved both compute 96 at half speed
    reqs = [make_request("a", prompt=96, output=1, shared=4), make_request("b", prompt=96, output=1, shared=4)]
    fifo, _ = simulate(make_config(), "pd-local", reqs)
    assert [r.marks["prefill_end"] for r in fifo] == pytest.approx([96.0, 128.0])
    both, _ = simulate(make_config(host={"interleave_prefill": True}), "pd-local", reqs)
    assert [r.marks["prefill_end"] for r in both] == pytest.approx([192.0, 192.0])
    assert [r.hit["prefill"] for r in both] == [0, 0]


def test_the_control_plane_cores_slow_prefill_and_decode_steps():
    # one core, the control plane takes one: alone, an instance runs at half speed
    cfg = make_config(host={"cores": 1, "background_cores": 1})
    [run], _ = simulate(cfg, "pd-wan", [make_request(output=2)])
    assert run.marks["prefill_end"] == pytest.approx(200.0)
    assert run.token_times == pytest.approx([305.0, 325.0])  # KV 100 ms + 5 ms, then a 20 ms step


def test_a_bad_host_value_is_named():
    with pytest.raises(ValueError, match="host.cores"):
        HostSpec(cores=-1)
    with pytest.raises(ValueError, match="unknown key"):
        HostSpec.from_dict({"coress": 2})


def test_a_chunked_prefill_step_pays_the_forwards_fixed_cost_once():
    # fixed 50 ms + 1 ms/token: two 96-token prompts sent together share one forward: 50 + 192
    chip = dataclasses.replace(TRIVIAL, prefill_fixed_ms=50.0)
    cfg = make_config(profiles={"trivial": chip}, host={"interleave_prefill": True})
    reqs = [make_request("a", prompt=96, output=1), make_request("b", prompt=96, output=1)]
    runs, _ = simulate(cfg, "pd-local", reqs)
    assert [r.marks["prefill_end"] for r in runs] == pytest.approx([242.0, 242.0])


def test_a_short_prompt_waits_until_the_long_ones_last_chunk_leaves_room():
    # 1 ms/token, 100 tokens a step: a (256) takes [0, 100] and [100, 200]; b (32, sent at 10)
    # gets no budget until a's last 56 leave room: [200, 288] computes both
    cfg = make_config(host={"interleave_prefill": True, "prefill_step_tokens": 100})
    reqs = [make_request("a", prompt=256, output=1), make_request("b", prompt=32, output=1, arrival_ms=10.0)]
    runs, _ = simulate(cfg, "pd-local", reqs)
    assert [r.marks["prefill_start"] for r in runs] == pytest.approx([0.0, 200.0])
    assert [r.marks["prefill_end"] for r in runs] == pytest.approx([288.0, 288.0])


def test_the_wan_proxy_takes_its_cores_while_it_carries_kv():
    # one core; the proxy takes a whole one while a's 100 ms transfer is in flight [100, 200]
    cfg = make_config(host={"cores": 1, "wan_proxy_cores": 1.0})
    reqs = [make_request("a", output=1), make_request("b", output=1, arrival_ms=100.0)]
    runs, _ = simulate(cfg, "pd-wan", reqs)
    assert runs[0].marks["prefill_end"] == pytest.approx(100.0)
    # b's prefill starts at 100 with a's KV on the wire until 200: half speed for 100 ms, then full
    assert runs[1].marks["prefill_end"] == pytest.approx(250.0)
