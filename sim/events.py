"""The event loop: a heap of (time, sequence number, callback). Times are milliseconds.

One owner of the clock: every component schedules work with `at` / `after` and reads `now`.
The sequence number keeps same-time events in the order they were scheduled, so a run is
deterministic. `next_time` lets a decoder run steps inline while nothing else can happen
before they end (see `sim.decoder`): the heap is the only way the world interacts.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple]] = []
        self._seq = itertools.count()
        self.events = 0

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        if t < self.now - 1e-9:
            raise ValueError(f"event at {t:.3f} ms is in the past (now {self.now:.3f} ms)")
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn, args))

    def after(self, dt: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + dt, fn, *args)

    def __len__(self) -> int:
        return len(self._heap)  # events still to run

    def next_time(self) -> float:
        return self._heap[0][0] if self._heap else math.inf

    def run(self, until: float = math.inf, progress: Callable[[float], None] | None = None) -> None:
        heap = self._heap
        while heap and heap[0][0] <= until:
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            self.events += 1
            fn(*args)
            if progress is not None and self.events % 200_000 == 0:
                progress(t)
