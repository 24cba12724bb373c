"""layers.c: a step's whole layer stack in one C call, against the Python layer loop it replaces.

The first layer's K/V is the Python loop's bit for bit (RMSNorm, the q|k|v projection, RoPE and
the pool's rounding to bf16 are the same operations); past it the two differ only by silu's last
bits (layers.c has its own exponential), so logits agree to float noise and greedy tokens agree.
Batch invariance through layers.c is tests/runtime/test_invariant.py's (the default path runs it).
"""

from __future__ import annotations

import pytest
import torch

from shared.runtime import layers as c_layers
from shared.runtime.kv_pool import KVPool
from shared.runtime.models import kv_layout, load_model, tiny_llama
from shared.runtime.runner import ModelRunner
from shared.runtime.sequence import Sequence
from tests.helpers import greedy, random_prompts

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def smol(smol_dir):
    """SmolLM2 per dtype, loaded once for this file's tests."""
    models = {}

    def get(dtype):
        if dtype not in models:
            models[dtype] = load_model(smol_dir, dtype=dtype)
        return models[dtype]

    return get


def _runner(model, c: bool) -> ModelRunner:
    pool = KVPool.with_capacity(kv_layout(model), tokens=4096, block_size=16, dtype=model.dtype)
    runner = ModelRunner(model, pool, invariant=True)
    assert runner.decoder.c_layers is not None, runner.decoder.c_layers_note
    if not c:  # the same decoder object is shared per model: give the C stack back after the test
        runner.decoder = _PythonLoop(runner.decoder)
    return runner


class _PythonLoop:
    """The decoder with its C stack hidden: fused.py's own layer loop."""

    def __init__(self, decoder) -> None:
        self._decoder = decoder

    def __getattr__(self, name):
        return getattr(self._decoder, name)

    def forward(self, ids, positions, step, after_layer=None):
        saved, self._decoder.c_layers = self._decoder.c_layers, None
        try:
            return self._decoder.forward(ids, positions, step, after_layer)
        finally:
            self._decoder.c_layers = saved


