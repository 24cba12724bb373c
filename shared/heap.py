"""Python's cyclic garbage collector in a serving process: what startup made is frozen, and every
collection is timed.

A model process holds about 370,000 objects that live as long as it does (torch, transformers, the
model's modules, the tokenizer). CPython's full collection walks all of them: 230-250 ms on the
2-core Intel Xeon host, run whenever enough new objects have survived, at a moment nobody
chooses. It holds the GIL throughout, so the engine thread's step waits for it: one token of every
running stream arrives a quarter of a second late.

`settle()` runs once a process has started (model loaded, subscriptions made): one full
collection, then `gc.freeze()` moves every surviving object into a permanent generation that later
collections skip (a full collection after it walks only what came since: 0.01 ms in that process).
Objects made later are collected as before; frozen ones are never freed, which is what a process's
own startup objects want. It also times every collection from then on into
`pdd:gc_pause_seconds{generation}` and serves the frozen count, so an operator sees the pauses.
"""

from __future__ import annotations

import gc
import time
from typing import Any

PAUSE_BUCKETS = (1e-5, 1e-4, 5e-4, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def settle(metrics: Any) -> int:
    """Collect once, freeze what is left, and time later collections into `metrics` (a
    shared.telemetry.Metrics). Returns the number of objects frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    metrics.gauge("pdd:gc_frozen_objects", "Objects from startup moved out of the collector's reach").set(frozen)
    pauses = metrics.histogram(
        "pdd:gc_pause_seconds",
        "Python's cyclic garbage collections, by generation (each holds the GIL)",
        buckets=PAUSE_BUCKETS,
        labels=("generation",),
    )
    by_generation = [pauses.labels(generation=str(g)) for g in range(3)]
    started = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            by_generation[info["generation"]].observe(time.perf_counter() - started[0])

    gc.callbacks.append(timed)
    return frozen
