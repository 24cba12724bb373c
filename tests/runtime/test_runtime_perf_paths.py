"""The runtime's fast paths compute what the plain ones do.

- the fused layer loop (fused.py) against transformers' forward with the paged attention, for
  Llama, Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms), over mixed prefill/extend/decode,
  with oneDNN's or skinny.c's packed weights and plain F.linear for small steps; which kernels a
  decoder picks, and that steps take them;
- a decode step from a CUDA-graph bucket (padded batch, scratch slots; captured on a GPU, run
  eagerly on CPU) against the eager step, KV included;
- the engine on each path against `generate()`, token for token.

The device follows PDD_TEST_DEVICE (tests/runtime/conftest.py).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from shared.runtime import dense, skinny
from shared.runtime.attention import ATTN_IMPLEMENTATION
from shared.runtime.cuda_graphs import CONTEXT_STEP, DecodeGraphs
from shared.runtime.engine import Engine
from shared.runtime.fused import FusedDecoder
from shared.runtime.kv_pool import KVPool
from shared.runtime.models import kv_layout, tiny_llama
from shared.runtime.runner import ModelRunner
from shared.runtime.sequence import Sequence
from tests.helpers import greedy, random_prompts, reference_generate, reference_model, run_to_completion

DEVICE = os.environ.get("PDD_TEST_DEVICE", "cpu")
SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    initializer_range=0.2,
    tie_word_embeddings=False,
)


def _tiny(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "llama":
        return tiny_llama().to(DEVICE)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**SMALL))
        for layer in model.model.layers:  # biases at zero would not test that they are applied
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=16))
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    return model.eval().to(DEVICE)


def _runner(model: torch.nn.Module, **kwargs) -> ModelRunner:
    """The paths this file tests are the non-invariant ones (`invariant=True` where a test says so:
    tests/runtime/test_invariant.py has the rest)."""
    pool = KVPool(kv_layout(model), 64, 16, next(model.parameters()).dtype, DEVICE)
    kwargs.setdefault("cuda_graphs", False)
    kwargs.setdefault("invariant", False)
    return ModelRunner(model, pool, **kwargs)


def _seq(runner: ModelRunner, name: str, tokens: list[int]) -> Sequence:
    s = Sequence(name, list(tokens), greedy(64))
    s.block_table = runner.pool.allocator.allocate(runner.pool.blocks_for(len(tokens) + 64))
    return s


def _step(runner: ModelRunner, work: list[tuple[Sequence, int]]) -> torch.Tensor:
    """One forward; computed tokens advance and every sampled sequence appends its argmax."""
    result = runner.forward(work)
    for seq, n in work:
        seq.num_computed += n
    for seq, token in zip(result.sampled, result.logits.argmax(-1).tolist()):
        seq.token_ids.append(token)
    return result.logits


def _mixed_steps(runner: ModelRunner, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Prefills, a chunked prefill joining running decodes, an extend, then plain decodes."""
    a, b, c = (_seq(runner, n, p) for n, p in zip("abc", prompts))
    out = [_step(runner, [(a, len(a.token_ids)), (b, 7)])]  # b: first chunk only
    out.append(_step(runner, [(a, 1), (b, b.num_tokens - 7), (c, 10)]))
    c.token_ids += [5, 6, 7]  # c: the rest of its prompt plus 3 handed tokens, one extend
    out.append(_step(runner, [(a, 1), (b, 1), (c, c.num_tokens - 10)]))
    for _ in range(4):
        out.append(_step(runner, [(s, 1) for s in (a, b, c)]))
    return out


KERNELS = [("onednn", 0), ("skinny", 0), ("onednn", 3), ("invariant", 0)] if DEVICE == "cpu" else [("onednn", 0)]


