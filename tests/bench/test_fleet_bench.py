"""The fleet bench (benchmarks/fleet_bench.py): a tiny real run (real NATS and Redis, one
scheduler process, ten instances with 1k-block indexes, a few hundred submits) whose every
submit gets a plan, and the report's figures and verdicts from a recorded result."""

from __future__ import annotations

import json

import pytest

from benchmarks import fleet_bench
from benchmarks.fleet_report import format_report, pool

LATENCY = {"mean", "p50", "p90", "p99", "max"}


@pytest.mark.slow
def test_every_submit_of_a_small_fleet_gets_a_plan(tmp_path, capsys):
    out = tmp_path / "fleet.json"
    argv = ["--instances", "10", "--blocks", "1000", "--schedulers", "1", "--duration", "2", "--warmup", "0.5"]
    argv += ["--prompts", "32", "--reps", "20", "--run-dir", str(tmp_path / "run"), "--out", str(out)]
    assert fleet_bench.main(argv) == 0
    result = json.loads(out.read_text())
    (run,) = result["runs"]
    for name in ("saturated", "paced"):
        phase = run[name]
        assert phase["planned"] == phase["sent"] > 0, (name, phase)  # every submit answered with a plan
        assert phase["errors"] == {} and phase["timeouts"] == 0 and phase["duplicates"] == 0, (name, phase)
        assert set(phase["latency_ms"]) == LATENCY and 0 < phase["latency_ms"]["p50"] <= phase["latency_ms"]["p99"]
        assert 0 < phase["queue_ms"]["p50"] <= phase["latency_ms"]["p99"]
        assert phase["plans_per_s"] > 0 and phase["cpu_s"]["scheduler-0"] > 0
    assert run["saturated"]["planned"] > 50
    # the prefix lookup asks only the instances holding the prompt's first block (the first blocks'
    # index), not each of the 10: one SISMEMBER per holder, and none for a prompt no one holds
    assert 0 < run["saturated"]["redis_per_plan"]["sismember"]["calls_per_plan"] < 5
    made = run["plans_logged"][0]  # by the scheduler's log, warm-up included
    assert made >= run["saturated"]["planned"] + run["paced"]["planned"]
    assert run["sim"]["prefill_tasks"] == made  # each plan dispatched its prefill once, and was acked
    timings = result["registry"]["timings"]
    assert {"alive()", "prefix_blocks(10 instances)"} <= set(timings)
    assert all(t["p50"] > 0 for t in timings.values())
    assert 0 < result["registry"]["hit_share"] < 1  # some prompts open with cached blocks, some do not
    assert result["fleet"]["roles"] == {"prefill": 5, "rld": 2, "md": 3} and result["index"]["used_memory"] > 0
    printed = capsys.readouterr().out
    assert "index: 10/10 instances, 10,000 blocks" in printed  # progress while filling
    assert "Targets:" in printed and f"{result['cores']} cores" in printed


def _phase(plans_per_s: float, p50: float, p99: float, duplicates: int = 0, seconds: float = 10.0) -> dict:
    planned = round(plans_per_s * seconds)
    return {
        "seconds": seconds,
        "sent": planned,
        "planned": planned,
        "plans_per_s": plans_per_s,
        "errors": {},
        "timeouts": 0,
        "duplicates": duplicates,
        "latency_ms": {"mean": p50, "p50": p50, "p90": p99, "p99": p99, "max": p99},
        "queue_ms": {"mean": p50 / 2, "p50": p50 / 2, "p90": p99 / 2, "p99": p99 / 2, "max": p99 / 2},
        "cpu_s": {"scheduler-0": 6.6, "redis": 0.4},
        "scheduler_cpu_ms_per_plan": 46.0,
        "redis_per_plan": {
            "evalsha": {"calls_per_plan": 1.0, "us_per_call": 900.0, "us_per_plan": 900.0},
            "sismember": {"calls_per_plan": 500.0, "us_per_call": 0.5, "us_per_plan": 250.0},
            "hgetall": {"calls_per_plan": 200.0, "us_per_call": 3.0, "us_per_plan": 600.0},
        },
    }


