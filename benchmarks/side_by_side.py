"""Two clusters that differ in one setting, measured side by side (benchmarks/stream_kv.py,
benchmarks/idle_cores.py): the same fresh prompts, one request at a time, to each in turn.

- `measure`: waits for both clusters, runs `rounds`, and stops both.
- `rounds`: each round sends one greedy streamed completion per pipeline, forced through it
  (`pdd.pipeline`), to each cluster, on a fresh random prompt of token ids that both get; which
  cluster goes first alternates from round to round. Client side, per request (`one`): TTFT, the
  second text chunk, E2E, TPOT (the mean gap from the second chunk to the last) and the text.
- `table`: per pipeline and setting, median [min..max] over rounds of the chosen figures.
"""

from __future__ import annotations

import json
import random
import statistics
import time

import httpx

Samples = dict[tuple[bool, str], list[dict]]  # (setting, pipeline) -> one dict per round


def fresh(n: int, seed: int) -> list[int]:
    """A prompt no cache holds: token ids under 32,000 (in any Llama- or Qwen-family vocabulary)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 32_000) for _ in range(n)]


async def one(url: str, model: str, prompt: list[int], pipeline: str, tokens: int) -> dict:
    """One streamed completion: client-side arrival times of its text (ms from the send), and the text."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "pdd": {"pipeline": pipeline},
    }
    arrivals: list[float] = []
    text = []
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=300) as client:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    arrivals.append((time.perf_counter() - t0) * 1000)
                    text.append(chunk["choices"][0]["text"])
    if len(arrivals) < 3:
        raise RuntimeError(f"{pipeline}: {len(arrivals)} text chunks came back")
    tpot = (arrivals[-1] - arrivals[1]) / (len(arrivals) - 2)  # the decoders' pace, past the first two
    return {"ttft": arrivals[0], "second": arrivals[1], "e2e": arrivals[-1], "tpot": tpot, "text": "".join(text)}


async def rounds(
    urls: dict[bool, str], model: str, pipelines: list[str], n: int, prompt: int, tokens: int, name: str
) -> Samples:
    got: Samples = {}
    for r in range(n):
        for pipeline in pipelines:
            prompt_ids = fresh(prompt, seed=1000 * r + pipelines.index(pipeline))
            for setting in (True, False) if r % 2 == 0 else (False, True):
                sample = await one(urls[setting], model, prompt_ids, pipeline, tokens)
                got.setdefault((setting, pipeline), []).append(sample)
        print(f"{name}: round {r + 1}/{n} done", flush=True)
    return got


async def measure(clusters: dict, pipelines: list[str], n: int, prompt: int, tokens: int, name: str) -> Samples:
    """`clusters`: setting -> a launched `Cluster`; both are stopped, whatever happens."""
    try:
        for c in clusters.values():
            c.wait_ready(300)
        model = httpx.get(clusters[True].url + "/v1/models").json()["data"][0]["id"]
        urls = {setting: c.url for setting, c in clusters.items()}
        return await rounds(urls, model, pipelines, n, prompt, tokens, name)
    finally:
        for c in clusters.values():
            c.stop()


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):7.0f} [{min(values):.0f}..{max(values):.0f}]"


def table(got: Samples, pipelines: list[str], setting: str, figures: dict[str, str]) -> None:
    """`figures`: column title -> the sample's key."""
    print(f"{'pipeline':10} {setting:10} " + " ".join(f"{title:>22}" for title in figures))
    for pipeline in pipelines:
        for value in (True, False):
            rows = got[(value, pipeline)]
            cells = [summary([x[k] for x in rows]) for k in figures.values()]
            print(f"{pipeline:10} {str(value).lower():10} " + " ".join(f"{c:>22}" for c in cells))
