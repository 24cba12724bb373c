"""Factories shared by the tests: a reference `generate()`, a runtime built around a model,
a loop that runs the engine to completion, and a poll for state on an event loop."""

from __future__ import annotations

import asyncio
import copy
import inspect
from collections.abc import Callable

import torch

from shared.messages import Sampling
from shared.runtime.engine import Engine
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


def greedy(n: int) -> Sampling:
    return Sampling(max_tokens=n, ignore_eos=True)


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


class Reference:
    """The model alone, greedy: `reference(prompt_ids, n)` is the text a server must return for
    the prompt; it stops at EOS (unless the model's EOS is disabled, as for `ignore_eos`).

    Generating n tokens costs n forward passes, and the suite's references once took 140 s of a
    624 s run. A test that has the server's text passes it as `draft`: one forward pass over
    prompt + draft gives the model's next-token logits at every position, and where each
    position's greedy token is the draft's with a lead over the runner-up of at least
    `margin`, step-by-step greedy decoding picks the same tokens. The whole-sequence and the
    step-by-step logits differ by ~1e-4 (fp32; `tests/runtime/test_reference.py` measures it
    against this margin), so no lead of `margin` can flip. Any other draft (a wrong token, a
    near-tie, a text that does not tokenize back to what was generated) is answered by
    generating, as without one. The answer never depends on the draft, only its cost does."""

    def __init__(self, model: torch.nn.Module, tokenizer, margin: float = 2e-3) -> None:
        self.model, self.tokenizer, self.margin = model, tokenizer, margin
        eos = model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
        self.verified = self.generated = 0  # how each answer was reached

    def __call__(self, prompt_ids: list[int], max_tokens: int, draft: str | None = None) -> str:
        tokens = self.verify(prompt_ids, max_tokens, draft) if draft is not None else None
        if tokens is None:
            tokens = reference_generate(self.model, prompt_ids, max_tokens)
            self.generated += 1
        else:
            self.verified += 1
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def verify(self, prompt_ids: list[int], max_tokens: int, draft: str) -> list[int] | None:
        """The draft's tokens (EOS appended where generation stops there) if greedy generation
        of `max_tokens` would produce exactly them; None when that is not shown."""
        return self.verify_tokens(prompt_ids, max_tokens, self.tokenizer(draft, add_special_tokens=False)["input_ids"])

    @torch.inference_mode()
    def verify_tokens(self, prompt_ids: list[int], max_tokens: int, tokens: list[int]) -> list[int] | None:
        """`verify` for a draft of token ids (no tokenizer needed)."""
        if not 0 < len(tokens) <= max_tokens or self.eos & set(tokens):
            return None
        stops = len(tokens) < max_tokens  # then the next token must be EOS
        if stops and not self.eos:
            return None
        ids = torch.tensor([[*prompt_ids, *tokens]])
        logits = self.model(ids, use_cache=False, logits_to_keep=len(tokens) + 1).logits[0]
        top = logits.topk(2, dim=-1)  # row i predicts generated token i
        greedy, lead = top.indices[:, 0].tolist(), (top.values[:, 0] - top.values[:, 1]).tolist()
        n = len(tokens) + stops
        if min(lead[:n]) < self.margin or greedy[: len(tokens)] != tokens:
            return None
        if stops and greedy[len(tokens)] not in self.eos:
            return None
        return tokens + greedy[len(tokens) : n]


async def until(predicate: Callable[[], object], timeout: float = 10.0, what: str = "the condition") -> None:
    """Poll `predicate` (a plain or an async callable) on the running event loop until true;
    fail the test after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout

    async def holds() -> object:
        result = predicate()
        return await result if inspect.isawaitable(result) else result

    while not await holds():
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        await asyncio.sleep(0.002)
