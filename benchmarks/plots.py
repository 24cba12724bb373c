"""The report's figures (matplotlib, Agg backend): TTFT CDF, request timeline, hit buckets.

Every plot function takes plain data, writes one PNG and returns its path; a mode (or a whole
plot) with no data draws a "no data" note instead of failing.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after use("Agg"): the backend must be chosen first

from benchmarks.summary import HIT_BUCKETS, Record, request_latencies
from shared.pipelines import Role

# Lane 0 is datacenter A's side (P, in-DC KV, RLD); lane 1 the WAN and MD's side.
SEGMENT_STYLE: dict[str, tuple[int, str]] = {
    "queue+prefill": (0, "tab:gray"),
    "P first token": (0, "tab:green"),
    "kv_local": (0, "tab:cyan"),
    "RLD tokens": (0, "tab:orange"),
    "kv_wan": (1, "tab:red"),
    "handoff gap": (1, "black"),
    "MD tokens": (1, "tab:blue"),
}


def timeline_segments(record: Record) -> list[tuple[str, int, float, float]]:
    """(label, lane, start_ms, width_ms) of one request, times from its `sent_s`.

    Server phases come from pdd.timings_ms: queue+prefill starts at 0, then kv_local and kv_wan
    both start when prefill ends (P sends on both paths at once). Token spans come from the
    client's token times: the first tokens_by_role.prefill (prefill streams the first token),
    then tokens_by_role.rld chunks as RLD's (one token per chunk, an approximation), the rest
    MD's; the handoff gap runs from RLD's last token to MD's first.
    """
    lat = request_latencies(record)
    pdd = record.get("pdd") or {}
    t = pdd.get("timings_ms", {})
    prefill_end = float(t.get("queue", 0.0)) + float(t.get("prefill", 0.0))
    segs = [
        ("queue+prefill", 0.0, prefill_end),
        ("kv_local", prefill_end, float(t.get("kv_local", 0.0))),
        ("kv_wan", prefill_end, float(t.get("kv_wan", 0.0))),
    ]
    if lat is not None:
        sent = float(record.get("sent_s", 0.0))
        times = [(float(x) - sent) * 1000 for x in record["token_times_s"]]
        roles = pdd.get("tokens_by_role", {})
        n_first = min(int(roles.get(Role.PREFILL, 0)), len(times))
        if n_first:
            segs.append(("P first token", times[0], times[n_first - 1] - times[0]))
        times = times[n_first:]
        n_rld = min(int(roles.get(Role.RLD, 0)), len(times))
        if n_rld:
            segs.append(("RLD tokens", times[0], times[n_rld - 1] - times[0]))
        if n_rld < len(times):
            if n_rld:
                segs.append(("handoff gap", times[n_rld - 1], times[n_rld] - times[n_rld - 1]))
            segs.append(("MD tokens", times[n_rld], times[-1] - times[n_rld]))
    # A one-chunk token span has width 0 but is kept: it is drawn as a tick.
    kept = [s for s in segs if s[2] > 0 or s[0].endswith(("token", "tokens"))]
    return [(label, SEGMENT_STYLE[label][0], start, width) for label, start, width in kept]


def pick_timeline_records(records: list[Record], n: int = 8) -> list[Record]:
    """Up to n streamed requests, half of them (when there are) relayed by RLD, by send time."""
    streamed = [r for r in records if request_latencies(r) is not None]
    relayed = [r for r in streamed if (r.get("pdd") or {}).get("tokens_by_role", {}).get(Role.RLD, 0) > 0]
    picked = relayed[: n // 2]
    picked += [r for r in streamed if r not in picked][: n - len(picked)]
    return sorted(picked, key=lambda r: float(r.get("sent_s", 0.0)))


def _no_data(ax: Any) -> None:
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ttft_cdf(path: Path, records_by_mode: dict[str, list[Record]]) -> Path:
    """Empirical CDF of client TTFT (ms; log x-axis when every value is positive), one line per mode."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lowest = math.inf
    for mode, records in records_by_mode.items():
        ttft = sorted(x.ttft_ms for x in (request_latencies(r) for r in records) if x is not None)
        if ttft:
            ax.step(ttft, [(i + 1) / len(ttft) for i in range(len(ttft))], where="post", label=mode)
            lowest = min(lowest, ttft[0])
    if lowest == math.inf:
        _no_data(ax)
    else:
        ax.legend()
        ax.set_xscale("log" if lowest > 0 else "linear")
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", title="TTFT CDF", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_timeline(path: Path, records: list[Record], title: str) -> Path:
    """Horizontal bars of a few requests' phases (`timeline_segments`), two lanes per request."""
    picked = pick_timeline_records(records)
    fig, ax = plt.subplots(figsize=(9, 1 + 0.7 * max(len(picked), 1)))
    seen: set[str] = set()
    for row, record in enumerate(picked):
        for label, lane, start, width in timeline_segments(record):
            y = row + (-0.18 if lane == 0 else 0.18)  # the y-axis is inverted: lane 0 on top
            color, legend = SEGMENT_STYLE[label][1], None if label in seen else label
            if width > 0:
                ax.barh(y, width, left=start, height=0.32, color=color, label=legend)
            else:
                ax.plot([start], [y], marker="|", markersize=12, color=color, linestyle="", label=legend)
            seen.add(label)
    if picked:
        ax.set_yticks(range(len(picked)), [str(r.get("request_id", "?"))[:24] for r in picked])
        ax.invert_yaxis()
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    else:
        _no_data(ax)
    ax.set(xlabel="ms since sent (upper lane: datacenter A; lower: WAN / MD)", title=title)
    ax.grid(axis="x", alpha=0.3)
    return _save(fig, path)


def plot_hit_buckets(path: Path, buckets_by_mode: dict[str, list[dict[str, Any]]]) -> Path:
    """Per MD-hit bucket: TTFT P50 (solid) / P90 (dashed) per mode, and mean WAN bytes per mode."""
    fig, (ax_t, ax_w) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    xs = list(range(len(HIT_BUCKETS)))
    modes = [m for m, bs in buckets_by_mode.items() if any(b["count"] for b in bs)]
    width = 0.8 / max(len(modes), 1)
    for i, mode in enumerate(modes):
        bs = buckets_by_mode[mode]
        p50 = [b["ttft_ms"]["p50"] if b["count"] else math.nan for b in bs]
        p90 = [b["ttft_ms"]["p90"] if b["count"] else math.nan for b in bs]
        (line,) = ax_t.plot(xs, p50, marker="o", label=f"{mode} P50")
        ax_t.plot(xs, p90, marker="x", linestyle="--", color=line.get_color(), label=f"{mode} P90")
        ax_w.bar(
            [x - 0.4 + width * (i + 0.5) for x in xs],
            [b["mean_wan_kv_bytes"] for b in bs],
            width=width,
            color=line.get_color(),
            label=mode,
        )
    for ax in (ax_t, ax_w):
        ax.grid(alpha=0.3)
        if modes:
            ax.legend(fontsize=7)
        else:
            _no_data(ax)
    ax_t.set(ylabel="TTFT (ms)", title="TTFT and WAN bytes by MD-side prefix hit")
    ax_w.set(ylabel="mean WAN KV bytes", xlabel="MD-side prefix hit")
    ax_w.set_xticks(xs, [label for label, _, _ in HIT_BUCKETS])
    return _save(fig, path)