@pytest.mark.parametrize(("kernel", "plain_rows"), KERNELS, ids=lambda v: str(v))
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_fused_loop_matches_transformers_forward(kind, kernel, plain_rows):
    """With oneDNN's or skinny.c's packed weights for every step, with plain F.linear for the
    3-row decodes, and batch-invariant (skinny.c and rows.c for every row)."""
    model = _tiny(kind)
    prompts = random_prompts(model.config.vocab_size, [20, 30, 25], seed=5)
    runner = _runner(model, fused=True, invariant=kernel == "invariant")
    if kernel == "invariant":
        assert {d.kernel for d in runner.decoder._denses} == {"skinny"} and runner.mirror is None
    else:
        runner.decoder.use_kernel(kernel)
        assert {d.kernel for d in runner.decoder._denses} == ({kernel} if DEVICE == "cpu" else {None})
        runner.decoder.plain_rows = plain_rows
    fused = _mixed_steps(runner, prompts)
    plain = _mixed_steps(_runner(model, fused=False, mirror_bytes=0), prompts)
    for i, (x, y) in enumerate(zip(fused, plain)):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4, msg=lambda m, i=i: f"step {i}: {m}")


class _KernelClock:
    """Counts the projections each kernel runs and advances a fake clock by their given cost
    (skinny.c's packed weights cost what oneDNN's do unless told otherwise)."""

    def __init__(self, monkeypatch, plain_cost, packed_cost, skinny_cost=None) -> None:
        self.now, self.calls = 0.0, {"plain": [], "packed": [], "skinny": []}
        linear, packed_linear = F.linear, dense._packed_linear
        skinny_cost = skinny_cost or packed_cost

        def plain(x, weight, bias=None):
            self.calls["plain"].append(x.shape[0])
            self.now += plain_cost(x.shape[0])
            return linear(x, weight, bias)

        def packed(x, dense):
            kernel = "skinny" if dense.kernel == "skinny" else "packed"
            self.calls[kernel].append(x.shape[0])
            self.now += (skinny_cost if kernel == "skinny" else packed_cost)(x.shape[0])
            return packed_linear(x, dense)

        monkeypatch.setattr(dense.F, "linear", plain)
        monkeypatch.setattr(dense, "_packed_linear", packed)
        monkeypatch.setattr(dense, "perf_counter", lambda: self.now)

    def reset(self) -> None:
        self.calls = {kernel: [] for kernel in self.calls}


def _counted_runner(monkeypatch, kernel: str, plain_rows: int) -> tuple[ModelRunner, _KernelClock]:
    """A tiny Llama's runner on `kernel` with `plain_rows`, its projections counted (at no cost)."""
    runner = _runner(_tiny("llama"))
    runner.decoder.use_kernel(kernel)
    runner.decoder.plain_rows = plain_rows
    return runner, _KernelClock(monkeypatch, lambda rows: 0.0, lambda rows: 0.0)


@pytest.mark.skipif(DEVICE != "cpu", reason="the packed weights are oneDNN's, on CPU")
@pytest.mark.parametrize(
    ("plain_cost", "expected"),
    [
        (lambda rows: 1e-4 * rows, 2),  # plain faster up to 2 rows (packed: 2.5e-4)
        (lambda rows: 2.4e-4, 0),  # within 5% of packed: not worth a second kernel
        (lambda rows: 1e-5, 3),  # faster at every probed size: still only up to 3 rows
    ],
)
def test_small_steps_take_the_kernel_that_timed_faster(monkeypatch, plain_cost, expected):
    clock = _KernelClock(monkeypatch, plain_cost, lambda rows: 2.5e-4)
    decoder = FusedDecoder(_tiny("llama"))
    assert decoder.plain_rows == expected
    assert {d.plain_rows for d in decoder._denses} == {expected}
    assert set(clock.calls["plain"]) <= {1, 2, 3, *PACKED_PROBE_ROWS}  # small steps; choosing the packed kernel
    assert set(clock.calls["packed"]) <= {1, 2, 3, *PACKED_PROBE_ROWS}


PACKED_PROBE_ROWS = set(dense.PROBE_ROWS)  # a batched decode step, a prefill chunk


