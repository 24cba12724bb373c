"""KV export/import by token range, across dtypes and block sizes, and its wire form."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from shared.model_info import link_wire
from shared.runtime.engine import _LayerStream
from shared.runtime.kv_payload import (
    KVPayload,
    export_kv,
    import_kv,
    layer_from_bytes,
    layer_to_bytes,
    payload_from_parts,
    valid_start,
)
from shared.runtime.kv_pool import KVLayout, KVPool
from shared.runtime.sequence import Sequence
from tests.helpers import greedy, make_engine, random_prompts, reference_generate, reference_model, run_to_completion


def _prefill_and_export(model, prompt: list[int], start: int = 0) -> tuple[KVPayload, int]:
    """Prefill on a sender engine (block size 16); export [start, len) and the first token."""
    sender = make_engine(model, block_size=16)
    s = Sequence("p", list(prompt), greedy(1), hold_kv=True)
    sender.add(s)
    first = run_to_completion(sender)["p"][0]
    payload = export_kv(sender.pool, s.block_table, start, len(prompt))
    sender.release("p")
    assert sender.pool.num_free_blocks == sender.pool.num_blocks
    return payload, first


def _continue_on(receiver, prompt: list[int], payload: KVPayload, first: int, n: int) -> list[int]:
    """Import the payload into a fresh receiver sequence and decode from the first token."""
    s = Sequence("d", list(prompt) + [first], greedy(n), prompt_len=len(prompt))
    s.block_table = receiver.pool.allocator.allocate(receiver.pool.blocks_for(len(prompt)))
    import_kv(receiver.pool, s.block_table, payload)
    s.num_computed = len(prompt)
    receiver.add(s)
    return [first] + run_to_completion(receiver)["d"]


@pytest.mark.parametrize("model_name", ["tiny", "smol"])
def test_round_trip_fp32_other_block_size(request, model_name):
    model, ref = request.getfixturevalue(model_name), request.getfixturevalue(f"{model_name}_ref")
    [prompt] = random_prompts(model.config.vocab_size, [53], seed=11)
    payload, first = _prefill_and_export(model, prompt)
    receiver = make_engine(model, block_size=8)
    assert _continue_on(receiver, prompt, payload, first, 12) == reference_generate(ref, prompt, 12)
    assert receiver.pool.num_free_blocks == receiver.pool.num_blocks


def test_round_trip_fp32_to_bf16(tiny):
    bf16 = copy.deepcopy(tiny).to(torch.bfloat16)
    bf16_ref = reference_model(bf16)
    [prompt] = random_prompts(tiny.config.vocab_size, [40], seed=12)
    payload, _ = _prefill_and_export(tiny, prompt)
    bf16_first = reference_generate(bf16_ref, prompt, 1)[0]
    receiver = make_engine(bf16, block_size=32, dtype=torch.bfloat16)
    got = _continue_on(receiver, prompt, payload, bf16_first, 10)
    assert got == reference_generate(bf16_ref, prompt, 10)
    assert receiver.pool.kv.dtype == torch.bfloat16


def test_partial_range_stitches_onto_existing_prefix(tiny, tiny_ref):
    """Import only [16, n): the receiver already holds [0, 16) (a cached prefix)."""
    [prompt] = random_prompts(tiny.config.vocab_size, [45], seed=13)
    full, first = _prefill_and_export(tiny, prompt)
    tail, _ = _prefill_and_export(tiny, prompt, start=16)
    assert tail.header.num_tokens == len(prompt) - 16
    receiver = make_engine(tiny, block_size=16)
    s = Sequence("d", list(prompt) + [first], greedy(8), prompt_len=len(prompt))
    s.block_table = receiver.pool.allocator.allocate(receiver.pool.blocks_for(len(prompt)))
    import_kv(receiver.pool, s.block_table, full.narrow(0, 16))
    import_kv(receiver.pool, s.block_table, tail)
    s.num_computed = len(prompt)
    receiver.add(s)
    assert [first] + run_to_completion(receiver)["d"] == reference_generate(tiny_ref, prompt, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wire_bytes_round_trip(tiny, dtype):
    engine = make_engine(tiny, dtype=dtype)
    [prompt] = random_prompts(tiny.config.vocab_size, [20], seed=14)
    s = Sequence("p", prompt, greedy(1), hold_kv=True)
    engine.add(s)
    run_to_completion(engine)
    payload = export_kv(engine.pool, s.block_table, 3, 20)
    for k, v in payload.layers:
        data = layer_to_bytes(k, v)
        assert len(data) == payload.header.layer_bytes
        k2, v2 = layer_from_bytes(payload.header, data)
        assert torch.equal(k, k2) and torch.equal(v, v2)
    with pytest.raises(ValueError, match="expected"):
        layer_from_bytes(payload.header, b"\0" * 10)
    empty = export_kv(engine.pool, s.block_table, 20, 20)  # a decoder that holds everything
    k, v = layer_from_bytes(empty.header, layer_to_bytes(*empty.layers[0]))
    assert k.shape == (0, *k.shape[1:]) and v.numel() == 0


def test_layout_mismatch_is_refused(tiny):
    other = make_engine(tiny.__class__(tiny.config.__class__(**{**tiny.config.to_dict(), "num_hidden_layers": 3})))
    payload, _ = _prefill_and_export(tiny, [5, 6, 7, 8])
    with pytest.raises(ValueError, match="layout"):
        import_kv(other.pool, other.pool.allocator.allocate(1), payload)


def test_kv_that_finds_the_pool_full_waits_and_then_decodes_exactly(tiny, tiny_ref):
    """A decoder's admission (`Engine.admit_with_kv`) on a full pool admits nothing and leaves
    the sequence and pool as they were (with a cached prefix matched), so the parked KV is
    admitted later, once the running request finishes, and decodes exactly."""
    from shared.runtime.radix_cache import RadixCache

    [shared_prefix, tail, other] = random_prompts(tiny.config.vocab_size, [32, 20, 60], seed=13)
    prompt = shared_prefix + tail
    payload, first = _prefill_and_export(tiny, prompt, start=32)
    receiver = make_engine(tiny, num_blocks=9, block_size=16)  # the hog takes every block the prefix leaves
    receiver.cache = RadixCache(receiver.pool.allocator, 16)
    receiver.add(Sequence("warm", list(shared_prefix), greedy(1)))  # leaves [0, 32) in the cache
    run_to_completion(receiver)
    receiver.add(Sequence("hog", list(other), greedy(40)))  # 100 tokens reserved: 7 blocks
    receiver.step()
    parked = Sequence("d", list(prompt) + [first], greedy(10), prompt_len=len(prompt))
    assert receiver.admit_with_kv([(parked, payload)]) == []  # waits: no result
    assert (parked.block_table, parked.num_computed, parked.cached_tokens) == ([], 0, 0)
    run_to_completion(receiver)  # the hog finishes and frees its blocks
    assert receiver.admit_with_kv([(parked, payload)]) == [(None, "")] and parked.cached_tokens == 32
    assert [first] + run_to_completion(receiver)["d"] == reference_generate(tiny_ref, prompt, 10)
    assert receiver.pool.num_free_blocks + receiver.cache.num_blocks == receiver.pool.num_blocks


def _pool_holding(values: list[torch.Tensor], dtype: torch.dtype, block_size: int) -> tuple[KVPool, list[int]]:
    """A pool of `dtype` whose sequence holds K = values[layer], V = -values[layer] at positions [0, n)."""
    layout = KVLayout(len(values), *values[0].shape[1:])
    pool = KVPool(layout, num_blocks=8, block_size=block_size, dtype=dtype)
    table = pool.allocator.allocate(pool.blocks_for(len(values[0])))
    slots = pool.slots(table, 0, len(values[0]))
    for layer, k in enumerate(values):
        pool.write(layer, slots, k, -k)
    return pool, table


def _convert(
    values: list[torch.Tensor], src: torch.dtype, dst: torch.dtype, wire: str = "native"
) -> tuple[KVPayload, KVPayload]:
    """Export from a `src` pool (block size 16), over the wire's bytes in `wire`, into a `dst` pool
    (block size 8) at positions [0, n). Returns the payload sent and what the receiver's pool then holds."""
    pool, table = _pool_holding(values, src, 16)
    sent = export_kv(pool, table, 0, len(values[0]))
    header = dataclasses.replace(sent.header, wire=wire)
    received = KVPayload(header, [layer_from_bytes(header, layer_to_bytes(k, v, wire)) for k, v in sent.layers])
    receiver, rtable = _pool_holding([torch.zeros_like(v) for v in values], dst, 8)
    import_kv(receiver, rtable, received)
    return sent, export_kv(receiver, rtable, 0, len(values[0]))


