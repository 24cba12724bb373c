"""A real `pdd bench` run, read back and simulated: what validation (sim/validate.py) and
calibration (sim/calibrate.py) both start from.

1. `load_real`: the run's results.json and, when it kept them, its per-request records.
2. `recorded_settings` / `as_recorded`: the knobs whose real default changed over the project's
   history, set as the code that recorded the run had them. results.json records no cluster
   config, only the code's commit (`environment.git_commit`, since commit d393546), so a knob's
   value is its default at that commit (`CHANGES`): a run of `pdd bench --config X` that set one
   of them differently is not seen. Without a commit git can place, what the run wrote says
   when it was recorded: no `environment` at all, before any of the changes; the line's own
   counters (`settings.line_bytes`), from commit 009d61a on.
3. `simulate_real`: the same workload (same generator, request count, seed and rate) on a sim
   config, every mode of the run, each request given the output length the model produced.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.workloads import load_workload
from sim.config import SimConfig
from sim.run import run_modes, tokenizer_or_none
from sim.workload import from_bench

REPO = Path(__file__).resolve().parent.parent
# The real defaults that changed, oldest first: (commit, what it changed, {section: {knob: value from then on}}).
CHANGES: tuple[tuple[str, str, dict[str, dict[str, Any]]], ...] = (
    ("0dac70d", "two sites: control messages cross the line", {"wan": {"control_crosses": True}}),
    ("16d46f4", "the scheduler's rules, on", {"scheduler": {"relay_finishes": True, "line_backlog": True}}),
    ("345b339", "the scheduler's rules, off", {"scheduler": {"relay_finishes": False, "line_backlog": False}}),
    ("009d61a", "main-decode's cache warmed", {"handoff": {"warm_md_cache": True}}),
)
# Before all of them: no rules (as with both off), a relay-finished request's KV push cancelled.
BEFORE: dict[str, dict[str, Any]] = {
    "scheduler": {"relay_finishes": False, "line_backlog": False},
    "handoff": {"warm_md_cache": False},
    "wan": {"control_crosses": False},
}


def load_real(real_dir: Path) -> tuple[dict, list[dict]]:
    """A real run's results.json and, when it kept them, its per-request records."""
    real = json.loads((real_dir / "results.json").read_text())
    path = real_dir / "requests.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []
    return real, records


def _is_ancestor(commit: str, of: str) -> bool | None:
    """Whether `commit` is `of` or one of its ancestors; None when git cannot say (unknown commit, no git)."""
    try:
        done = subprocess.run(
            ["git", "-C", str(REPO), "merge-base", "--is-ancestor", commit, of], capture_output=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {0: True, 1: False}.get(done.returncode)


def _merge(a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {s: {**a.get(s, {}), **b.get(s, {})} for s in dict.fromkeys([*a, *b])}


def recorded_settings(real: dict) -> tuple[dict[str, dict[str, Any]], str]:
    """({section: {knob: value}}, how it was decided): the changed knobs as the run's code had them
    by default. Knobs nothing decides are left out (the sim config's stand)."""
    commit = (real.get("environment") or {}).get("git_commit")
    if commit:
        found = [_is_ancestor(c, commit) for c, _, _ in CHANGES]
        if None not in found:
            out = _merge(BEFORE, {})
            for (_, _, knobs), after in zip(CHANGES, found, strict=True):
                if after:
                    out = _merge(out, knobs)
            since = [f"{c} ({what})" for (c, what, _), after in zip(CHANGES, found, strict=True) if after]
            return out, f"recorded at {commit[:7]}: " + (
                f"after {', '.join(since)}" if since else "before every change"
            )
    if not real.get("environment"):
        return _merge(BEFORE, {}), "no commit recorded: before commit d393546, so before every change"
    warm = "line_bytes" in real.get("settings", {})
    how = "the line's counters are there: after 009d61a" if warm else "no line counters: before 009d61a"
    knobs = {"handoff": {"warm_md_cache": warm}, **({"wan": {"control_crosses": True}} if warm else {})}
    return knobs, f"commit {commit or '?'} unknown to git; {how}"


def as_recorded(cfg: SimConfig, real: dict) -> tuple[SimConfig, dict[str, dict[str, Any]], str]:
    """`cfg` with the changed knobs set as the run's code had them; the knobs set and how they were decided."""
    knobs, how = recorded_settings(real)
    replaced = {section: {**getattr(cfg, section), **values} for section, values in knobs.items()}
    return dataclasses.replace(cfg, **replaced), knobs, how


def simulate_real(real: dict, real_records: list[dict], cfg: SimConfig, progress: bool = True) -> tuple[dict, list]:
    """The real run's workload (same generator, seed, rate) on `cfg`, every one of its modes.

    Output lengths are the real ones when the run kept its records, else the generator's
    (`max_tokens`; the model stops early on few of them)."""
    w = real["workload"]
    outputs = {r["request_id"]: int(r["output_tokens"]) for r in real_records if r["ok"]}
    tokenizer = tokenizer_or_none()
    wl = load_workload(
        w["name"],
        n_requests=w["requests"],
        seed=w["seed"],
        rate_rps=w["params"].get("rate_rps", 0.5),
        tokenizer=tokenizer,
    )
    requests = from_bench(wl, tokenizer, outputs)
    return run_modes(cfg, list(real["modes"]), requests, wl.describe(), w["seed"], progress)
