"""Timing and the step functions runtime_bench.py and gpu_check.py share.

- `Clock` / `interleaved`: wall-clock timing (synchronising the GPU around each call), cases run
  round-robin so a stall of a shared machine slows every case of a round alike;
- the runtime side: sequences on a `KVPool` and one engine-like decode step (`runtime_decode_step`);
- the plain transformers side: a `DynamicCache` forward with `logits_to_keep=1`, as `generate()`.
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from shared.runtime.kv_pool import KVPool
from shared.runtime.runner import ModelRunner
from shared.runtime.sequence import Sequence


class Clock:
    """Wall-clock timing of one call, synchronising the GPU on both sides when there is one."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def ms(self, fn: Callable[[], object]) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return (time.perf_counter() - t0) * 1000


def _noop() -> None:
    return None


@dataclass
class Case:
    """One timed call, and what to undo (untimed) before each call so every call does the same work."""

    run: Callable[[], object]
    reset: Callable[[], object] = _noop


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def machine_busy(window_s: float = 0.25) -> float:
    """Share of the CPUs busy over a short window while this process sleeps (Linux; 0 elsewhere):
    anything above a few percent is someone else's work."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + fields[4]
        return sum(fields) - idle, sum(fields)

    try:
        busy0, total0 = sample()
        time.sleep(window_s)
        busy1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return 0.0
    return (busy1 - busy0) / max(total1 - total0, 1)


def wait_quiet(max_wait_s: float, threshold: float = 0.15) -> float:
    """Sleep until the machine is quiet (see `machine_busy`) or `max_wait_s` passed; seconds waited."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < max_wait_s and machine_busy() > threshold:
        time.sleep(0.5)
    return time.perf_counter() - t0


def interleaved(
    clock: Clock, cases: dict[str, Case], warmup: int, repeats: int, quiet_wait_s: float = 0.0
) -> dict[str, list[float]]:
    """Run the cases round-robin, `warmup` untimed rounds then `repeats` timed ones; ms per case.
    With `quiet_wait_s`, each timed round starts only once the machine is quiet (or that long passed)."""
    times: dict[str, list[float]] = {name: [] for name in cases}
    for i in range(warmup + repeats):
        if i >= warmup and quiet_wait_s:
            wait_quiet(quiet_wait_s)
        for name, case in cases.items():
            case.reset()
            ms = clock.ms(case.run)
            if i >= warmup:
                times[name].append(ms)
    return times


def random_tokens(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


# -- runtime side ---------------------------------------------------------------------------


def new_sequence(pool: KVPool, seq_id: str, tokens: list[int], capacity: int) -> Sequence:
    seq = Sequence(seq_id, list(tokens))
    seq.block_table = pool.allocator.allocate(pool.blocks_for(capacity))
    return seq


def release(pool: KVPool, seqs: list[Sequence]) -> None:
    for seq in seqs:
        pool.allocator.free(seq.block_table)
        seq.block_table = []


def rewind(seq: Sequence, tokens: list[int], computed: int, known: int) -> None:
    """Make `seq` know `tokens[:known]` with KV for the first `computed` (the rest is recomputed)."""
    seq.token_ids = tokens[:known]
    seq.num_computed = computed


def runtime_decode_step(runner: ModelRunner, seqs: list[Sequence]) -> None:
    """One decode step as the engine runs it: one token per sequence, then append the argmax."""
    result = runner.forward([(s, 1) for s in seqs])
    tokens = torch.argmax(result.logits, dim=-1).tolist()
    for seq, token in zip(seqs, tokens):
        seq.num_computed += 1
        seq.token_ids.append(token)


# -- plain transformers side ----------------------------------------------------------------


def new_cache(model: torch.nn.Module) -> object:
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def cache_kwarg(model: torch.nn.Module) -> str:
    """transformers 5.x renamed `past_key_values` to `cache`; use whichever this version takes."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def hf_forward(model: torch.nn.Module, ids: list[int], cache: object, device: torch.device) -> torch.Tensor:
    """One forward over `ids` on top of `cache`; returns the last row of logits."""
    kwargs = {cache_kwarg(model): cache}
    out = model(input_ids=torch.tensor([ids], device=device), use_cache=True, logits_to_keep=1, **kwargs)
    return out.logits[0, -1]


def hf_prefill(model: torch.nn.Module, ids: list[int], device: torch.device) -> torch.Tensor:
    return hf_forward(model, ids, new_cache(model), device)


def crop(cache: object, length: int) -> None:
    """Drop cached tokens past `length` (a negative crop means "remove this many")."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


def hf_decoder(model: torch.nn.Module, tokens: list[int], device: torch.device) -> Callable[[], None]:
    """A decode step closure: cache prefilled with all but the last token, then one token per call."""
    cache = new_cache(model)
    hf_forward(model, tokens[:-1], cache, device)
    last = [tokens[-1]]

    def step() -> None:
        last[0] = int(torch.argmax(hf_forward(model, last, cache, device)))

    return step