def _kv_values(scale: float = 1.0, n: int = 37, layers: int = 2) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(21)
    return [torch.randn(n, 2, 8, generator=g) * scale for _ in range(layers)]  # 2 KV heads of 8


def test_bf16_export_imports_into_fp32_exactly():
    """A bf16 sender, an fp32 receiver: each value arrives as the bf16 value itself, upcast. The
    values span more than float16's range (a detour through it would overflow or flush them)."""
    values = [v * torch.logspace(-9, 9, v.shape[-1]) for v in _kv_values()]  # 1e-9 .. 1e9 along head_dim
    sent, held = _convert(values, torch.bfloat16, torch.float32)
    assert sent.header.dtype == "bfloat16" and held.header.dtype == "float32"
    for (k, v), (k32, v32), orig in zip(sent.layers, held.layers, values):
        assert torch.equal(k, orig.bfloat16()) and torch.equal(v, -orig.bfloat16())  # what the sender held
        assert k32.dtype == torch.float32
        assert torch.equal(k32, k.float()) and torch.equal(v32, v.float())
        assert torch.isfinite(k32).all() and k32.abs().max() > 65504 and (k32 != 0).all()


def test_native_kv_into_a_bf16_pool_travels_as_bf16_and_lands_bit_for_bit():
    """`link_wire`: float32 KV bound for a bfloat16 pool goes as bf16, half the bytes, and the
    receiver holds exactly what it holds when the float32 bytes travel (ties round to even once,
    on either side)."""
    wire = link_wire("native", "float32", "bfloat16")
    assert wire == "bf16" and link_wire("native", "float32", "float32") == "native"
    assert link_wire("native", "bfloat16", "float32") == "native" and link_wire("int8", "float32", "bfloat16") == "int8"
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130 * 3]).repeat(37, 2, 2)  # halfway cases
    values = [_kv_values()[0], ties]
    _, narrowed = _convert(values, torch.float32, torch.bfloat16, wire)
    sent, native = _convert(values, torch.float32, torch.bfloat16)
    assert dataclasses.replace(sent.header, wire=wire).layer_bytes * 2 == sent.header.layer_bytes
    for (k, v), (kn, vn) in zip(narrowed.layers, native.layers):
        assert k.dtype == torch.bfloat16 and torch.equal(k.view(torch.int16), kn.view(torch.int16))
        assert torch.equal(v.view(torch.int16), vn.view(torch.int16))


