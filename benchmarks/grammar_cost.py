"""`pdd bench grammar`: what constrained decoding costs, and whom.

On the real model, one engine (the runtime's batch-invariant kernels), a batch of `--batch`
greedy chat requests decoding `--tokens` tokens, run twice side by side in each of `--reps`:
  plain: no row has a grammar;
  mixed: half the rows answer under a JSON schema (nested object, enums, an array).
Prints the decode step of each (every row of a step waits for all of it, so the step is the
TPOT of the unconstrained rows too) and their ratio, the mask's own cost per constrained token
(llguidance's mask and the ids it is fed, computed on the grammar thread while the step's
forward runs; applying it to a row, ~0.1 ms, only where the argmax is not allowed), and whether
the unconstrained rows produced the same tokens in both runs (a mask touches only its own row).
"""

from __future__ import annotations

import argparse
import statistics
import time

import llguidance
import torch

from shared.messages import Sampling
from shared.runtime import engine as engine_module
from shared.runtime.engine import Engine
from shared.runtime.grammar import Grammars
from shared.runtime.models import load_model, load_tokenizer
from shared.runtime.provision import provision_default_model
from shared.runtime.sequence import Sequence

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "array", "items": {"type": "integer", "maximum": 99}, "minItems": 7, "maxItems": 7},
        "wind": {"type": "object", "properties": {"speed": {"type": "integer"}}, "required": ["speed"]},
    },
    "required": ["city", "unit", "days", "wind"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "},
}
QUESTIONS = ["What is the weather in Paris this week?", "Describe the weather in Oslo.", "Weather in Rome?"]


class _Timed:
    """Wraps the engine's grammar masks to time them: on the grammar thread, while the forward
    runs (`prefetch`), and on the engine thread for rows not prefetched (`masks`)."""

    def __init__(self, grammars: Grammars) -> None:
        self.inner, self.seconds, self.rows = grammars, 0.0, 0

    def prefetch(self, seqs):
        return self.inner._worker.submit(self._timed, [s for s in seqs if s.params.grammar], None)

    def masks(self, seqs, ready=None):
        return self._timed(seqs, ready)

    def _timed(self, seqs, ready):
        start = time.perf_counter()
        out = self.inner.masks(seqs, ready)
        self.seconds += time.perf_counter() - start
        self.rows += len(out[0]) - (len(ready[0]) if ready else 0)
        return out

    def __getattr__(self, name):
        return getattr(self.inner, name)


class _EngineThread:
    """The engine thread's time in the grammar's part of each step: collecting the masks (their
    wait, if the grammar thread is not done when the forward is) and sampling (masks applied)."""

    def __init__(self) -> None:
        self.seconds, self.steps = 0.0, 0
        self._sample = engine_module.sample_batch  # the engine's, timed by `sample_batch`

    def watch(self, engine: Engine) -> Engine:
        masks = engine._masks

        def timed_masks(*args):
            start = time.perf_counter()
            out = masks(*args)
            self.seconds += time.perf_counter() - start
            return out

        engine._masks = timed_masks
        return engine

    def sample_batch(self, *args, **kwargs):
        start = time.perf_counter()
        out = self._sample(*args, **kwargs)
        self.seconds += time.perf_counter() - start
        self.steps += 1
        return out

    def per_step_ms(self) -> float:
        ms = self.seconds / max(self.steps, 1) * 1e3
        self.seconds, self.steps = 0.0, 0
        return ms


def _run(engine: Engine, prompts: list[list[int]], tokens: int, constrained: set[int], grammar: str):
    for i, p in enumerate(prompts):
        grammar_i = grammar if i in constrained else ""
        engine.add(Sequence(f"r{i}", list(p), Sampling(max_tokens=tokens, ignore_eos=True, grammar=grammar_i)))
    out: dict[str, list[int]] = {}
    steps: list[float] = []
    while engine.has_work:
        full = len(engine.running) == len(prompts)  # every row decoding (the prompts' step aside)
        start = time.perf_counter()
        outputs = engine.step()
        if full and len(engine.running) == len(prompts):
            steps.append(time.perf_counter() - start)
        for o in outputs:
            if o.token_id is not None:
                out.setdefault(o.seq_id, []).append(o.token_id)
    return steps, out


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    path = provision_default_model()
    model, tok = load_model(path), load_tokenizer(path)
    grammars = _Timed(Grammars(path / "tokenizer.json", model.config.vocab_size, (2,)))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    prompts = []
    for i in range(args.batch):
        text = tok.apply_chat_template(
            [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], tokenize=False, add_generation_prompt=True
        )
        prompts.append(tok.encode(text, add_special_tokens=False))
    half = set(range(0, args.batch, 2))
    plain_ms, mixed_ms, ratios, same = [], [], [], True
    thread = _EngineThread()
    engine_module.sample_batch = thread.sample_batch
    plain_path, mixed_path = [], []
    print(f"batch {args.batch} ({len(half)} under a JSON schema), {args.tokens} tokens, {args.threads} thread(s)")
    try:
        for rep in range(args.reps):  # side by side in each rep: the host's pace drifts between reps
            engine = Engine.for_model(model, 2048, eos_token_ids=(2,), grammars=grammars, invariant=True)
            steps, plain = _run(thread.watch(engine), prompts, args.tokens, set(), grammar)
            plain_ms.append(statistics.mean(steps) * 1e3)
            plain_path.append(thread.per_step_ms())
            engine = Engine.for_model(model, 2048, eos_token_ids=(2,), grammars=grammars, invariant=True)
            steps, mixed = _run(thread.watch(engine), prompts, args.tokens, half, grammar)
            mixed_ms.append(statistics.mean(steps) * 1e3)
            mixed_path.append(thread.per_step_ms())
            ratios.append(mixed_ms[-1] / plain_ms[-1])
            same &= all(mixed[f"r{i}"] == plain[f"r{i}"] for i in range(args.batch) if i not in half)
            print(f"  rep {rep + 1}: plain step {plain_ms[-1]:.1f} ms, mixed {mixed_ms[-1]:.1f} ms ({ratios[-1]:.3f}x)")
    finally:
        engine_module.sample_batch = thread._sample  # the engine's own again
    print(f"decode step (= TPOT of every row), plain batch: median {statistics.median(plain_ms):.2f} ms")
    print(f"decode step, half the rows constrained: median {statistics.median(mixed_ms):.2f} ms")
    print(f"mixed / plain, median of the reps: {statistics.median(ratios):.3f}x (the host's noise included)")
    plain_p, mixed_p = statistics.median(plain_path), statistics.median(mixed_path)
    print(
        f"engine thread, masks collected + sampling, per step: plain {plain_p:.3f} ms, mixed {mixed_p:.3f} ms: "
        f"the grammar adds {mixed_p - plain_p:.3f} ms to the step's critical path "
        f"({(mixed_p - plain_p) / statistics.median(plain_ms) * 100:.2f}% of the plain step)"
    )
    per_token = grammars.seconds / max(grammars.rows, 1) * 1e3
    print(f"grammar mask per constrained token: {per_token:.3f} ms ({grammars.rows} masks)")
    print(f"unconstrained rows' tokens identical in both runs: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    from benchmarks.args import add_handoff_arguments, micro_defaults

    parser = argparse.ArgumentParser(description=__doc__)
    add_handoff_arguments(parser)
    raise SystemExit(main(micro_defaults(parser.parse_args(), "grammar")))