@pytest.mark.skipif(DEVICE != "cpu", reason="skinny.c and oneDNN's packed weights are for CPU")
@pytest.mark.parametrize(
    ("skinny_cost", "prefill_cost", "expected"),
    [
        (2.0e-4, 2.5e-4, "skinny"),  # 20% faster decodes, prefill (plain F.linear under skinny) as fast
        (2.4e-4, 2.5e-4, "onednn"),  # decodes within 5%: not worth the switch
        (1.0e-4, 5.0e-4, "onednn"),  # faster decodes, prefill 2x slower (MKL against oneDNN on AMD EPYC)
        (1.0e-4, 3.0e-4, "skinny"),  # prefill 20% slower: within PREFILL_SLACK
    ],
)
def test_packed_weights_take_the_kernel_that_timed_faster(monkeypatch, skinny_cost, prefill_cost, expected):
    if skinny.unavailable_reason() is not None:
        pytest.fail(f"skinny.c does not build here: {skinny.unavailable_reason()}")
    plain_cost = lambda rows: prefill_cost if rows > dense.SKINNY_MAX_ROWS else 1.0  # noqa: E731
    clock = _KernelClock(monkeypatch, plain_cost, lambda rows: 2.5e-4, lambda rows: skinny_cost)
    decoder = FusedDecoder(_tiny("llama"))
    assert decoder.kernel == expected, decoder.kernel_note
    assert {d.kernel for d in decoder._denses} == {expected}  # every weight packed for it, and only for it
    assert set(clock.calls["packed"]) >= PACKED_PROBE_ROWS  # oneDNN timed at both sizes
    assert dense.PROBE_ROWS[0] in clock.calls["skinny"] and dense.PROBE_ROWS[1] in clock.calls["plain"]
    assert max(clock.calls["skinny"]) <= dense.SKINNY_MAX_ROWS
    probed = [d for layer in decoder.layers[: dense.PROBE_LAYERS] for d in (layer.qkv, layer.o, layer.gate_up)]
    assert all((d.packed.dim() == 3) == (expected == "skinny") for d in probed)  # skinny's [N/16, K, 16]


@pytest.mark.skipif(DEVICE != "cpu", reason="skinny.c is for CPU")
def test_under_skinny_prefill_chunks_take_plain_f_linear(monkeypatch):
    runner, clock = _counted_runner(monkeypatch, "skinny", 0)
    config = runner.model.config
    long, short = (_seq(runner, n, p) for n, p in zip("ab", random_prompts(config.vocab_size, [120, 9], seed=4)))
    _step(runner, [(long, 120), (short, 9)])  # 129 rows: over SKINNY_MAX_ROWS
    per_step = 4 * config.num_hidden_layers
    assert clock.calls["plain"] == [129] * per_step and clock.calls["skinny"] == [2]  # the LM head: 2 sampled rows
    clock.reset()
    _step(runner, [(long, 1), (short, 1)])
    assert clock.calls["skinny"] == [2] * (per_step + 1) and clock.calls["plain"] == clock.calls["packed"] == []


@pytest.mark.skipif(DEVICE != "cpu", reason="skinny.c is for CPU")
def test_without_the_skinny_kernel_the_decoder_keeps_onednn(monkeypatch):
    monkeypatch.setenv("PDD_SKINNY", "0")
    skinny._load.cache_clear()
    try:
        decoder = FusedDecoder(_tiny("llama"))
        with pytest.raises(skinny.Unavailable, match="PDD_SKINNY=0"):
            decoder.use_kernel("skinny")  # asked for by name: an error at once, not at the first step
    finally:
        skinny._load.cache_clear()
    assert decoder.kernel == "onednn"
    assert "PDD_SKINNY=0" in decoder.kernel_note
    assert {d.kernel for d in decoder._denses} == {"onednn"}


@pytest.mark.skipif(DEVICE != "cpu", reason="the packed weights are oneDNN's, on CPU")
def test_a_model_too_large_to_time_keeps_the_packed_weights(monkeypatch):
    clock = _KernelClock(monkeypatch, lambda rows: 0.0, lambda rows: dense.PROBE_LIMIT_S)
    decoder = FusedDecoder(_tiny("llama"))
    assert decoder.plain_rows == 0
    assert clock.calls["plain"] == []  # not timed


