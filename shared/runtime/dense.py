"""The projections of the fused layer loop (fused.py): `Dense` is `x @ W.T + b` for one or several
nn.Linear layers, their outputs concatenated (q|k|v, gate|up), and the kernel a step takes.

On CPU the projections run on weights laid out once for one of two kernels ("packed"):

- skinny.c (`skinny.py`), the runtime's own fp32 GEMM for the few rows of a decode step: it reads
  each weight once per step for up to 12 rows. A SmolLM2 step's projections on the 2-core Intel
  Xeon host, at 1 / 8 / 16 rows: skinny 18.2 / 20.6 / 24.9 ms, oneDNN packed 24.1 / 29.6 / 36.3,
  MKL (`F.linear`) 20.0 / 47.3 / 46.5; at prefill sizes (512, 2048 rows) the three were equal.
- oneDNN with its blocked layout: on the AMD EPYC hosts it read weights near full bandwidth at
  1..16 rows where MKL read them at a third, and ran prefill 2x faster than MKL.

Each decoder picks when it is built, on its own weights and at the engine's thread count
(`choose_packed_kernel`: skinny.c where it builds here and times faster on the first layers at
a batched decode step, without making a prefill chunk much slower), then times plain `F.linear`
against the packed weights at 1-3 rows (`choose_small_step_kernel`) and runs steps of up to
`Dense.plain_rows` rows through it (MKL's one-row GEMM beat oneDNN's on the Intel host). Both
take about a second. One packed copy is kept beside the concatenated weights.
"""

from __future__ import annotations

from time import perf_counter

import torch
import torch.nn.functional as F

from shared.runtime import skinny

PACK_BATCH_HINT = 16  # oneDNN picks its weight layout for this many rows; fine from 1 to prefill sizes
SMALL_STEPS = (1, 2, 3)  # step sizes at which plain F.linear may beat the packed weights
PROBE_LIMIT_S = 0.25  # a model whose projections take longer per step keeps the packed weights untimed
PROBE_LAYERS = 8  # layers whose weights time skinny.c against oneDNN
PROBE_ROWS = (8, 256)  # the step sizes they are timed at: a batched decode step, a prefill chunk
SKINNY_MAX_ROWS = 128  # under skinny.c, bigger steps (prefill chunks) take plain F.linear (MKL)
PREFILL_SLACK = 1.25  # skinny.c is kept unless that makes prefill this much slower (MKL: 2x on AMD EPYC)


class Dense:
    """`x @ W.T + b` for one or several nn.Linear layers, their outputs concatenated."""

    def __init__(self, linears: list[torch.nn.Linear]) -> None:
        weights = [lin.weight.detach() for lin in linears]
        self.sizes = [w.shape[0] for w in weights]
        weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        biases = [lin.bias for lin in linears]
        self.bias = None
        if any(b is not None for b in biases):
            parts = [b.detach() if b is not None else weight.new_zeros(n) for b, n in zip(biases, self.sizes)]
            self.bias = torch.cat(parts)
        self.weight = weight
        if len(linears) > 1:  # the model's modules become views of the concatenation: one copy
            for lin, part in zip(linears, weight.split(self.sizes)):
                lin.weight.data = part
        self.kernel: str | None = None  # what `packed` is laid out for: "skinny", "onednn", None
        self.packed: torch.Tensor | None = None
        self.plain_rows = 0  # inputs of at most this many rows skip the packed weights
        self.invariant = False  # True: skinny.c for every row count (fp32 in and out)

    def pack(self, kernel: str) -> None:
        """Lay the weight out for `kernel` ("skinny" where it takes this weight, else "onednn"; the
        layout of another kernel is dropped first, so at most one packed copy is held)."""
        self.packed = self.kernel = None
        takes = skinny.supports(self.weight) and (self.invariant or self.weight.dtype == torch.float32)
        if kernel == "skinny" and takes:  # bf16 weights take skinny.c in the invariant mode (fp32 inputs)
            self.packed, self.kernel = skinny.pack(self.weight), "skinny"
            return
        self.packed = _pack(self.weight)
        self.kernel = None if self.packed is None else "onednn"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant:
            return skinny.linear(x, self.packed, self.bias)
        rows = x.shape[0]
        if self.packed is None or rows <= self.plain_rows or (self.kernel == "skinny" and rows > SKINNY_MAX_ROWS):
            return F.linear(x, self.weight, self.bias)
        return _packed_linear(x, self)