def test_fp32_to_fp16_rounds_once_and_fp16_to_fp32_is_exact():
    values = _kv_values(scale=4.0)
    sent, held = _convert(values, torch.float32, torch.float16)
    for (k, v), (k16, v16) in zip(sent.layers, held.layers):
        assert k16.dtype == torch.float16
        assert torch.equal(k16, k.half()) and torch.equal(v16, v.half())  # round to nearest, once
        normal = k.abs() >= 2**-14  # float16's normal range: rounding is relative there
        rel = ((k16.float() - k) / k).abs()[normal]
        assert rel.max() <= 2**-11 and rel.max() > 0  # half a float16 ulp: no coarser detour (bf16: 2**-9)
    fp16 = [v.half() for v in values]
    sent, held = _convert(fp16, torch.float16, torch.float32)
    for (k, _), (k32, v32), orig in zip(sent.layers, held.layers, fp16):
        assert torch.equal(k, orig) and k32.dtype == torch.float32
        assert torch.equal(k32, orig.float()) and torch.equal(v32, -orig.float())


@pytest.mark.parametrize("wire", ["native", "bf16", "int8"])
def test_a_prompt_streamed_in_chunks_is_the_same_kv_as_one_export(tiny, wire):
    """The engine hands a streaming prefill's KV out per computed chunk (`export_from`); the parts,
    through the wire and put back together, are the very KV of one export after the first token."""
    [prompt] = random_prompts(tiny.config.vocab_size, [53], seed=13)
    engine = make_engine(tiny, block_size=16, max_step_tokens=20)
    seq = Sequence("p", list(prompt), greedy(1), hold_kv=True, max_new=1, export_from=5)
    engine.add(seq)
    chunks = []
    while "p" not in engine.held:
        for out in engine.step():
            if out.kv_part is not None:
                assert out.token_id is None
                chunks.append(out.kv_part)
    assert [(c.header.start, c.header.end) for c in chunks] == [(5, 20), (20, 40)]  # the last chunk samples
    [rest] = engine.export_and_release("p", [40])[0]
    reference, _ = _prefill_and_export(tiny, prompt, start=5)  # one export, nothing streamed

    def wired(p: KVPayload) -> tuple[int, int, list[bytes]]:
        return p.header.start, p.header.end, [layer_to_bytes(k, v, wire) for k, v in p.layers]

    header = dataclasses.replace(reference.header, wire=wire)
    got = payload_from_parts(header, [wired(p) for p in [*chunks, rest]])
    expected = KVPayload(header, [layer_from_bytes(header, layer_to_bytes(k, v, wire)) for k, v in reference.layers])
    assert got.header == expected.header
    for (k, v), (ke, ve) in zip(got.layers, expected.layers):
        assert torch.equal(k, ke) and torch.equal(v, ve)


