"""Benchmark modes: PDD and its baselines as cluster configs for the one launcher.

Every mode runs the same model, the same WAN settings and the same count of prefill and final
decoder instances; only the feature under test differs.

    pd-local     P and D in one datacenter, no WAN at all: the floor
    pd-wan       naive cross-DC PD: the full KV of every request over the WAN, no RLD, no DRC
    pd-wan-drc   cross-DC PD with the decode-side RadixCache, no RLD
    pdd          everything: RLD, DRC, the scheduler's own choice of pipeline and handoff
    pdd-oneshot  PDD with every handoff one-shot
    pdd-catchup  PDD with every handoff catch-up
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from benchmarks.args import MODES
from shared.config import DEFAULT_CONFIG

# Where an uncached agentic prompt's fp32 KV (20-70 MB) takes seconds to cross.
BENCH_WAN = {"bandwidth_mbps": 200.0, "delay_ms": 20.0, "jitter_ms": 5.0}
SLO_TTFT_MS = 2000.0  # for a 2-core CPU running SmolLM2; the scheduler plans against the same SLO


def _instance(iid: str, role: str, dc: str, **extra: Any) -> dict[str, Any]:
    return {"id": iid, "role": role, "dc": dc, "dtype": "float32", "threads": 1, "kv_tokens": 32768, **extra}


def mode_config(mode: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The cluster config (plain data) for a mode, on top of `base` (a cluster YAML's content)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; modes: {', '.join(MODES)}")
    cfg = copy.deepcopy(base if base is not None else yaml.safe_load(Path(DEFAULT_CONFIG).read_text()))
    cfg["wan"] = {**cfg.get("wan", {}), **BENCH_WAN} if base is None else cfg.get("wan", {})
    md_dc = "A" if mode == "pd-local" else "B"
    instances = [_instance("prefill-0", "prefill", "A"),
                 _instance("md-0", "md", md_dc, prefix_cache=mode != "pd-wan")]  # fmt: skip
    scheduler = {"default_pipeline": "p-md", "default_handoff": "oneshot"}
    if mode.startswith("pdd"):
        instances.insert(1, _instance("rld-0", "rld", "A", kv_tokens=16384))
        handoff = {"pdd": "auto", "pdd-oneshot": "oneshot", "pdd-catchup": "catchup"}[mode]
        scheduler = {"default_pipeline": "auto", "default_handoff": handoff}
    cfg["instances"] = instances
    cfg["scheduler"] = {**cfg.get("scheduler", {}), **scheduler, "ttft_slo_ms": SLO_TTFT_MS,
                        "wan_mbps": cfg["wan"]["bandwidth_mbps"]}  # fmt: skip
    cfg["port"] = 0
    cfg["max_queue"] = max(cfg.get("max_queue", 64), 256)
    return cfg


def instance_counts(cfg: dict[str, Any]) -> dict[str, int]:
    counts = {"prefill": 0, "rld": 0, "md": 0}
    for inst in cfg["instances"]:
        counts[inst["role"]] += 1
    return counts


def md_in_other_dc(cfg: dict[str, Any]) -> bool:
    dcs = {i["role"]: i["dc"] for i in cfg["instances"]}
    return dcs["md"] != dcs["prefill"]
