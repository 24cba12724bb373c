"""What a served token costs beside the runtime's own step, on the shipped config, in one run.

    .venv/bin/python benchmarks/served_step.py [--rounds 6] [--tokens 64] [--prompt 128]
        [--pipelines p-md,p-rld] [--config configs/single-host.yaml]

It starts the shipped config the way `pdd up` does (`Cluster(...).start()`, pdd/launcher.py:
prefill float32, relay and main-decode bfloat16, `threads: auto`), and runs rounds. Each round:
1. one greedy streamed completion per pipeline, one at a time, forced through it (`pdd.pipeline`),
   `--tokens` output tokens (`ignore_eos`) on a fresh random prompt of `--prompt` token ids. The
   client's inter-token time (TPOT) is (last token's arrival - first's) / (tokens - 1). Around
   each request the decoding instance is inspected: its engine's busy time (the worker's sum of
   `Engine.step` wall time) over the steps taken is the engine step as served;
2. in this process, on the instance's own engine (`build_engine`, same model, dtype, threads and
   batch-invariant kernels), one prompt of the same length: `runtime_decode_step` (the runner's
   forward and an argmax) for as many steps as the request decoded, then `Engine.step` alone
   (scheduling, sampling, stop rules) over as many, both at batch 1 and the same context.
Rounds alternate served and runtime work, so a stall of a shared machine slows both alike.

Printed per pipeline, ms per token, median [min..max] over rounds:
- `runtime step`: runner forward + argmax, this process (the issue's denominator);
- `engine step (bench)`: `Engine.step`, this process, nothing else running;
- `engine step (served)`: `Engine.step` inside the instance, beside its event loop and the cluster;
- `served TPOT`: at the client; the rest of each token (the loop between steps, the hand-off to
  the event loop, NATS, the gateway) is what TPOT adds to the served engine step;
and the ratio served TPOT / runtime step, median over rounds of each round's ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.runtime_common import new_sequence, random_tokens, release, runtime_decode_step  # noqa: E402
from pdd.launcher import Cluster  # noqa: E402
from shared import subjects  # noqa: E402
from shared.bus import Bus  # noqa: E402
from shared.messages import Inspect, InstanceState, Sampling  # noqa: E402
from shared.pipelines import Pipeline, Role  # noqa: E402
from shared.runtime.build import build_engine  # noqa: E402
from shared.runtime.engine import Engine  # noqa: E402
from shared.runtime.sequence import Sequence  # noqa: E402

SHIPPED = REPO / "configs" / "single-host.yaml"
DECODER = {Pipeline.P_MD: Role.MD, Pipeline.P_RLD: Role.RLD}  # the role whose engine decodes the pipeline's tokens


def log(msg: str) -> None:
    print(f"[served] {msg}", file=sys.stderr, flush=True)


def inspect(cluster: Cluster, instance_id: str) -> InstanceState:
    async def main() -> InstanceState:
        bus = await Bus.connect(cluster.nats_url(), "served-step", "operator", cluster.secrets)
        try:
            return await bus.request(subjects.inspect(instance_id), Inspect(instance_id), InstanceState, 5)
        finally:
            await bus.close()

    return asyncio.run(main())


def served(
    cluster: Cluster, pipeline: str, prompt: list[int], tokens: int, clock=lambda: {}
) -> tuple[float, float, int, dict[str, float]]:
    """One streamed greedy completion: client TPOT and median inter-token gap (ITL) in ms, output
    tokens, and what `clock()` counted from the first token's arrival to the last's."""
    body = {
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "pdd": {"pipeline": pipeline},
    }
    arrivals: list[float] = []
    clocks: list[dict[str, float]] = []
    n = 0
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{pipeline}: {event['error']}")
            if event.get("choices") and event["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
                if len(arrivals) == 1:  # only then and at the end: the client's reads share the cores
                    clocks.append(clock())
            if event.get("usage"):
                n = event["usage"]["completion_tokens"]
        clocks.append(clock())  # the last text event came just before the usage
    # an event may carry several tokens (the detokenizer holds back a partial character)
    if n != tokens or len(arrivals) < 2:
        raise RuntimeError(f"{pipeline}: {n} tokens in {len(arrivals)} events, asked for {tokens}")
    itl = statistics.median(b - a for a, b in zip(arrivals, arrivals[1:])) * 1000
    cpu = {k: v - clocks[0][k] for k, v in clocks[-1].items()}
    return (arrivals[-1] - arrivals[0]) * 1000 / (n - 1), itl, n, cpu


def cpu_ms(pid: int, tid: int | None = None) -> float:
    """CPU time (user + system) a process, or one of its threads, has used; 0 once gone."""
    path = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    try:
        fields = Path(path).read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def cpu_clock(cluster: Cluster, decoder: str) -> dict[str, float]:
    """CPU ms so far of every process of the cluster and of the decoder's threads: its event loop
    (the main thread) and its busiest other thread (the engine's)."""
    pids = {n: p.pid for n, p in cluster.procs.items()} | cluster.server_pids()
    out = {f"cpu {name}": cpu_ms(pid) for name, pid in pids.items()}
    pid = pids[decoder]
    threads = {int(t): cpu_ms(pid, int(t)) for t in os.listdir(f"/proc/{pid}/task")}
    out[f"cpu {decoder} loop thread"] = threads.pop(pid)
    out[f"cpu {decoder} engine thread"] = max(threads.values())
    return out


def served_round(cluster: Cluster, instance_id: str, pipeline: str, prompt: list[int], tokens: int) -> dict:
    before = inspect(cluster, instance_id).figures.engine
    tpot, itl, n, cpu = served(cluster, pipeline, prompt, tokens, lambda: cpu_clock(cluster, instance_id))
    after = inspect(cluster, instance_id).figures.engine
    # the decoder's steps: its first token is prefill's, so n - 1 decode steps (one a prompt's
    # last token, recomputed on admission, may join the first: counted as a step all the same)
    step = (after.busy_s - before.busy_s) * 1000 / max(n - 1, 1)
    return {"served_tpot": tpot, "served_itl": itl, "served_step": step} | {k: v / (n - 1) for k, v in cpu.items()}


class RuntimeSide:
    """The instance's own engine, built here as the instance builds it, at its thread count."""

    def __init__(self, cluster: Cluster, instance_id: str) -> None:
        inst = next(i for i in cluster.cfg.instances if i.id == instance_id)
        self.threads = cluster.cfg.threads_of(inst)
        self.engine: Engine = build_engine(cluster.cfg, inst)
        self.dtype = inst.dtype

    def round(self, prompt: list[int], steps: int) -> dict:
        torch.set_num_threads(self.threads)
        runner, pool = self.engine.runner, self.engine.pool
        seq = new_sequence(pool, "rt", prompt, len(prompt) + steps + 1)
        try:
            runner.forward([(seq, len(prompt))])  # the prompt's KV, as imported from prefill
            seq.num_computed = len(prompt)
            seq.token_ids.append(prompt[-1])
            t0, cpu0 = time.perf_counter(), time.thread_time()
            for _ in range(steps):
                runtime_decode_step(runner, [seq])
            runtime = (time.perf_counter() - t0) * 1000 / steps
            cpu = (time.thread_time() - cpu0) * 1000 / steps
        finally:
            release(pool, [seq])
        return {"runtime_step": runtime, "runtime_step_cpu": cpu, "engine_step": self._engine_steps(prompt, steps)}

    def _engine_steps(self, prompt: list[int], steps: int) -> float:
        """`Engine.step` at batch 1 over `steps` decode steps after the prompt's own step."""
        engine = self.engine
        params = Sampling(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
        engine.add(Sequence(f"eng-{uuid.uuid4().hex[:8]}", list(prompt), params))
        engine.step()  # admission and the prompt
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        ms = (time.perf_counter() - t0) * 1000 / steps
        while engine.has_work:
            engine.step()
        return ms


def figure(values: list[float]) -> str:
    return f"{statistics.median(values):7.2f} [{min(values):.2f}..{max(values):.2f}]"


def report(pipeline: str, instance_id: str, threads: int, dtype: str, rounds: list[dict]) -> None:
    print(f"\n{pipeline} ({instance_id}, {dtype}, {threads} thread(s)), {len(rounds)} rounds, ms per token:")
    for key, label in (
        ("runtime_step", "runtime step (runner forward + argmax, bench)"),
        ("engine_step", "engine step (Engine.step, bench)"),
        ("served_step", "engine step (Engine.step, served)"),
        ("served_tpot", "served TPOT (client)"),
        ("served_itl", "served ITL, median gap (client)"),
    ):
        print(f"  {label:<48} {figure([r[key] for r in rounds])}")
    for key, label in (("served_tpot", "served TPOT / runtime step"), ("served_itl", "served ITL / runtime step")):
        print(f"  {label:<48} {figure([r[key] / r['runtime_step'] for r in rounds])}")
    gaps = [r["served_tpot"] - r["served_step"] for r in rounds]
    print(f"  {'served TPOT - served engine step':<48} {figure(gaps)}")
    print(f"  {'runtime step, CPU time of its thread (bench)':<48} {figure([r['runtime_step_cpu'] for r in rounds])}")
    print("  CPU ms per served token (first token's arrival to the last's, over the tokens between):")
    for key in sorted((k for k in rounds[0] if k.startswith("cpu ")), key=lambda k: -rounds[0][k]):
        print(f"    {key[4:]:<46} {figure([r[key] for r in rounds])}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(SHIPPED))
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt", type=int, default=128, help="prompt length in token ids")
    p.add_argument("--pipelines", default="p-md,p-rld")
    p.add_argument("--json", default=None, help="write every round's figures here")
    args = p.parse_args(argv)
    pipelines = args.pipelines.split(",")
    log("starting the cluster")
    with Cluster(args.config, log=lambda m: None, port=0) as cluster:
        ids = {pl: next(i.id for i in cluster.cfg.instances if i.role == DECODER[pl]) for pl in pipelines}
        sides = {pl: RuntimeSide(cluster, ids[pl]) for pl in pipelines}
        vocab = sides[pipelines[0]].engine.runner.model.config.vocab_size
        rounds: dict[str, list[dict]] = {pl: [] for pl in pipelines}
        for r in range(args.rounds + 1):  # round 0 warms every path up and is not counted
            for pl in pipelines:
                prompt = random_tokens(args.prompt, vocab, seed=1000 * r + len(pl))
                figures = served_round(cluster, ids[pl], pl, prompt, args.tokens)
                figures |= sides[pl].round(random_tokens(args.prompt, vocab, seed=7 + r), args.tokens - 1)
                log(f"round {r} {pl}: " + ", ".join(f"{k} {v:.2f}" for k, v in figures.items()))
                if r:
                    rounds[pl].append(figures)
    print(f"\nhost: {_cpu()}, {len(os.sched_getaffinity(0))} cores")
    for pl in pipelines:
        report(pl, ids[pl], sides[pl].threads, sides[pl].dtype, rounds[pl])
    if args.json:
        Path(args.json).write_text(json.dumps(rounds, indent=1))
    return 0


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
