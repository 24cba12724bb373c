"""`pdd sim validate` against several real runs (sim/validate.py) and the knobs each run's code had
(sim/real.py `recorded_settings`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

import sim.validate as validate
from sim.args import add_sim_arguments
from sim.real import _is_ancestor, recorded_settings


def summary(p50: float, p90: float, p99: float, tpot: float, wan: float) -> dict:
    return {"ttft_ms": {"p50": p50, "p90": p90, "p99": p99}, "tpot_ms": {"p50": tpot}, "wan_kv_bytes": wan}


def results(**modes: dict) -> dict:
    return {"modes": modes}


def row(rows: list[dict], mode: str, metric: str) -> dict:
    return next(r for r in rows if (r["mode"], r["metric"]) == (mode, metric))


def test_the_simulator_against_the_mean_of_the_runs_with_their_spread():
    # three runs of TTFT P50 400, 500, 600 ms (mean 500), one simulation of 550 ms: +10%, a PASS at ±15%;
    # P90 1000 / 2000 / 3000 (mean 2000) against 1400: -30%, a MISS at ±25%, though inside the spread
    reals = [
        results(pdd=summary(400, 1000, 5000, 80, 100e6)),
        results(pdd=summary(500, 2000, 6000, 90, 110e6)),
        results(pdd=summary(600, 3000, 7000, 100, 120e6)),
    ]
    sim = results(pdd=summary(550, 1400, 6600, 99, 99e6))
    rows = validate.compare(reals, [sim, sim, sim])
    p50 = row(rows, "pdd", "TTFT P50")
    assert (p50["real"], p50["real_min"], p50["real_max"], p50["runs"]) == (500, 400, 600, 3)
    assert p50["real_runs"] == [400, 500, 600] and p50["sim_runs"] == [550, 550, 550]
    assert p50["error"] == pytest.approx(0.10) and p50["ok"] is True
    p90 = row(rows, "pdd", "TTFT P90")
    assert p90["error"] == pytest.approx(-0.30) and p90["ok"] is False
    assert row(rows, "pdd", "TTFT P99")["ok"] is None  # no target
    assert row(rows, "pdd", "TPOT P50")["error"] == pytest.approx(0.10)
    assert row(rows, "pdd", "WAN KV bytes")["error"] == pytest.approx(-0.10)


def test_each_run_has_its_own_simulation_and_a_mode_counts_the_runs_that_have_it():
    # run 2 has no pd-wan; the simulator's figure is the mean of its simulations of the runs that have the mode
    reals = [
        results(pdd=summary(400, 1, 1, 1, 0), **{"pd-wan": summary(1000, 1, 1, 1, 50)}),
        results(pdd=summary(600, 1, 1, 1, 0)),
    ]
    sims = [
        results(pdd=summary(450, 1, 1, 1, 0), **{"pd-wan": summary(900, 1, 1, 1, 50)}),
        results(pdd=summary(650, 1, 1, 1, 0), **{"pd-wan": summary(1, 1, 1, 1, 1)}),
    ]
    rows = validate.compare(reals, sims)
    pdd = row(rows, "pdd", "TTFT P50")
    assert (pdd["real"], pdd["sim"], pdd["sim_runs"]) == (500, 550, [450, 650])
    assert pdd["error"] == pytest.approx(0.10)
    wan = row(rows, "pd-wan", "TTFT P50")
    assert (wan["runs"], wan["real"], wan["sim"]) == (1, 1000, 900)
    zero = row(rows, "pdd", "WAN KV bytes")  # nothing real, nothing simulated: no error
    assert zero["error"] == 0.0 and zero["ok"] is True


def test_one_run_keeps_the_table_as_it_was_several_show_the_spread():
    one = validate.compare([results(pdd=summary(400, 1000, 1, 80, 0))], [results(pdd=summary(440, 1000, 1, 80, 0))])
    text = validate.markdown(one, "cmd")
    assert "| mode | metric | real | simulated | error | target | |" in text
    assert "| pdd | TTFT P50 | 400 ms | 440 ms | +10.0% | ±15% | PASS |" in text
    reals = [results(pdd=summary(400, 1000, 1, 80, 1e6)), results(pdd=summary(600, 1000, 1, 80, 3e6))]
    sim = results(pdd=summary(550, 1000, 1, 80, 2e6))
    text = validate.markdown(validate.compare(reals, [sim, sim]), "cmd")
    assert "| mode | metric | real (mean) | real runs (min..max) | simulated | error | target | |" in text
    assert "| pdd | TTFT P50 | 500 ms | 400 ms..600 ms (2) | 550 ms | +10.0% | ±15% | PASS |" in text
    assert "| pdd | WAN KV bytes | 2.0 MB | 1.0 MB..3.0 MB (2) | 2.0 MB | +0.0% | ±15% | PASS |" in text


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_sim_arguments(p)
    return p.parse_args(["validate", *argv])


def test_real_may_be_given_several_times_and_once_still_works():
    assert validate.real_dirs(parse()) == ["docs/bench-agentic"]
    assert validate.real_dirs(parse("--real", "a")) == ["a"]
    assert validate.real_dirs(parse("--real", "a", "--real", "b", "--real", "c")) == ["a", "b", "c"]
    assert validate.real_dirs(argparse.Namespace(real="a")) == ["a"]  # a caller's single string


def test_validate_writes_every_runs_figures_and_shares_equal_simulations(tmp_path, monkeypatch):
    # runs a and b: the same workload and outputs (one simulation); c: other outputs (its own)
    def real_run(p50: float, out: int) -> tuple[dict, list[dict]]:
        w = {"name": "agentic", "requests": 1, "seed": 0, "params": {"rate_rps": 0.4}}
        recs = [{"request_id": "x", "ok": True, "output_tokens": out, "mode": "pdd"}]
        return {"workload": w, "modes": {"pdd": summary(p50, 1000, 1, 80, 0)}}, recs

    runs = {"a": real_run(400, 16), "b": real_run(500, 16), "c": real_run(600, 20)}
    simulated = []

    def simulate_real(real, records, cfg, progress=True):
        simulated.append((records[0]["output_tokens"], cfg.warm_md_cache))
        return results(pdd=summary(550 if records[0]["output_tokens"] == 16 else 450, 1000, 1, 80, 0)), []

    monkeypatch.setattr(validate, "load_real", lambda folder: runs[str(folder)])
    monkeypatch.setattr(validate, "simulate_real", simulate_real)
    out = tmp_path / "val"
    args = parse("--real", "a", "--real", "b", "--real", "c", "--out", str(out))
    assert validate.main(args) == 0
    # no commit recorded: each run predates warm_md_cache, simulated with it off; a and b share one simulation
    assert simulated == [(16, False), (20, False)]
    doc = json.loads((out / "validation.json").read_text())
    assert [r["real"] for r in doc["runs"]] == ["a", "b", "c"] and [r["simulation"] for r in doc["runs"]] == [0, 0, 1]
    assert doc["runs"][0]["settings"]["handoff"] == {"warm_md_cache": False}
    p50 = row(doc["rows"], "pdd", "TTFT P50")
    assert p50["real_runs"] == [400, 500, 600] and p50["sim_runs"] == [550, 550, 450]
    assert p50["sim"] == pytest.approx(1550 / 3) and p50["error"] == pytest.approx(1550 / 1500 - 1)
    assert len(doc["simulated"]) == 2
    text = (out / "validation.md").read_text()
    assert "--real a --real b --real c" in text and "400 ms..600 ms (3)" in text
    # --as-config: the config's knobs for every run (the single-host config: warming on)
    simulated.clear()
    assert validate.main(parse("--real", "a", "--as-config", "--out", str(out))) == 0
    assert simulated == [(16, True)]


def test_calibration_takes_one_run():
    assert validate.main(parse("--calibrate", "--real", "a", "--real", "b")) == 2


git_knows = pytest.mark.skipif(_is_ancestor("16d46f4", "HEAD") is not True, reason="needs the repository's history")


def knobs(real: dict) -> dict:
    return recorded_settings(real)[0]


def test_a_run_without_a_commit_predates_every_changed_default():
    assert knobs({"settings": {}}) == {
        "scheduler": {"relay_finishes": False, "line_backlog": False},
        "handoff": {"warm_md_cache": False},
        "wan": {"control_crosses": False},  # one site's NATS: only KV crossed the emulated line
    }
    assert knobs(json.loads(Path("docs/bench-agentic-2/results.json").read_text()))["handoff"] == {
        "warm_md_cache": False
    }


@git_knows
def test_a_runs_commit_says_which_defaults_its_code_had():
    def at(commit: str) -> dict:
        return knobs({"environment": {"git_commit": commit}, "settings": {}})

    rules_off, rules_on = (
        {"relay_finishes": False, "line_backlog": False},
        {"relay_finishes": True, "line_backlog": True},
    )
    one_site, two_sites = {"control_crosses": False}, {"control_crosses": True}
    cold, warm = {"warm_md_cache": False}, {"warm_md_cache": True}
    assert at("0dac70d~1") == {"scheduler": rules_off, "handoff": cold, "wan": one_site}  # before every change
    assert at("0dac70d") == {"scheduler": rules_off, "handoff": cold, "wan": two_sites}  # the NATS link crosses
    assert at("16d46f4") == {"scheduler": rules_on, "handoff": cold, "wan": two_sites}  # rules on by default
    assert at("345b339") == {"scheduler": rules_off, "handoff": cold, "wan": two_sites}  # rules off again
    assert at("009d61a") == {"scheduler": rules_off, "handoff": warm, "wan": two_sites}  # warming
    assert at("HEAD") == at("009d61a")


def test_a_commit_git_does_not_know_falls_back_on_the_lines_counters():
    unknown = {"git_commit": "f" * 40}
    assert knobs({"environment": unknown, "settings": {"line_bytes": {}}}) == {
        "handoff": {"warm_md_cache": True},
        "wan": {"control_crosses": True},  # the line's counters came after the two sites
    }
    assert knobs({"environment": unknown, "settings": {}}) == {"handoff": {"warm_md_cache": False}}
