"""Failpoints: named places where a test or the chaos bench makes a process misbehave on purpose.

Core NATS is at-most-once: a leaf reconnect, a server restart or a slow consumer loses messages,
and PDD must recover them. To prove it without waiting for a bad day, a few places in the code
ask `hit(name)` before they send; when the name is armed, the message is not sent, as if the
bus had lost it. The idea is TiKV's fail-rs and FoundationDB's BUGGIFY, kept small: nothing is
armed unless the process was started with one of

    PDD_FAILPOINTS="decoder.token_chunk=drop@5;decoder.final_chunk=drop@1"
    PDD_FAILPOINTS_FILE=/path/to/file      same syntax, re-read whenever the file changes

An entry may be scoped to one process: `md/decoder.token_chunk=drop%3` arms it only in
processes of role `md`, `md-0/...` only in instance md-0 (`configure`). `pdd.launcher.Cluster(...,
failpoints=True)` gives every service `PDD_FAILPOINTS_FILE=<run dir>/failpoints`.

Actions:
    drop@N     the Nth hit only (1-based), once
    drop%P     each hit with probability P percent (a lossy line)
    off        nothing (a file switches a fault off this way)

The points (grep `failpoints.hit`):
    decoder.token_chunk    a decoder's token chunk to the gateway (not the last one)
    decoder.final_chunk    a decoder's last chunk of a request (finish reason and stats)
    rld.handoff_chunk      the relay's handoff chunk to main-decode
    decoder.task           a decoder's task is neither taken nor answered (as if it had just died)
    scheduler.submit       a scheduler claims a submission and neither plans nor answers it (as if
                           it died right after the claim)
"""

from __future__ import annotations

import logging
import os
import random
import re
from dataclasses import dataclass

log = logging.getLogger(__name__)
_ACTION = re.compile(r"^(?:drop@(?P<nth>\d+)|drop%(?P<pct>\d+(?:\.\d+)?)|off)$")


@dataclass
class _Point:
    nth: int = 0  # drop the nth hit (0: not this kind)
    pct: float = 0.0  # drop each hit with this probability
    hits: int = 0


def parse(spec: str) -> dict[str, _Point]:
    """`name=action;name=action` -> armed points. A bad entry raises ValueError naming it."""
    points: dict[str, _Point] = {}
    for entry in filter(None, (e.strip() for e in re.split(r"[;\n]", spec))):
        name, _, action = entry.partition("=")
        found = _ACTION.match(action.strip())
        if not name.strip() or found is None:
            raise ValueError(f"failpoint {entry!r}: expected name=drop@N, name=drop%P or name=off")
        points[name.strip()] = _Point(int(found["nth"] or 0), float(found["pct"] or 0.0))
    return points


class Failpoints:
    def __init__(self, spec: str = "", path: str = "", rng: random.Random | None = None) -> None:
        self._points = parse(spec)
        self._path = path
        self._stamp: float | None = None
        self._rng = rng or random.Random()
        self._scopes: tuple[str, ...] = ()

    def set_identity(self, *names: str) -> None:
        """This process's instance id and role: entries scoped to either apply here."""
        self._scopes = tuple(n for n in names if n)

    def hit(self, name: str) -> bool:
        """True when the fault at `name` fires now (the caller then drops its message)."""
        if not self._path and not self._points:
            return False  # the usual case, on every token: nothing armed, nothing to look up
        self._reload()
        point = next(
            (p for key in (name, *(f"{s}/{name}" for s in self._scopes)) if (p := self._points.get(key))), None
        )
        if point is None:
            return False
        point.hits += 1
        fired = point.hits == point.nth or (point.pct > 0 and self._rng.random() * 100 < point.pct)
        if fired:
            log.warning("failpoint %s fired (hit %d)", name, point.hits)
        return fired

    def _reload(self) -> None:
        if not self._path:
            return
        try:
            stamp = os.stat(self._path).st_mtime_ns
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            text = "" if stamp is None else open(self._path).read()
            self._points = parse(text)  # hit counts start again with each new setting
        except (OSError, ValueError) as e:
            log.error("failpoints file %s ignored: %s", self._path, e)


_active = Failpoints()  # nothing armed until `configure`


def configure(*identity: str) -> None:
    """Arm what this process's environment names (called as a service starts: a process forked
    from the launcher's fork server imported this module before its environment was set)."""
    global _active
    _active = Failpoints(os.environ.get("PDD_FAILPOINTS", ""), os.environ.get("PDD_FAILPOINTS_FILE", ""))
    _active.set_identity(*identity)


def hit(name: str) -> bool:
    return _active.hit(name)
