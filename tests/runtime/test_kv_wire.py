"""KV wire formats: what each carries, how many bytes, and how close it comes back."""

from __future__ import annotations

import pytest
import torch

from shared.model_info import load_model_info
from shared.runtime.kv_wire import WIRE_FORMATS, decode_layer, encode_layer, layer_bytes

N, H, D = 37, 3, 64


def kv(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(N, H, D, generator=g) * torch.linspace(0.1, 8, D)).to(dtype)  # channels of many scales
    return k, (torch.randn(N, H, D, generator=g) * 2).to(dtype)


@pytest.mark.parametrize("wire", WIRE_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_shapes_sizes_and_bounds(wire, dtype):
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
    k, v = kv(dtype)
    data = encode_layer(k, v, wire)
    assert len(data) == layer_bytes(N, H, D, name, wire)
    k2, v2 = decode_layer(data, N, H, D, name, wire)
    assert k2.shape == v2.shape == (N, H, D)
    assert k2.dtype == (dtype if wire == "native" else torch.bfloat16 if wire == "bf16" else torch.float32)
    for a, b in ((k, k2), (v, v2)):
        a, b = a.float(), b.float()
        amax = a.abs().amax(dim=-1, keepdim=True)
        if wire == "native" or (wire == "bf16" and dtype == torch.bfloat16):
            assert torch.equal(a, b)  # bit for bit
        elif wire == "bf16":
            assert ((a - b).abs() <= a.abs() * 2**-8 + 1e-30).all()  # bf16 keeps 8 bits of mantissa
        elif wire == "int8":
            assert ((a - b).abs() <= amax / 127 / 2 * 1.0001 + 1e-12).all()  # half a step of its row's scale
        else:  # fp8 e4m3: 3 bits of mantissa, relative to each value, within its row's range
            assert ((a - b).abs() <= a.abs() * 2**-4 + amax / 448 * 2**-6).all()


def test_bytes_per_token_for_smollm2():
    m = load_model_info("default")
    per = {w: m.kv_bytes_per_token("float32", w) for w in WIRE_FORMATS}
    assert per == {"native": 46080, "bf16": 23040, "fp8": 12240, "int8": 12240}  # scales: 720 B of the 12,240
    assert m.kv_bytes_per_token("bfloat16", "native") == 23040


def test_an_empty_range_travels_as_nothing():
    k = torch.empty(0, H, D)
    for wire in WIRE_FORMATS:
        assert encode_layer(k, k, wire) == b"" and decode_layer(b"", 0, H, D, "float32", wire)[0].shape == (0, H, D)


def test_a_frame_of_the_wrong_size_is_refused():
    k, v = kv(torch.float32)
    with pytest.raises(ValueError, match="expected"):
        decode_layer(encode_layer(k, v, "int8")[:-4], N, H, D, "float32", "int8")
    with pytest.raises(ValueError, match="unknown KV wire format"):
        layer_bytes(N, H, D, "float32", "int4")
