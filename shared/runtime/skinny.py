"""The skinny GEMM (skinny.c, fp32 or bf16 weights): built for this CPU on first use, loaded with ctypes.

Decode steps on CPU multiply a few rows by every weight of the model. MKL and oneDNN run those
GEMMs at a fraction of the memory bandwidth once there are more than a few rows; skinny.c reads
each weight once per step for up to 12 rows per pass (see its header). `FusedDecoder` uses it where
it timed faster than oneDNN's packed weights on the model's own weights (dense.py).

Building: `cc -O3 -march=native -ffp-contract=off -fopenmp -shared` (about a second), into
`$PDD_KERNEL_CACHE` (default `~/.cache/pdd/kernels`) under a name that hashes the source, the
flags, the compiler and the CPU's flags, so a cache shared between machines never serves code
built for another CPU. Processes that build at once each write their own temporary file and
rename it into place. Without a C compiler, or with `PDD_SKINNY=0`, `load()` says why and the
runtime keeps oneDNN and MKL. `build` compiles the runtime's other C kernels (rows.c) the same way.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import NamedTuple, TypeVar

import torch

SOURCE = Path(__file__).with_name("skinny.c")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC")
BLOCK = 32  # output columns per block: N must be a multiple of it
ABI = 2  # skinny_abi() of a library this module can call
PACKED_DTYPES = (torch.float32, torch.bfloat16)
COMPILE_TIMEOUT_S = 120
PROFILER_NAME = "pdd::skinny_linear"


class Unavailable(RuntimeError):
    """The kernel cannot run here; the message says why."""


class Kernels(NamedTuple):
    """The library's two entry points: fp32 and bf16 weights (x and y fp32 for both)."""

    f32: ctypes._CFuncPtr
    bf16: ctypes._CFuncPtr


def cache_dir() -> Path:
    return Path(os.environ.get("PDD_KERNEL_CACHE") or Path.home() / ".cache" / "pdd" / "kernels")


def supports(weight: torch.Tensor) -> bool:
    """Whether the kernel takes this weight `[N, K]`: fp32 or bf16, on the CPU, N a multiple of 32."""
    return weight.device.type == "cpu" and weight.dtype in PACKED_DTYPES and weight.shape[0] % BLOCK == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`[N, K]` into the kernel's layout `[N / 16, K, 16]` (a copy); only weights it `supports`."""
    if not supports(weight):
        shape = f"{weight.dtype} {tuple(weight.shape)} on {weight.device.type}"
        raise ValueError(f"skinny.c takes fp32 or bf16 CPU weights of a multiple of {BLOCK} rows, not {shape}")
    n, k = weight.shape
    return weight.detach().reshape(n // 16, 16, k).transpose(1, 2).contiguous()


def linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None, fn: Kernels | None = None
) -> torch.Tensor:
    """`x @ W.T + bias`, fp32, for x `[M, K]` fp32 and W (fp32 or bf16) packed by `pack` (`fn`:
    another build's kernels). A bias is added in fp32."""
    kernels = fn or load()
    fn = kernels.bf16 if packed.dtype == torch.bfloat16 else kernels.f32
    x = x.contiguous()
    m, k = x.shape
    n = packed.shape[0] * 16
    if x.dtype != torch.float32 or x.device.type != "cpu" or packed.shape[1:] != (k, 16) or n % BLOCK:
        raise ValueError(f"skinny.c takes fp32 CPU inputs of the weight's width: {x.dtype} {x.shape}, weight {n}x{k}")
    y = torch.empty((m, n), dtype=torch.float32)
    if m and torch.autograd.profiler._is_profiler_enabled:  # a named op in torch.profiler's tables
        with torch.profiler.record_function(PROFILER_NAME):
            fn(x.data_ptr(), packed.data_ptr(), y.data_ptr(), m, k, n, torch.get_num_threads())
    elif m:
        fn(x.data_ptr(), packed.data_ptr(), y.data_ptr(), m, k, n, torch.get_num_threads())
    return y if bias is None else y.add_(bias.float())


def load() -> Kernels:
    """The kernel's C functions; raises `Unavailable` (the same one again on later calls) when it
    cannot be built or loaded here."""
    fn, reason = _load()
    if fn is None:
        raise Unavailable(reason)
    return fn


def unavailable_reason() -> str | None:
    """None when the kernel is ready, else why not (building it on the first call)."""
    return _load()[1]


@cache
def _load():
    if os.environ.get("PDD_SKINNY", "1") == "0":
        return None, "turned off by PDD_SKINNY=0"
    if platform.system() != "Linux":
        return None, f"built only on Linux (this is {platform.system()})"
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        return None, f"no C compiler ({compiler!r} is not on PATH)"
    try:
        return _bind(_build(compiler)), None
    except (OSError, subprocess.SubprocessError, AttributeError) as e:
        return None, f"could not build or load {SOURCE.name}: {e}"


def _bind(library: Path) -> Kernels:
    """`skinny_linear` and `skinny_linear_bf16` of a built library, typed for ctypes."""
    lib = ctypes.CDLL(str(library))
    if lib.skinny_abi() != ABI:
        raise OSError(f"{library.name} has ABI {lib.skinny_abi()}, this module calls {ABI}")
    fns = Kernels(lib.skinny_linear, lib.skinny_linear_bf16)
    for fn in fns:
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 4
    return fns


def build(source: Path) -> Path:
    """Another of the runtime's C kernels (`source`), built as this one is; raises `Unavailable`
    where this one cannot be built (`PDD_SKINNY=0`, no compiler) and OSError when the build fails."""
    reason = unavailable_reason()
    if reason is not None:
        raise Unavailable(reason)
    return _build(os.environ.get("CC") or "cc", source=source)


B = TypeVar("B")


def load_built(source: Path, bind: Callable[[Path], B]) -> tuple[B | None, str | None]:
    """Another kernel's library, built (`build`) and bound by `bind`; or None and why not."""
    try:
        return bind(build(source)), None
    except Unavailable as e:
        return None, str(e)
    except (OSError, AttributeError) as e:
        return None, f"could not build or load {source.name}: {e}"


def _build(compiler: str, flags: tuple[str, ...] = FLAGS, source: Path = SOURCE) -> Path:
    """The shared library for this source, flags, compiler and CPU; built once per cache."""
    siblings = sorted(p for p in source.parent.iterdir() if p.suffix in (".c", ".h") and p != source)
    text = b"".join(p.read_bytes() for p in (source, *siblings))  # and what it may include
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([text, " ".join(flags).encode(), version.encode(), _cpu_flags()]))
    target = cache_dir() / f"{source.stem}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{source.stem}-", suffix=".so")
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, *flags, str(source), "-o", tmp], capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S
        )
        if done.returncode != 0:
            raise OSError(f"{compiler} exited {done.returncode}: {done.stderr.strip()[-500:]}")
        os.replace(tmp, target)  # atomic: a process building at the same time wrote the same bytes
    finally:
        Path(tmp).unlink(missing_ok=True)
    return target


def _cpu_flags() -> bytes:
    """The CPU's feature flags (what -march=native compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.encode()
    except OSError:
        pass
    return platform.processor().encode()
