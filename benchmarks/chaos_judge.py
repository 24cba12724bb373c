"""The chaos bench's judgement (benchmarks/chaos.py): what one request's stream ended as, and
how a fault's row of the table reads. Pure functions: tests/bench/test_chaos.py checks them."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.stats import percentile

EXACT, FAILED, WRONG, CUT, HUNG = "exact", "failed", "wrong", "cut", "hung"


OUTCOMES = (EXACT, FAILED, WRONG, CUT, HUNG)


BAD = (WRONG, CUT, HUNG)  # any of these fails the run; a clear error does not


# -- one stream ---------------------------------------------------------------------------


@dataclass
class SSE:
    done: bool = False  # `data: [DONE]`
    text: str = ""
    error: str = ""
    finish_reason: str | None = None
    pdd: dict[str, Any] | None = None


def parse_data_line(line: str) -> SSE | None:
    """An SSE line of a completion or chat stream; None for what is not a `data:` line.
    Raises ValueError when its JSON does not parse."""
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if data == "[DONE]":
        return SSE(done=True)
    event = json.loads(data)
    if "error" in event:
        error = event["error"]
        return SSE(error=str(error.get("message", error) if isinstance(error, dict) else error))
    choices = event.get("choices") or []  # the usage chunk has none
    choice = choices[0] if choices else {}
    text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return SSE(text=text, finish_reason=choice.get("finish_reason"), pdd=event.get("pdd"))


def http_error_message(status: int, body: bytes) -> str:
    """`HTTP 503: <the error's message>` from an OpenAI-shaped error body (or its raw start)."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:200].decode(errors="replace").strip()
    return f"HTTP {status}: {message}"


@dataclass
class Record:
    """What the client saw of one request."""

    spec: int
    pipeline: str | None
    sent_s: float = 0.0  # since the fault's load started
    elapsed_s: float = 0.0
    text: str = ""
    text_events: int = 0
    event_times_s: list[float] = field(default_factory=list)  # since it was sent: every data line
    completed: bool = False  # saw [DONE]
    error: str = ""  # a clear error: HTTP status or SSE error event
    cut: str = ""  # why the stream broke without one (transport error, bad JSON)
    timed_out: bool = False
    pdd: dict[str, Any] = field(default_factory=dict)
    outcome: str = ""


def judge(text: str, reference: str | None, error: str, completed: bool, timed_out: bool) -> str:
    """The outcome of one request (see the module's docstring)."""
    if timed_out:
        return HUNG
    if error:
        return FAILED
    if not completed:
        return CUT
    return EXACT if text == reference else WRONG


def max_gap(times: list[float]) -> float:
    """The largest gap between consecutive timestamps (0 for fewer than two)."""
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


# -- a fault's figures --------------------------------------------------------------------


def aggregate(fault: str, records: list[Record], wall_s: float, notes: list[str] | None = None) -> dict[str, Any]:
    """One row of the table from a fault's judged records."""
    counts = Counter(r.outcome for r in records)
    survived = [r for r in records if r.outcome in (EXACT, WRONG)]
    exact_s = sorted(r.elapsed_s for r in records if r.outcome == EXACT)
    messages = Counter(r.error for r in records if r.outcome == FAILED)
    messages.update(r.cut or "stream ended without [DONE]" for r in records if r.outcome == CUT)
    return {
        "fault": fault,
        "sent": len(records),
        **{o: counts.get(o, 0) for o in OUTCOMES},
        "worst_stall_s": max((max_gap(r.event_times_s) for r in survived), default=0.0),
        "p50_exact_s": percentile(exact_s, 50),
        "resends": sum(r.pdd.get("resends", 0) for r in records),
        "migrations": sum(r.pdd.get("migrations", 0) for r in records),
        "wall_s": wall_s,
        "errors": dict(messages.most_common()),
        "notes": list(notes or []),
    }


_COLUMNS = (
    ("fault", "<12"),
    ("sent", ">4"),
    (EXACT, ">5"),
    (FAILED, ">6"),
    (WRONG, ">5"),
    (CUT, ">4"),
    (HUNG, ">4"),
    ("worst stall", ">11"),
    ("p50 exact", ">9"),
    ("resends", ">7"),
    ("migr", ">4"),
    ("wall", ">6"),
)


def format_header() -> str:
    return " ".join(f"{name:{fmt}}" for name, fmt in _COLUMNS)


def format_row(row: dict[str, Any]) -> list[str]:
    """The row's table line, then one indented line per distinct error and per note."""
    cells = (
        row["fault"],
        row["sent"],
        *(row[o] for o in OUTCOMES),
        f"{row['worst_stall_s']:.2f} s",
        f"{row['p50_exact_s']:.1f} s",
        row["resends"],
        row["migrations"],
        f"{row['wall_s']:.0f} s",
    )
    lines = [" ".join(f"{cell:{fmt}}" for cell, (_, fmt) in zip(cells, _COLUMNS))]
    lines += [f"    {n}x {message}" for message, n in row["errors"].items()]
    lines += [f"    note: {note}" for note in row["notes"]]
    return lines


def verdict(rows: list[dict[str, Any]]) -> tuple[int, str]:
    """(exit status, one line): 1 when any request hung, was wrong or was cut."""
    bad = {o: sum(r[o] for r in rows) for o in BAD}
    sent = sum(r["sent"] for r in rows)
    exact = sum(r[EXACT] for r in rows)
    failed = sum(r[FAILED] for r in rows)
    line = f"{sent} requests: {exact} exact, {failed} failed with an error, " + ", ".join(
        f"{n} {o}" for o, n in bad.items()
    )
    if any(bad.values()):
        culprits = [r["fault"] for r in rows if any(r[o] for o in BAD)]
        return 1, f"chaos: NOT OK: {line} (under {', '.join(culprits)})"
    return 0, f"chaos: ok: {line}"


def record_json(r: Record) -> dict[str, Any]:
    out = asdict(r)
    out["worst_gap_s"] = max_gap(r.event_times_s)
    out.pop("event_times_s")
    pdd = out.pop("pdd")
    keys = ("pipeline", "handoff", "instances", "tokens_by_role", "migrations", "resends")
    out["pdd"] = {k: pdd[k] for k in keys if k in pdd}
    if r.outcome == EXACT:  # the reference is in the JSON's header
        out.pop("text")
    return out


def hang_bound(reference_s: list[float], floor_s: float) -> float:
    """How long a request may take before it counts as hung: `floor_s`, or three times the
    slowest reference where the host is slower than that (a shared 2-core machine can be)."""
    return max(floor_s, 3 * max(reference_s, default=0.0))
