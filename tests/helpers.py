"""Factories shared by the tests: a reference `generate()`, a runtime built around a model,
and a loop that runs the engine to completion."""

from __future__ import annotations

import copy

import torch

from shared.runtime.engine import Engine
from shared.runtime.sampling import SamplingParams
from shared.runtime.sequence import Sequence


def reference_model(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` on transformers' stock sdpa attention, EOS disabled."""
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("sdpa")
    ref.generation_config.eos_token_id = None
    return ref


def reference_generate(ref: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    out = ref.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def make_engine(
    model: torch.nn.Module,
    num_blocks: int = 256,
    block_size: int = 16,
    dtype: torch.dtype | None = None,
    **engine_kwargs,
) -> Engine:
    return Engine.for_model(model, num_blocks, block_size, dtype, **engine_kwargs)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def run_to_completion(engine: Engine, max_steps: int = 10_000) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_work:
            return outs
        for o in engine.step():
            if o.token_id is not None:
                outs.setdefault(o.seq_id, []).append(o.token_id)
    raise AssertionError("engine did not finish")


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def seq(seq_id: str, prompt: list[int], n: int, **kw) -> Sequence:
    return Sequence(seq_id, list(prompt), greedy(n), **kw)