def _packed_linear(x: torch.Tensor, dense: Dense) -> torch.Tensor:
    if dense.kernel == "skinny":
        return skinny.linear(x, dense.packed, dense.bias)
    return torch.ops.mkldnn._linear_pointwise(x, dense.packed, dense.bias, "none", [], "")


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight in oneDNN's blocked layout (CPU, fp32/bf16), or None where that does not apply."""
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT)
    except (RuntimeError, AttributeError):  # a torch build without the op: plain F.linear
        return None


def _probe(denses: list[Dense], rows: int) -> float:
    """Seconds to run `rows` rows through every dense, each on its own input width."""
    inputs = {n: torch.full((rows, n), 0.01, dtype=denses[0].weight.dtype) for n in {d.weight.shape[1] for d in denses}}
    start = perf_counter()
    for d in denses:
        d(inputs[d.weight.shape[1]])
    return perf_counter() - start


def choose_packed_kernel(layers: list[list[Dense]]) -> tuple[str, str]:
    """The kernel for the packed weights, and why: "skinny" where skinny.c builds here and, on the
    first `PROBE_LAYERS` layers' own weights packed both ways, ran a batched decode step
    (`PROBE_ROWS[0]`) 5% faster than oneDNN's packed weights, and a prefill chunk (`PROBE_ROWS[1]`;
    under skinny.c plain `F.linear`) at most `PREFILL_SLACK` times slower; else "onednn". The
    best of three alternating runs each way. Untimed ("onednn") where one sample step takes longer
    than `PROBE_LIMIT_S`."""
    sample = [
        d
        for layer in layers[:PROBE_LAYERS]
        for d in layer
        if skinny.supports(d.weight) and d.weight.dtype == torch.float32
    ]
    if not sample:
        return "onednn", "no weight the skinny kernel takes (fp32 on CPU, outputs a multiple of 32)"
    reason = skinny.unavailable_reason()
    if reason is not None:
        return "onednn", f"skinny kernel unavailable: {reason}"
    layouts = {}
    for kernel in ("onednn", "skinny"):  # both held while timing: ~112 MB each for SmolLM2
        for d in sample:
            d.pack(kernel)
        layouts[kernel] = [(d.packed, d.kernel) for d in sample]

    def timed(kernel: str, rows: int) -> float:
        for d, (packed, kind) in zip(sample, layouts[kernel]):
            d.packed, d.kernel = packed, kind
        return _probe(sample, rows)

    try:
        if any(timed(kernel, PROBE_ROWS[0]) > PROBE_LIMIT_S for kernel in layouts):
            return "onednn", "too large to time"
        runs: dict[tuple[int, str], list[float]] = {(r, k): [] for r in PROBE_ROWS for k in layouts}
        for _ in range(3):  # alternating, so a stall of the machine slows both kernels alike
            for rows, kernel in runs:
                runs[rows, kernel].append(timed(kernel, rows))
        best = {key: min(times) for key, times in runs.items()}
    finally:
        for d in sample:
            d.packed = d.kernel = None
    decode, prefill = PROBE_ROWS
    won = (
        best[decode, "skinny"] <= 0.95 * best[decode, "onednn"]
        and best[prefill, "skinny"] <= PREFILL_SLACK * best[prefill, "onednn"]
    )
    figures = ", ".join(
        f"{r} rows {best[r, 'skinny'] * 1e3:.1f} vs {best[r, 'onednn'] * 1e3:.1f} ms" for r in PROBE_ROWS
    )
    return ("skinny" if won else "onednn"), f"skinny against oneDNN on {len(sample)} weights: {figures}"


def choose_small_step_kernel(denses: list[Dense]) -> None:
    """Set on every `Dense` the most rows (0..3) up to which a step's projections ran faster
    through plain `F.linear` than through the packed weights, timed here on these weights (the best
    of three alternating runs each way; plain must win by 5%). 0 where nothing is packed, or where
    one step's projections take longer than `PROBE_LIMIT_S` (they stay packed, untimed)."""
    if any(d.packed is None for d in denses):
        return

    def step(rows: int, plain: bool) -> float:
        for d in denses:
            d.plain_rows = rows if plain else 0
        return _probe(denses, rows)

    chosen = 0
    step(1, False)  # warm-up
    if step(1, False) <= PROBE_LIMIT_S:
        step(1, True)  # warm-up
        for rows in SMALL_STEPS:
            runs = [(plain, step(rows, plain)) for _ in range(3) for plain in (True, False)]
            plain, packed = (min(t for p, t in runs if p == side) for side in (True, False))
            if plain > 0.95 * packed:
                break
            chosen = rows
    for d in denses:
        d.plain_rows = chosen