def _run(runner: ModelRunner, prompts: list[list[int]], steps: int) -> tuple[list[torch.Tensor], list[Sequence]]:
    """Prefill each prompt alone, then `steps` greedy decode steps of them all as one batch."""
    seqs, logits = [], []
    for i, p in enumerate(prompts):
        s = Sequence(str(i), list(p), greedy(steps + 1))
        s.block_table = runner.pool.allocator.allocate(runner.pool.blocks_for(len(p) + steps + 1))
        out = runner.forward([(s, len(p))]).logits[0]
        s.num_computed = len(p)
        s.token_ids.append(int(out.argmax()))
        seqs.append(s)
        logits.append(out)
    for _ in range(steps):
        out = runner.forward([(s, 1) for s in seqs]).logits
        for s, row in zip(seqs, out):
            s.num_computed += 1
            s.token_ids.append(int(row.argmax()))
        logits.extend(out)
    return logits, seqs


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_c_stack_equals_the_python_loop(smol, dtype):
    model = smol(dtype)
    prompts = random_prompts(model.config.vocab_size, [37, 150], seed=11)
    c_logits, c_seqs = _run(_runner(model, c=True), prompts, steps=5)
    py_logits, py_seqs = _run(_runner(model, c=False), prompts, steps=5)
    assert [s.token_ids for s in c_seqs] == [s.token_ids for s in py_seqs]
    worst = max((a - b).abs().max().item() for a, b in zip(c_logits, py_logits))
    assert worst < (1e-3 if dtype == torch.float32 else 0.25), worst
    assert worst > 0  # the two silus differ in their last bits: the C stack did run


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_first_layers_kv_is_the_python_loops_bit_for_bit(smol, dtype):
    """RMSNorm, the projection, RoPE (two products and a sum) and the store's rounding to the
    pool's dtype: layer 0's K/V of a prompt and of decode steps equal the Python loop's."""
    model = smol(dtype)
    prompts = random_prompts(model.config.vocab_size, [50, 9], seed=12)
    kv = []
    for c in (True, False):
        runner = _runner(model, c)
        _, seqs = _run(runner, prompts, steps=3)
        slots = torch.cat([runner.pool.slots(s.block_table, 0, s.num_computed) for s in seqs])
        kv.append(runner.pool.kv[0, :, slots].clone())
    assert torch.equal(kv[0], kv[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c", [True, False], ids=["layers.c", "python-loop"])
def test_layer_by_layer_gives_the_one_calls_bits_with_each_layers_kv_in_the_pool_when_told(smol, dtype, c):
    """`after_layer` (a streaming prefill's last chunk): layers.c runs the layers `PER_CALL` to a
    call (the Python loop, one by one); the logits and every layer's KV are the one call's bits,
    and when layer i is announced its KV is final while the next call's first layer is not
    written yet."""
    model = smol(dtype)
    prompt = random_prompts(model.config.vocab_size, [70], seed=13)[0]
    n = len(model.model.layers)
    per_call = c_layers.PER_CALL if c else 1
    one_logits, one_kv, none = _prefill_watching_layers(_runner(model, c), prompt, None)
    logits, kv, seen = _prefill_watching_layers(_runner(model, c), prompt, per_call)
    assert none == [] and len(seen) == n
    assert torch.equal(logits, one_logits) and torch.equal(kv, one_kv)
    assert all(torch.equal(now, kv[i]) for i, (now, _, _) in enumerate(seen))
    assert not any(torch.equal(later, kv[j]) for now, j, later in seen if j < n)


def _prefill_watching_layers(runner: ModelRunner, prompt: list[int], per_call: int | None) -> tuple:
    """The prompt's logits and KV (every layer), and, with `per_call` (None: no `after_layer`),
    what the pool held of layer i when layer i was announced, and of the next call's first
    layer j (index, then its KV)."""
    seq = Sequence("0", list(prompt), greedy(2))
    seq.block_table = runner.pool.allocator.allocate(runner.pool.blocks_for(len(prompt) + 1))
    slots, last = runner.pool.slots(seq.block_table, 0, len(prompt)), runner.pool.layout.num_layers - 1
    seen = []

    def after(i: int) -> None:
        j = (i // per_call + 1) * per_call
        seen.append((runner.pool.kv[i, :, slots].clone(), j, runner.pool.kv[min(j, last), :, slots].clone()))

    logits = runner.forward([(seq, len(prompt))], after if per_call else None).logits
    return logits, runner.pool.kv[:, :, slots].clone(), seen


def test_a_model_layers_c_does_not_take_keeps_the_python_loop_and_says_why():
    model = tiny_llama(vocab_size=128)
    model.model.layers[0].self_attn.q_proj.bias = torch.nn.Parameter(torch.zeros(model.config.hidden_size))
    runner = ModelRunner(model, KVPool(kv_layout(model), 16, 16), invariant=True)
    assert runner.decoder.c_layers is None and runner.decoder.c_layers_note == "a projection bias"
    assert c_layers.unsupported_reason(runner.decoder) == "a projection bias"


def test_the_avx2_and_avx512_code_paths_of_the_stack_give_the_same_bits(monkeypatch, tmp_path):
    """layers.c built 8 lanes wide for AVX2 and with the AVX-512 code path's 16-lane vectors
    (`-DVW=16`): a small model's logits through each, bit for bit (see test_invariant.py's test of
    the kernels it includes)."""
    from pathlib import Path

    from shared.runtime import skinny

    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if not {"avx2", "fma"} <= set(flags.split()):
        pytest.fail("this test needs an x86 CPU with AVX2 (the suite runs on one)")
    monkeypatch.setenv("PDD_KERNEL_CACHE", str(tmp_path))
    haswell = tuple("-march=haswell" if f == "-march=native" else f for f in skinny.FLAGS)
    model = tiny_llama(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2)
    prompts = random_prompts(model.config.vocab_size, [33, 70], seed=13)
    got = []
    for width in (8, 16):
        run = c_layers.bind(skinny._build("cc", (*haswell, f"-DVW={width}"), source=c_layers.SOURCE))
        runner = _runner(model, c=True)
        runner.decoder.c_layers = c_layers.Layers(runner.decoder, run)
        got.append(torch.stack(_run(runner, prompts, steps=4)[0]))
    assert torch.equal(got[0], got[1])
