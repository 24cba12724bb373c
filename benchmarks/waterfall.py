"""One request's waterfall as a PNG for `pdd bench`: the dashboard's picture, drawn from a
`requests.jsonl` record instead of the gateway's live data.

The stages are placed by the dashboard's own layout (`shared.waterfall.layout`), from the
response's `pdd` object: `timings_ms`, `handoff_chunks`, `handoff_gap_ms`. Token ticks
are the client's receive times (`token_times_s` from `sent_s`), one per SSE chunk; the first
`tokens_by_role.prefill` of them are prefill's (the first token), the next `tokens_by_role.rld`
the relay's (a chunk almost always carries one token; when one carries several, they make one
tick, as in `benchmarks.plots.timeline_segments`).

`plot_waterfalls` draws the request with the slowest client TTFT (the tail the report's targets
are about) and the median one, as `waterfall_slowest.png` and `waterfall_median.png`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after use("Agg"): the backend must be chosen first
from matplotlib.patches import Rectangle

from benchmarks.summary import Record, request_latencies
from shared.pipelines import Role
from shared.waterfall import ROWS, layout

LABELS = {
    "queue": "queue",
    "prefill": "prefill",
    "kv_local": "KV in-DC (A)",
    "kv_wan": "KV over the WAN",
    "relay": "relay tokens",
    "handoff": "handoff chunks",
    "extend": "extend",
    "main": "main-decode tokens",
    "end": "end",
}
COLORS = {
    "queue": "#9ca3af",
    "prefill": "#4b5563",
    "kv_local": "#06b6d4",
    "kv_wan": "#dc2626",
    "relay": "#f59e0b",
    "handoff": "#7c3aed",
    "extend": "#a855f7",
    "main": "#2563eb",
    "end": "#111827",
}
PLACEMENT = (
    "Stages placed from the pdd object's durations: queue from 0, prefill after it, both KV transfers when "
    "prefill ends; handoff chunks spread evenly from main-decode's KV landing to its first token, extend "
    "ending there. Ticks: the client's receive time of each chunk."
)


def pick(records: list[Record], which: str) -> Record | None:
    """The streamed, successful record with the slowest (`which="slowest"`) or median client TTFT."""
    timed = sorted(((lat.ttft_ms, i) for i, r in enumerate(records) if (lat := request_latencies(r)) is not None))
    if not timed:
        return None
    _, index = timed[-1] if which == "slowest" else timed[(len(timed) - 1) // 2]
    return records[index]


def record_layout(record: Record) -> dict[str, Any]:
    """`layout` of one record: its pdd timings, the client's token ticks, and its last chunk as the end."""
    pdd = record.get("pdd") or {}
    sent = float(record.get("sent_s", 0.0))
    times = [(float(x) - sent) * 1000 for x in record.get("token_times_s") or []]
    roles = pdd.get("tokens_by_role", {})
    n_first, n_relay = int(roles.get(Role.PREFILL, 0)), int(roles.get(Role.RLD, 0))
    marks = [
        (ms, Role.PREFILL if i < n_first else Role.RLD if i < n_first + n_relay else Role.MD)
        for i, ms in enumerate(times)
    ]
    end = times[-1] if times else float(pdd.get("timings_ms", {}).get("e2e", 0.0))
    return layout(
        pdd.get("timings_ms", {}), marks, int(pdd.get("handoff_chunks", 0)), float(pdd.get("handoff_gap_ms", 0.0)), end
    )


def plot_waterfall(path: Path, record: Record | None, title: str) -> Path:
    """One request on one time axis, a row per stage (top to bottom as on the dashboard)."""
    fig, ax = plt.subplots(figsize=(10, 4.6))
    if record is None:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set(title=title)
        return _save(fig, path)
    w = record_layout(record)
    y = {row: i for i, row in enumerate(ROWS)}
    if w["gap"]:  # behind the ticks it spans
        g = w["gap"]
        ax.add_patch(
            Rectangle(
                (g["start_ms"], y["relay"] - 0.45),
                g["dur_ms"],
                y["main"] - y["relay"] + 0.9,
                facecolor="none",
                edgecolor="#6b7280",
                hatch="//",
                linewidth=0.8,
            )
        )
        ax.text(
            g["start_ms"] + g["dur_ms"],
            y["handoff"],
            f" handoff gap {g['dur_ms']:.0f} ms",
            va="center",
            fontsize=8,
            fontweight="bold",
        )
    for b in w["bars"]:
        ax.barh(y[b["row"]], max(b["dur_ms"], 0.5), left=b["start_ms"], height=0.6, color=COLORS[b["row"]])
    for row, times in w["ticks"].items():
        ax.vlines(times, y[row] - 0.35, y[row] + 0.35, color=COLORS[row], linewidth=2 if row == "handoff" else 1)
    ax.axvline(w["ttft_ms"], color="#059669", linestyle="--", linewidth=1)
    ax.text(w["ttft_ms"], y["queue"], f" TTFT {w['ttft_ms']:.0f} ms", color="#059669", va="center", fontsize=8)
    ax.vlines([w["end_ms"]], y["end"] - 0.35, y["end"] + 0.35, color=COLORS["end"], linewidth=3)
    ax.text(w["end_ms"], y["end"], f"end {w['end_ms']:.0f} ms ", ha="right", va="center", fontsize=8)
    ax.set_yticks(range(len(ROWS)), [LABELS[r] for r in ROWS])
    ax.set_ylim(len(ROWS) - 0.5, -0.5)  # the first stage on top
    ax.set_xlim(left=0)
    pdd = record.get("pdd") or {}
    roles = pdd.get("tokens_by_role", {})
    ax.set(
        xlabel="ms since the client sent the request",
        title=f"{title}: {record.get('request_id', '?')} "
        f"({pdd.get('pipeline', '?')}, handoff {pdd.get('handoff', '?')}, relay {roles.get(Role.RLD, 0)} / main "
        f"{roles.get(Role.MD, 0)} tokens)",
    )
    ax.grid(axis="x", alpha=0.3)
    fig.text(0.01, 0.01, PLACEMENT, fontsize=6.5, color="#6b7280", wrap=True)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout(rect=(0, 0.05, 1, 1))  # room for the placement note
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_waterfalls(out_dir: Path, records: list[Record], mode: str = "") -> list[Path]:
    """`waterfall_slowest.png` and `waterfall_median.png` of these records (one mode's)."""
    return [
        plot_waterfall(
            Path(out_dir) / f"waterfall_{which}.png",
            pick(records, which),
            f"{which} TTFT{f' ({mode})' if mode else ''}",
        )
        for which in ("slowest", "median")
    ]
