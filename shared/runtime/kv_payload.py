"""KV export/import by token range: what the KV plane carries between pools.

`export_kv` reads the KV of token positions [start, end) of a sequence as contiguous per-layer
tensors `[n, kv_heads, head_dim]`; `import_kv` writes such a payload into another pool's
slots. Because the payload is token-contiguous, the receiver's block size and dtype are its
own: the write converts dtype and scatters into whatever blocks the receiver allocated.

The wire form (`header` + per-layer bytes, in the header's wire format: shared/runtime/kv_wire.py)
lives here too so the transport never has to know about torch dtypes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from shared.messages import Message
from shared.model_info import WireFormat
from shared.runtime import kv_wire
from shared.runtime.kv_pool import KVLayout, KVPool

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_NAMES = {v: k for k, v in WIRE_DTYPES.items()}
MAX_DIMENSION = 1 << 20  # no header field is larger: a hostile one cannot make a frame size overflow


@dataclass(frozen=True)
class KVHeader(Message):
    """Which KV a payload holds and how it travels (the KV plane's HEADER carries it)."""

    start: int
    end: int
    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # sender's dtype, one of WIRE_DTYPES
    wire: WireFormat = WireFormat.NATIVE  # how each layer travels

    def __post_init__(self) -> None:
        sizes = (self.start, self.end - self.start, self.num_layers, self.kv_heads, self.head_dim)
        if min(sizes) < 0 or max(self.end, *sizes) > MAX_DIMENSION or self.dtype not in WIRE_DTYPES:
            raise ValueError(f"KV header out of range: {self}")

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer's K plus V on the wire."""
        return kv_wire.layer_bytes(self.num_tokens, self.kv_heads, self.head_dim, self.dtype, self.wire)

    @property
    def layout(self) -> KVLayout:
        return KVLayout(self.num_layers, self.kv_heads, self.head_dim)


@dataclass
class KVPayload:
    header: KVHeader
    layers: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), each [n, kv_heads, head_dim]

    @property
    def nbytes(self) -> int:
        return self.header.layer_bytes * self.header.num_layers

    def narrow(self, start: int, end: int) -> KVPayload:
        """The sub-range [start, end) (absolute positions) of this payload."""
        h = self.header
        if not h.start <= start <= end <= h.end:
            raise ValueError(f"[{start}, {end}) is not inside the payload's [{h.start}, {h.end})")
        a, b = start - h.start, end - h.start
        return KVPayload(dataclasses.replace(h, start=start, end=end), [(k[a:b], v[a:b]) for k, v in self.layers])


def valid_start(start: int, prompt_len: int, block_size: int) -> bool:
    """Where a decoder's KV may start: a block boundary inside the prompt (the prefix it holds), or
    the prompt's end (no KV comes: it computes what it lacks itself, the suffix path)."""
    return 0 <= start <= prompt_len and (start % block_size == 0 or start == prompt_len)


def kv_header(pool: KVPool, start: int, end: int) -> KVHeader:
    """The header of `pool`'s KV of token positions [start, end)."""
    if not 0 <= start <= end:
        raise ValueError(f"bad KV range [{start}, {end})")
    layout = pool.layout
    return KVHeader(start, end, layout.num_layers, layout.kv_heads, layout.head_dim, _DTYPE_NAMES[pool.dtype])


def export_layer(pool: KVPool, slots: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's K and V at `slots`, on the CPU."""
    k, v = pool.read(layer, slots)
    return k.cpu(), v.cpu()


def export_kv(pool: KVPool, block_table: list[int], start: int, end: int) -> KVPayload:
    header = kv_header(pool, start, end)
    slots = pool.slots(block_table, start, end)
    return KVPayload(header, [export_layer(pool, slots, layer) for layer in range(header.num_layers)])


def check_compatible(header: KVHeader, pool: KVPool) -> None:
    if header.layout != pool.layout:
        raise ValueError(f"KV layout {header.layout} does not match this pool's {pool.layout}")


def import_layer(pool: KVPool, slots: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    pool.write(layer, slots, k.to(pool.device), v.to(pool.device))


def import_kv(pool: KVPool, block_table: list[int], payload: KVPayload) -> None:
    """Write the payload's KV into positions [start, end) of the receiver's block table."""
    header = payload.header
    check_compatible(header, pool)
    slots = pool.slots(block_table, header.start, header.end).to(pool.device)
    for layer, (k, v) in enumerate(payload.layers):
        import_layer(pool, slots, layer, k, v)


def layer_to_bytes(k: torch.Tensor, v: torch.Tensor, wire: str = WireFormat.NATIVE) -> bytes:
    """One layer's K and V as bytes (K first) in wire format `wire` (native: the tensors' own dtype)."""
    return kv_wire.encode_layer(k, v, wire)


def layer_from_bytes(header: KVHeader, data: bytes | bytearray | memoryview) -> tuple[torch.Tensor, torch.Tensor]:
    return kv_wire.decode_layer(data, header.num_tokens, header.kv_heads, header.head_dim, header.dtype, header.wire)


def payload_from_parts(header: KVHeader, parts: list[tuple[int, int, list[bytes]]]) -> KVPayload:
    """The KV of `header`'s range from the parts that tile it in order, each `(start, end, per-layer
    wire bytes)` (a push streamed while prefill ran comes in several; an empty range in none)."""
    edges = [header.start] + [end for _, end, _ in parts]
    if [start for start, _, _ in parts] != edges[:-1] or edges[-1] != header.end:
        raise ValueError(f"KV parts {[(a, b) for a, b, _ in parts]} do not tile [{header.start}, {header.end})")
    if not parts:
        return KVPayload(header, [layer_from_bytes(header, b"")] * header.num_layers)
    decoded = [
        [layer_from_bytes(dataclasses.replace(header, start=a, end=b), data) for data in layers]
        for a, b, layers in parts
    ]
    if len(decoded) == 1:
        return KVPayload(header, decoded[0])
    return KVPayload(
        header,
        [tuple(torch.cat([part[i][kv] for part in decoded]) for kv in (0, 1)) for i in range(header.num_layers)],
    )
