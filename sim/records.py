"""Simulated requests as `pdd bench` records, so `benchmarks.summary` and `benchmarks.report`
read a simulation exactly as they read a real run (the `requests.jsonl` / `results.json` schema).

Times: a record's clock starts at the run's start, as the bench runner's does; `sent_s` is when
the request was sent (its arrival, or its previous turn's end), token times are when each token
reached the user as text (an answer's closing EOS token brings none: see `client_token_times`).
`pdd.timings_ms` splits the path the way the services report it: queue (sent to prefill start),
prefill, kv_local / kv_wan (prefill end to the KV landed, import included),
extend (MD: final handoff chunk in, to its next token), ttft and e2e.
"""

from __future__ import annotations

from typing import Any

from benchmarks.modes import mode
from benchmarks.summary import cost_rate_per_hour
from shared.pipelines import Role
from sim.config import SimConfig
from sim.request import RequestRun


def _span(marks: dict[str, float], a: str, b: str) -> float:
    return marks[b] - marks[a] if a in marks and b in marks else 0.0


def _extend_ms(run: RequestRun) -> float:
    final = run.marks.get("final_chunk")
    if final is None:
        return 0.0
    after = [t for t in run.token_times if t >= final]
    return after[0] - final if after else 0.0


def client_token_times(run: RequestRun) -> list[float]:
    """When the client received a chunk: every token but an EOS that ended the answer (no text)."""
    times = run.token_times
    return times[:-1] if run.req.eos and run.done and len(times) > 1 else times


def record(run: RequestRun, mode: str) -> dict[str, Any]:
    req, m = run.req, run.marks
    ok = "failed" not in m and run.done
    seen = client_token_times(run)
    times = [t / 1000.0 for t in seen]
    ttft = seen[0] - run.sent_ms if seen else 0.0
    return {
        "request_id": req.request_id,
        "mode": mode,
        "kind": req.kind,
        "session": req.session,
        "turn": req.turn,
        "arrival_s": req.arrival_ms / 1000.0,
        "sent_s": run.sent_ms / 1000.0,
        "token_times_s": times,
        "text": "",
        "ok": ok,
        "error": "" if ok else (run.reason or "did not finish"),
        "pdd": {
            "request_id": req.request_id,
            "pipeline": run.pipeline,
            "handoff": run.handoff,
            "plan_reason": run.reason,
            "handoff_reason": run.handoff_reason,
            "plan_estimates": run.estimates,
            "instances": {**dict.fromkeys(Role, ""), **run.instances},
            "tokens_by_role": dict(run.tokens_by_role),
            "handoff_chunks": run.handoff_chunks,
            "wan_kv_bytes": run.wan_bytes,
            "local_kv_bytes": run.local_bytes,
            "prefix_hit_tokens": dict(run.hit),
            "md_cached_tokens": run.hit[Role.MD],
            "timings_ms": {
                "queue": m.get("prefill_start", run.sent_ms) - run.sent_ms,
                "prefill": _span(m, "prefill_start", "prefill_end"),
                "kv_local": _span(m, "prefill_end", "kv_local"),
                "kv_wan": _span(m, "prefill_end", "kv_wan"),
                "extend": _extend_ms(run),
                "ttft": ttft,
                "e2e": seen[-1] - run.sent_ms if seen else 0.0,
            },
        },
        "output_tokens": run.emitted,
        "prompt_tokens": req.prompt_len,
    }


def settings(cfg: SimConfig, modes: list[str], runs: dict[str, list[RequestRun]], seed: int) -> dict[str, Any]:
    """The run's settings block, as `pdd bench` writes it, plus what was simulated on what."""
    duration = {m: max((t for r in rs for t in r.token_times[-1:]), default=0.0) / 1000.0 for m, rs in runs.items()}
    return {
        "slo": dict(cfg.slo),
        "prices": cfg.settings_prices(),
        "instances": {m: cfg.fleet(m) for m in modes},
        "duration_s": duration,
        "wan": {m: dict(cfg.wan) for m in modes},
        "md_in_other_dc": {m: mode(m).wan for m in modes},
        "seed": seed,
        "quick": False,
        "simulated": {"config": cfg.path, "chips": dict(cfg.chips), "local": dict(cfg.local)},
    }


def cost_per_hour(cfg: SimConfig, name: str) -> float:
    """Hourly hardware cost of mode `name`'s fleet (chips plus the line), as the summary prices it."""
    return cost_rate_per_hour({"prices": cfg.settings_prices(), "instances": {name: cfg.fleet(name)}}, name)
