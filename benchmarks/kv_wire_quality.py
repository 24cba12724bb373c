"""How much each KV wire format changes what the model says (a benchmark, not a test).

    .venv/bin/python -m benchmarks.kv_wire_quality [--prompts 50] [--tokens 64] [--decode-dtype bfloat16]

For each prompt (paragraphs of this repository's own docs), prefill runs once in float32 (the
prefill role's precision); its KV then travels in each wire format, is restored into a
decode pool of `--decode-dtype` and decoded greedily for `--tokens` tokens, as main-decode
would. Against the native path: the share of identical outputs and the mean position of the
first divergence (`--tokens` when identical). Perplexity: a held-out text's first half is
prefilled, its KV round-tripped through each format, and the second half scored with that KV
(teacher forcing, the stock transformers forward over the restored cache). Also prints each
format's bytes per token on the wire. Writes a markdown table (and --json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from pathlib import Path

import torch
from transformers import DynamicCache

from shared.messages import Sampling
from shared.model_info import WIRE_FORMATS, load_model_info
from shared.runtime.engine import Engine
from shared.runtime.kv_payload import KVPayload, export_kv, import_kv, layer_from_bytes, layer_to_bytes
from shared.runtime.models import load_model, load_tokenizer
from shared.runtime.provision import provision_default_model
from shared.runtime.sequence import Sequence

ROOT = Path(__file__).resolve().parent.parent


def paragraphs(n: int, tokenizer, min_tokens: int = 48) -> list[list[int]]:
    """Prose from the repository's docs, one prompt per paragraph of enough tokens."""
    texts = [
        p.strip()
        for f in sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
        for p in re.split(r"\n\s*\n", f.read_text())
        if len(p) > 200 and not p.lstrip().startswith(("|", "```"))
    ]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"][:160] for t in texts]
    return [i for i in ids if len(i) >= min_tokens][:n]


def round_trip(payload: KVPayload, wire: str) -> KVPayload:
    header = dataclasses.replace(payload.header, wire=wire)
    return KVPayload(header, [layer_from_bytes(header, layer_to_bytes(k, v, wire)) for k, v in payload.layers])


def prefill(engine: Engine, prompts: list[list[int]]) -> list[tuple[int, KVPayload]]:
    for i, p in enumerate(prompts):
        engine.add(Sequence(f"p{i}", list(p), Sampling(max_tokens=1, ignore_eos=True), hold_kv=True, max_new=1))
    first: dict[str, int] = {}
    while engine.has_work:
        first |= {o.seq_id: o.token_id for o in engine.step() if o.token_id is not None}
    out = []
    for i, p in enumerate(prompts):
        out.append((first[f"p{i}"], export_kv(engine.pool, engine.held[f"p{i}"].block_table, 0, len(p))))
        engine.release(f"p{i}")
    return out


def decode(engine: Engine, prompts: list[list[int]], prefilled, wire: str, n: int) -> list[list[int]]:
    for i, (p, (first, payload)) in enumerate(zip(prompts, prefilled)):
        seq = Sequence(f"d{i}", [*p, first], Sampling(max_tokens=n, ignore_eos=True), prompt_len=len(p))
        seq.block_table = engine.allocate(engine.pool.blocks_for(len(p) + n))
        import_kv(engine.pool, seq.block_table, round_trip(payload, wire))
        seq.num_computed = len(p)
        engine.add(seq)
    out: dict[str, list[int]] = {f"d{i}": [prefilled[i][0]] for i in range(len(prompts))}
    while engine.has_work:
        for o in engine.step():
            if o.token_id is not None:
                out[o.seq_id].append(o.token_id)
    return [out[f"d{i}"][:n] for i in range(len(prompts))]


def perplexity(model, engine: Engine, ids: list[int], wire: str) -> float:
    half = len(ids) // 2
    [(_, payload)] = prefill(engine, [ids[:half]])
    kv = round_trip(payload, wire)
    cache = DynamicCache()
    for layer, (k, v) in enumerate(kv.layers):  # ours are [tokens, heads, dim]; HF wants [1, heads, tokens, dim]
        cache.update(
            k.float().transpose(0, 1)[None].to(model.dtype), v.float().transpose(0, 1)[None].to(model.dtype), layer
        )
    with torch.inference_mode():
        logits = (
            model(
                torch.tensor([ids[half - 1 : -1]]),
                past_key_values=cache,
                position_ids=torch.arange(half - 1, len(ids) - 1)[None],
            )
            .logits[0]
            .float()
        )
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[half:]))
    return math.exp(float(nll))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=50)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--decode-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    torch.set_num_threads(2)
    folder = provision_default_model()
    tokenizer, info = load_tokenizer(folder), load_model_info("default")
    prefill_model, decode_model = load_model(folder, "float32"), load_model(folder, a.decode_dtype)
    prompts = paragraphs(a.prompts, tokenizer)
    prefilled = prefill(Engine.for_model(prefill_model, 2048, max_running=64), prompts)
    held_out = tokenizer((ROOT / "docs" / "deploy.md").read_text(), add_special_tokens=False)["input_ids"][:1024]
    hf = load_model(folder, a.decode_dtype)
    hf.set_attn_implementation("sdpa")
    rows, native = [], None
    for wire in WIRE_FORMATS:
        print(f"kv_wire_quality: {wire}", file=sys.stderr, flush=True)
        outs = decode(Engine.for_model(decode_model, 2048, max_running=64), prompts, prefilled, wire, a.tokens)
        native = native or outs
        firsts = [next((j for j, (x, y) in enumerate(zip(o, r)) if x != y), a.tokens) for o, r in zip(outs, native)]
        ppl = perplexity(hf, Engine.for_model(prefill_model, 256), held_out, wire)
        rows.append(
            {
                "wire": wire,
                "bytes_per_token": info.kv_bytes_per_token("float32", wire),
                "identical": sum(f == a.tokens for f in firsts) / len(firsts),
                "mean_first_divergence": sum(firsts) / len(firsts),
                "perplexity": ppl,
            }
        )
    print(table(rows, len(prompts), a))
    if a.json:
        Path(a.json).write_text(json.dumps({"prompts": len(prompts), "tokens": a.tokens, "rows": rows}, indent=2))
    return 0


def table(rows: list[dict], n: int, a) -> str:
    native = rows[0]
    out = [
        f"{n} prompts x {a.tokens} greedy tokens; prefill float32, decode {a.decode_dtype}",
        "",
        "| wire | bytes/token | vs native | identical outputs | mean first divergence | perplexity |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['wire']} | {r['bytes_per_token']:,} | {r['bytes_per_token'] / native['bytes_per_token']:.2f}x "
            f"| {r['identical']:.0%} | {r['mean_first_divergence']:.1f} | {r['perplexity']:.3f} |"
        )
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