@pytest.mark.parametrize("every", [1, 2, 5])
def test_the_last_chunk_leaves_layer_by_layer_during_its_step_and_is_the_same_kv(tiny, monkeypatch, every):
    """With somewhere to put them (`Engine.emit`: the worker hands them to the loop at once), the
    chunk that ends a streaming prefill's prompt leaves `every` layers at a time while its step
    runs, not with the first token: nothing is left to export after it, and the parts are one
    export's KV."""
    monkeypatch.setattr(_LayerStream, "EVERY", every)
    [prompt] = random_prompts(tiny.config.vocab_size, [53], seed=13)
    engine = make_engine(tiny, block_size=16, max_step_tokens=20)
    emitted = []
    engine.emit = lambda outputs: emitted.extend((engine.steps, o) for o in outputs)
    engine.add(Sequence("p", list(prompt), greedy(1), hold_kv=True, max_new=1, export_from=5, layers_from=5))
    chunks, first = [], []
    while "p" not in engine.held:
        for out in engine.step():
            assert out.kv_layer is None
            (chunks if out.kv_part is not None else first).append(out)
    n = engine.pool.layout.num_layers
    assert [(c.kv_part.header.start, c.kv_part.header.end) for c in chunks] == [(5, 20), (20, 40)]
    assert [(step, o.kv_layer, len(o.kv_part.layers), o.kv_part.header.end) for step, o in emitted] == [
        (2, i, min(every, n - i), 53) for i in range(0, n, every)
    ]  # during the third step: `steps` counts the finished ones
    assert {o.kv_part.header.start for _, o in emitted} == {40}
    assert len(first) == 1 and first[0].token_id is not None
    [rest] = engine.export_and_release("p", [53])[0]
    assert rest.header.num_tokens == 0
    reference, _ = _prefill_and_export(tiny, prompt, start=5)
    last = [layer_to_bytes(k, v) for _, o in emitted for k, v in o.kv_part.layers]
    parts = [
        (c.kv_part.header.start, c.kv_part.header.end, [layer_to_bytes(k, v) for k, v in c.kv_part.layers])
        for c in chunks
    ]
    got = payload_from_parts(reference.header, [*parts, (40, 53, last)])
    for (k, v), (ke, ve) in zip(got.layers, reference.layers):
        assert torch.equal(k, ke) and torch.equal(v, ve)


def test_parts_that_do_not_tile_the_range_are_refused_and_none_make_an_empty_range(tiny):
    payload, _ = _prefill_and_export(tiny, list(range(3, 35)), start=16)
    h = payload.header
    layer = [layer_to_bytes(k[:8], v[:8]) for k, v in payload.layers]
    for parts in ([(16, 24, layer)], [(16, 24, layer), (25, 32, layer)], [(8, 16, layer), (16, 24, layer)]):
        with pytest.raises(ValueError, match="do not tile"):
            payload_from_parts(h, parts)
    empty = payload_from_parts(dataclasses.replace(h, start=32), [])
    assert [k.shape[0] for k, _ in empty.layers] == [0] * h.num_layers


def test_a_decoders_kv_starts_on_a_block_boundary_inside_the_prompt_or_at_its_end():
    assert [valid_start(s, 40, 16) for s in (0, 16, 32, 40)] == [True] * 4  # 40: the suffix path
    assert [valid_start(s, 40, 16) for s in (-16, 8, 33, 48)] == [False] * 4
    assert valid_start(48, 48, 16) and not valid_start(49, 48, 16)
