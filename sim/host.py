"""The machine the instances run on: shared CPU cores, control-plane cost, cold processes.

A `HostSpec` (the `host:` section of a sim config) describes costs that belong to the host the
cluster runs on, not to the chip profile:
- `cores` > 0 says every instance process shares these cores (the single-host CPU cluster).
  Each instance is one single-threaded process; while N of them are busy (a prefill computing,
  a decoder stepping) and the control plane takes `background_cores`, each runs slower by
      slowdown = max(1, (N_busy + background_cores) / cores).
  `cores` = 0 (the default, every GPU fleet): each instance has its own chip, slowdown 1.
- `wan_proxy_cores`: the CPU the WAN emulator (a userspace proxy on the same host) takes while
  it carries KV; it counts as that many busy cores whenever the WAN has a flow in flight.
- `request_overhead_ms`: once per request, the control plane's cost outside compute and wire
  (gateway, scheduler and its Redis lookups, NATS hops, SSE), paid before the plan.
- `cold_start_ms`: once per process, on its first piece of work — a prefill's first forward, a
  decoder's first KV import — (a fresh process's first import and forward allocate and warm up
  what later requests reuse; no service warms up before its first request).
- `interleave_prefill`: a prefill instance runs the real engine's chunked steps (sim/prefill.py):
  one forward per step over at most `prefill_step_tokens` tokens of the prompts it holds,
  oldest first, instead of one prompt after another.

`SharedHost` counts busy instances; `Processor` runs one instance's work under that slowdown
as processor sharing: a job's remaining work (ms at full speed) drains at
1 / (jobs on this processor x host slowdown), re-rated whenever any instance becomes busy or
idle. Decoder steps use the slowdown at the step's start instead (a step is ~100 ms; the
decoder's inline step loop relies on a step's end being known when it starts).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from sim.events import EventLoop


@dataclass(frozen=True)
class HostSpec:
    cores: float = 0.0
    background_cores: float = 0.0
    request_overhead_ms: float = 0.0
    cold_start_ms: float = 0.0
    interleave_prefill: bool = False
    prefill_step_tokens: int = 512  # a prefill step's tokens (PDD's own "auto" is 2,048: shared/config.py)
    wan_proxy_cores: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"host.{f.name} must be >= 0, got {getattr(self, f.name)!r}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> HostSpec:
        raw = dict(raw or {})
        raw.pop("sources", None)
        unknown = sorted(set(raw) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"host: unknown key(s) {unknown}")
        return cls(**raw)


class SharedHost:
    """Who is busy on the shared cores; tells every processor when the slowdown changes."""

    def __init__(self, spec: HostSpec) -> None:
        self.spec = spec
        self.busy: dict[str, float] = {}  # owner -> cores it takes while busy
        self.processors: list[Processor] = []

    def slowdown(self) -> float:
        if self.spec.cores <= 0:
            return 1.0
        return max(1.0, (sum(self.busy.values()) + self.spec.background_cores) / self.spec.cores)

    def set_busy(self, owner: str, busy: bool, cores: float = 1.0) -> None:
        if self.spec.cores <= 0 or (owner in self.busy) == busy:  # unshared: nothing to re-rate
            return
        for p in self.processors:  # drain at the old rate up to now
            p.advance()
        if busy:
            self.busy[owner] = cores
        else:
            self.busy.pop(owner, None)
        for p in self.processors:
            p.reschedule()


@dataclass
class _Job:
    remaining: float  # ms of work at full speed
    done: Callable[[], None]


class Processor:
    """One instance's jobs, processor-shared, under the host's slowdown."""

    def __init__(self, loop: EventLoop, host: SharedHost, owner: str) -> None:
        self.loop, self.host, self.owner = loop, host, owner
        self.jobs: dict[int, _Job] = {}
        self._ids = itertools.count()
        self._rate = 1.0  # work-ms per ms for each job, since `_since`
        self._since = 0.0
        self._version = 0
        host.processors.append(self)

    def start(self, work_ms: float, done: Callable[[], None]) -> None:
        self.advance()
        self.jobs[next(self._ids)] = _Job(work_ms, done)
        if len(self.jobs) == 1:
            self.host.set_busy(self.owner, True)  # reschedules every processor, this one too
        self.reschedule()

    def advance(self) -> None:
        elapsed = self.loop.now - self._since
        if elapsed > 0:
            for job in self.jobs.values():
                job.remaining -= elapsed * self._rate
        self._since = self.loop.now

    def reschedule(self) -> None:
        self.advance()
        self._version += 1
        if not self.jobs:
            return
        self._rate = 1.0 / (len(self.jobs) * self.host.slowdown())
        first = min(job.remaining for job in self.jobs.values())
        self.loop.after(max(first, 0.0) / self._rate, self._tick, self._version)

    def _tick(self, version: int) -> None:
        if version != self._version:  # re-rated since: a later event stands for this one
            return
        self.advance()
        finished = [k for k, job in self.jobs.items() if job.remaining <= 1e-6]
        done = [self.jobs.pop(k).done for k in finished]
        if not self.jobs:
            self.host.set_busy(self.owner, False)
        self.reschedule()
        for fn in done:
            fn()