def recorded() -> dict:
    """A 1- and 2-scheduler run before the queue group: the second scheduler answered every submit too."""
    stat = {"mean": 1.0, "p50": 1.0, "p90": 2.0, "p99": 3.0, "max": 4.0}
    return {
        "host": "AMD EPYC 7B13, 2 cores",
        "cores": 2,
        "load_before": 0.5,
        "load_after": 1.5,
        "head": "de9836e Tests: ...",
        "settings": {"min_tokens": 1024, "max_tokens": 4096, "hit_share": 0.7},
        "fleet": {"instances": 200, "roles": {"prefill": 100, "rld": 50, "md": 50}, "blocks_each": 100_000},
        "index": {"used_memory_human": "1.49G"},
        "registry": {
            "timings": {"alive()": {**stat, "p50": 36.0}, "prefix_blocks(200 instances)": stat},
            "hit_share": 0.67,
            "instances_hit": 4.0,
            "keys": 601,
            "redis_per_read": {"evalsha": {"calls_per_plan": 1.0, "us_per_call": 800.0, "us_per_plan": 800.0}},
        },
        "pieces": {"Submit.decode (the prompt's ids checked)": stat},
        "runs": [
            {
                "schedulers": 1,
                "saturated": _phase(100.0, 150.0, 300.0),
                "paced": _phase(50.0, 4.0, 8.0) | {"rate": 50.0},
                "plans_logged": [1600],
            },
            {
                "schedulers": 2,
                "saturated": _phase(160.0, 200.0, 400.0, duplicates=1600),
                "paced": _phase(80.0, 6.0, 25.0) | {"rate": 80.0},
                "plans_logged": [2400, 2400],
            },
        ],
        "profile": {
            "plans_per_s": 40.0,
            "top": [
                {
                    "function": "registry.py:104(alive)",
                    "calls_per_plan": 1.0,
                    "own_us_per_plan": 120.0,
                    "cumulative_us_per_plan": 36000.0,
                }
            ],
        },
    }


def test_the_report_gives_each_figure_beside_its_target():
    text = format_report(recorded())
    assert "200 instances (100 prefill, 50 rld, 50 md), 100,000 blocks each in Redis (1.49G)" in text
    assert "Host: AMD EPYC 7B13, 2 cores" in text
    assert "alive()" in text and "36.000" in text
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line[:5].strip() in ("1", "2")}
    assert rows["1"][1:3] == ["100", "100"] and rows["2"][1:3] == ["160", "80"]  # plans/s, per scheduler
    assert (
        "1 scheduler(s): 100 plans/s per scheduler: 0.10x target (MISSED); P99 8.0 ms (paced): 0.80x target (met)"
        in text
    )
    assert (
        "2 scheduler(s): 80 plans/s per scheduler: 0.08x target (MISSED); P99 25.0 ms (paced): 2.50x target (MISSED)"
        in text
    )
    assert "1 -> 2 schedulers: x1.60 throughput: 0.94x target (MISSED)" in text
    assert "2 schedulers answered 1600 submits 3200 times" in text  # no queue group: each planned every request
    assert "on 2 cores" in text
    assert "evalsha 1 x 900 us" in text and "1500 us" in text  # Redis per plan; the script's SISMEMBERs are in its time
    assert "registry.py:104(alive)" in text


def test_phases_pool_every_client():
    a = {"window_s": 10.0, "sent": 3, "planned": 2, "errors": {"429": 1}, "first_error": "full", "timeouts": 0}
    a |= {"cpu_s": 1.0, "duplicates": 2, "pipelines": {"p-md": 2}, "latency_ms": [1.0, 3.0], "queue_ms": [0.5, 1.5]}
    b = a | {"errors": {}, "first_error": "", "pipelines": {"p-rld-md": 2}, "latency_ms": [2.0, 4.0]}
    phase = pool([a, b])
    assert (phase["sent"], phase["planned"], phase["plans_per_s"]) == (6, 4, 0.4)
    assert phase["errors"] == {"429": 1} and phase["first_error"] == "full" and phase["duplicates"] == 4
    assert phase["pipelines"] == {"p-md": 2, "p-rld-md": 2}
    assert phase["latency_ms"]["p50"] == 2.5 and phase["latency_ms"]["max"] == 4.0
