"""A request's waterfall: its stages on one time axis, placed from the `pdd` object's durations.

One layout for both pictures of a request: the gateway's live dashboard
(`services.gateway.dashboard`, from its flows) and `pdd bench`'s PNGs (`benchmarks.waterfall`,
from `requests.jsonl` records), so the two place every stage the same way. Pure Python: the
gateway imports it and stays light.
"""

from __future__ import annotations

from typing import Any

from shared.pipelines import Role

# the stages, top to bottom as both pictures draw them ("prefill": the stage, as timings_ms names it)
ROWS = ("queue", "prefill", "kv_local", "kv_wan", "relay", "handoff", "extend", "main", "end")


def layout(
    t: dict[str, float], marks: list[tuple[float, str]], handoff_chunks: int, gap_ms: float, end_ms: float
) -> dict[str, Any]:
    """One request on one time axis, in ms since it arrived, from the `pdd` object's durations
    (`t` = timings_ms) and the tokens' arrival marks. The stages report durations, not start
    times, so they are placed: queue from 0, prefill after the queue, both KV transfers when
    prefill ends (prefill pushes to both decoders at once). Handoff chunks' own times are not
    recorded: they are spread evenly from main-decode's KV landing to its first token, and the
    extend (all chunks' worth) is drawn ending at that first token. The handoff gap is the
    user-visible stall before the first main-decode token."""
    queue, prefill = float(t.get("queue", 0.0)), float(t.get("prefill", 0.0))
    kv_at = queue + prefill
    bars = [
        _bar("queue", 0.0, queue),
        _bar("prefill", queue, prefill),
        _bar("kv_local", kv_at, t.get("kv_local")),
        _bar("kv_wan", kv_at, t.get("kv_wan")),
    ]
    first_token = [ms for ms, role in marks if role == Role.PREFILL]  # streamed by prefill itself
    relay = [ms for ms, role in marks if role == Role.RLD]
    main = [ms for ms, role in marks if role == Role.MD]
    chunks, gap = [], None
    if main and relay:  # handed over: chunks, extend and the gap sit before main-decode's first token
        first = main[0]
        landed = min(kv_at + float(t.get("kv_wan", 0.0)), first)
        chunks = [landed + (first - landed) * (i + 1) / (handoff_chunks + 1) for i in range(handoff_chunks)]
        extend = float(t.get("extend", 0.0))
        bars.append(_bar("extend", first - extend, extend))
        if gap_ms > 0:
            gap = {"start_ms": first - gap_ms, "dur_ms": gap_ms}
    return {
        "rows": list(ROWS),
        "bars": bars,
        "ticks": {"prefill": first_token, "relay": relay, "main": main, "handoff": chunks},
        "gap": gap,
        "ttft_ms": float(t.get("ttft", 0.0)),
        "end_ms": end_ms,
    }


def _bar(row: str, start_ms: float, dur_ms: float | None) -> dict[str, Any]:
    return {"row": row, "start_ms": start_ms, "dur_ms": float(dur_ms or 0.0)}
