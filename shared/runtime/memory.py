"""Host memory for the runtime's large tensors: zeroed, and committed page by page as it is
written, not when it is allocated.

Why: `torch.zeros` on a CPU writes every byte, so an instance's whole KV pool is resident from
its first second whatever it holds. An anonymous private mapping reads as zeros and the kernel
gives it a page at the page's first write: an instance's memory follows the blocks it has used
(the allocator hands out the lowest free ids first and reuses freed ones first), and several
instances sized for a busy day share a host that is quiet. A pool that fills still takes all of
its memory: `pdd up` says how much that is beside what the host has (`pdd/launcher.py`).
"""

from __future__ import annotations

import math
import mmap

import torch


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, huge_pages: bool = False) -> torch.Tensor:
    """A zeroed tensor; on a CPU, a mapping committed as it is written, advised for 2 MB pages
    (transparent huge pages, `madvise` mode) when `huge_pages`. Elsewhere: `torch.zeros`."""
    size = nbytes(shape, dtype)
    if device.type != "cpu" or size == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    memory = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero-filled, private:
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):  # (shared anonymous memory would follow shmem's setting)
        try:
            memory.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: plain pages
            pass
    return torch.frombuffer(memory, dtype=dtype).view(shape)  # the tensor keeps the mapping alive