@pytest.mark.skipif(DEVICE != "cpu", reason="the packed weights are oneDNN's, on CPU")
def test_steps_up_to_plain_rows_skip_the_packed_weights(monkeypatch):
    runner, clock = _counted_runner(monkeypatch, "onednn", 2)
    config = runner.model.config
    seqs = [_seq(runner, n, p) for n, p in zip("abc", random_prompts(config.vocab_size, [9, 12, 7], seed=2))]
    _step(runner, [(s, s.num_tokens) for s in seqs])
    assert clock.calls["plain"] == [] and min(clock.calls["packed"]) == 3  # 28 prompt rows; 3 sampled
    per_step = 4 * config.num_hidden_layers + 1  # q|k|v, o, gate|up, down; the LM head
    for rows, kernel in ((2, "plain"), (3, "packed"), (1, "plain")):
        clock.reset()
        _step(runner, [(s, 1) for s in seqs[:rows]])
        assert clock.calls[kernel] == [rows] * per_step, f"{rows} rows"


def test_unsupported_model_runs_transformers_forward():
    model = _tiny("llama")
    model.config.hidden_act = "gelu"  # not the fused loop's silu
    runner = _runner(model)
    assert runner.decoder is None
    with pytest.raises(ValueError, match="activation"):
        _runner(model, fused=True)
    model.config.hidden_act = "silu"


def _decode_rounds(runner: ModelRunner, prompts: list[list[int]], batches: list[int]) -> list[torch.Tensor]:
    seqs = [_seq(runner, f"s{i}", p) for i, p in enumerate(prompts)]
    _step(runner, [(s, s.num_tokens) for s in seqs])
    return [_step(runner, [(s, 1) for s in seqs[:b]]) for b in batches]


def test_graph_bucket_step_matches_eager_step_and_keeps_kv():
    """Batch sizes that pad to a bucket, and contexts crossing a context bucket's edge."""
    model = _tiny("llama")
    prompts = random_prompts(model.config.vocab_size, [CONTEXT_STEP - 3, 40, 17, 90, 5], seed=9)
    batches = [1, 3, 5, 5, 2, 5, 5, 5]
    eager = _runner(model)
    graphed = _runner(model, cuda_graphs=DEVICE == "cuda")
    if graphed.graphs is None:  # CPU: the same static-shape step, run eagerly
        graphed.graphs = DecodeGraphs(graphed.decoder, graphed.pool, capture=False)
    expected = _decode_rounds(eager, prompts, batches)
    got = _decode_rounds(graphed, prompts, batches)
    for i, (x, y) in enumerate(zip(got, expected)):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4, msg=lambda m, i=i: f"round {i}: {m}")
    assert {key[0] for key in graphed.graphs.graphs} == {1, 4, 8, 2}  # buckets used
    assert {key[1] for key in graphed.graphs.graphs} == {CONTEXT_STEP, 2 * CONTEXT_STEP}
    blocks = [b for b in range(eager.pool.num_blocks) if eager.pool.allocator.refcount(b)]
    slots = torch.cat([torch.arange(b * 16, (b + 1) * 16) for b in blocks])
    torch.testing.assert_close(graphed.pool.export_tokens(slots), eager.pool.export_tokens(slots), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "options",
    [{}, {"mirror_bytes": 0}, {"fused": False}, {"invariant": DEVICE == "cpu"}],
    ids=["mirror", "gather", "hf", "invariant"],
)
def test_engine_on_each_path_equals_generate(options):
    model = _tiny("llama")
    ref = reference_model(tiny_llama())  # the same weights (seeded), plain CPU transformers
    prompts = random_prompts(model.config.vocab_size, [5, 40, 17, 71, 33], seed=1)
    engine = Engine(_runner(model, **options))
    for i, p in enumerate(prompts):
        engine.add(Sequence(str(i), list(p), greedy(10)))
    outs = run_to_completion(engine)
    for i, p in enumerate(prompts):
        assert outs[str(i)] == reference_generate(ref, p, 10), f"sequence {i}"
