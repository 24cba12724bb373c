"""Benchmark modes: PDD and its baselines. The one table of what each mode means (`MODE_TABLE`),
read by `pdd bench` (cluster configs for the one launcher, `mode_config`), the summary (which
fleet pays a WAN line) and the simulator (sim/config.py: which instances, where, planned how).

Every mode runs the same model, the same WAN settings and the same count of prefill and final
decoder instances; only the feature under test differs.

    mode         main-decode  DRC  relay  pipeline  handoff  1st token  warm  stream  what it is
    pd-local     A            yes  no     p-md      -        prefill    yes    no     P and D in one datacenter, no
                                                                                      WAN: the floor
    pd-wan       B            no   no     p-md      -        decoder    no    no      naive cross-DC PD: the full KV
                                                                                      of every request crosses the
                                                                                      WAN before a token
    pd-wan-drc   B            yes  no     p-md      -        decoder    no    no      cross-DC PD with the decode-
                                                                                      side cache
    pdd          B            yes  yes    auto      auto     prefill    yes    no     everything: the scheduler
                                                                                      chooses both
    pdd-oneshot  B            yes  yes    auto      oneshot  prefill    yes    no     PDD, every handoff one-shot
    pdd-catchup  B            yes  yes    auto      catchup  prefill    yes    no     PDD, every handoff catch-up
    pdd-push     B            yes  yes    auto      auto     prefill    yes    no     PDD, every suffix's KV pushed
    pdd-stream   B            yes  yes    auto      auto     prefill    yes   yes     PDD, KV streamed while prefill
                                                                                      runs
    pdd-own-cores B           yes  yes    auto      auto     prefill    yes    no     PDD, no idle core lent
    pdd-no-layers B           yes  yes    auto      auto     prefill    yes    no     PDD, no prompt's KV sent layer
                                                                                      by layer during its forward

"1st token" is who streams it (`first_token` in the cluster config): prefill the moment it is
sampled, or the decoder once the KV arrived, as naive cross-DC PD does. "warm" is whether a
finished request's answer is computed into prefill's cache (`warm_prefill`): the floor has it
too, so that pdd against pd-local measures what the line costs, not what a cache saves.
"stream" is whether prefill pushes a long prompt's KV chunk by chunk as it computes it
(`stream_kv`, off by default: on a CPU it costs TTFT), or whole after the first token: pdd-stream
against pdd measures what streaming saves and costs. Every mode but `pdd-push` and
the naive baselines lets main-decode compute a short suffix it lacks itself when that beats
pushing its KV (`md_suffix_max_tokens`; services/scheduler/policy.py): pdd against pdd-push
measures what that saves. Every PDD mode but `pdd-no-layers` sends a `p-md` prompt's KV of at
most `stream_layers_max_tokens` layer by layer while its forward runs (the naive baselines never
do): pdd against pdd-no-layers measures what that saves. Every mode but `pdd-own-cores` lets an
instance that steps while the host's others are idle take their cores (`lend_idle_cores`, shared/cores.py): pdd against
pdd-own-cores measures what that saves on a host the instances share.

This module is light (no torch, no matplotlib): `pdd --help` imports it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import yaml

from shared.config import DEFAULT_CONFIG
from shared.model_info import WireFormat
from shared.pipelines import Handoff, Pipeline, Role
from shared.policy_knobs import AUTO  # the scheduler decides

NATIVE = WireFormat.NATIVE.value  # plain data: the mode configs go through YAML


@dataclass(frozen=True)
class Mode:
    name: str
    md_dc: str  # where main-decode runs: "A" (prefill's datacenter, no WAN) or "B"
    drc: bool  # main-decode keeps a radix cache of what it has seen
    relay: bool  # a relay-decode pool exists in datacenter A
    pipeline: str  # the scheduler's default_pipeline: AUTO or a pinned Pipeline
    handoff: str  # the scheduler's default_handoff: AUTO or a pinned Handoff
    first_token: str = Role.PREFILL.value  # who streams it (ClusterConfig.first_token)
    warm_prefill: bool = True  # ClusterConfig.warm_prefill
    stream_kv: bool = False  # ClusterConfig.stream_kv
    md_suffix: bool = True  # main-decode may compute a short suffix itself (False: scheduler.md_suffix_max_tokens 0)
    lend_cores: bool = True  # ClusterConfig.lend_idle_cores
    by_layer: bool = True  # a short p-md prompt's KV goes layer by layer (False: stream_layers_max_tokens 0)

    @property
    def wan(self) -> bool:
        """Whether main-decode sits across the line (and the fleet pays for one)."""
        return self.md_dc != "A"


P_MD, ONESHOT, CATCHUP = Pipeline.P_MD.value, Handoff.ONESHOT.value, Handoff.CATCHUP.value
# the naive cross-DC baselines
NAIVE = {"first_token": "decoder", "warm_prefill": False, "md_suffix": False, "by_layer": False}
MODE_TABLE: dict[str, Mode] = {
    m.name: m
    for m in (
        Mode("pd-local", md_dc="A", drc=True, relay=False, pipeline=P_MD, handoff=ONESHOT),
        Mode("pd-wan", md_dc="B", drc=False, relay=False, pipeline=P_MD, handoff=ONESHOT, **NAIVE),
        Mode("pd-wan-drc", md_dc="B", drc=True, relay=False, pipeline=P_MD, handoff=ONESHOT, **NAIVE),
        Mode("pdd", md_dc="B", drc=True, relay=True, pipeline=AUTO, handoff=AUTO),
        Mode("pdd-oneshot", md_dc="B", drc=True, relay=True, pipeline=AUTO, handoff=ONESHOT),
        Mode("pdd-catchup", md_dc="B", drc=True, relay=True, pipeline=AUTO, handoff=CATCHUP),
        Mode("pdd-push", md_dc="B", drc=True, relay=True, pipeline=AUTO, handoff=AUTO, md_suffix=False),
        Mode("pdd-stream", md_dc="B", drc=True, relay=True, pipeline=AUTO, handoff=AUTO, stream_kv=True),
        Mode("pdd-own-cores", md_dc="B", drc=True, relay=True, pipeline=AUTO, handoff=AUTO, lend_cores=False),
        Mode("pdd-no-layers", md_dc="B", drc=True, relay=True, pipeline=AUTO, handoff=AUTO, by_layer=False),
    )
}
MODES: tuple[str, ...] = tuple(MODE_TABLE)
LOCAL_MODE = "pd-local"  # the only mode whose decode runs on chip A in datacenter A, with no WAN line

# Where an uncached agentic prompt's fp32 KV (20-70 MB) takes seconds to cross.
BENCH_WAN = {"bandwidth_mbps": 200.0, "delay_ms": 20.0, "jitter_ms": 5.0}
SLO_TTFT_MS = 2000.0  # for a 2-core CPU running SmolLM2; the scheduler plans against the same SLO
RLD_KV_TOKENS = 16384  # the relay's pool: half of the others'


def mode(name: str) -> Mode:
    """The mode called `name`; ValueError naming the modes otherwise."""
    if name not in MODE_TABLE:
        raise ValueError(f"unknown mode {name!r}; modes: {', '.join(MODES)}")
    return MODE_TABLE[name]


def parse_modes(spec: str) -> list[str]:
    """'pd-wan, pdd' -> ['pd-wan', 'pdd']; ValueError naming any unknown mode."""
    modes = [m.strip() for m in spec.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODE_TABLE]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; known: {', '.join(MODES)}")
    return modes


def _instance(iid: str, role: str, dc: str, **extra: Any) -> dict[str, Any]:
    return {"id": iid, "role": role, "dc": dc, "dtype": "float32", "threads": "auto", "kv_tokens": 32768, **extra}


def mode_config(
    name: str, base: dict[str, Any] | None = None, kv_wire: str = NATIVE, decode_dtype: str = "float32"
) -> dict[str, Any]:
    """The cluster config (plain data) for a mode, on top of `base` (a cluster YAML's content;
    default: configs/single-host.yaml with the bench's WAN). `kv_wire` applies to the relay modes
    (PDD's own; the baselines send their KV native); `decode_dtype` to the relay and main-decode."""
    m = mode(name)
    if base is None:
        with open(DEFAULT_CONFIG) as f:
            cfg = yaml.safe_load(f)
        cfg["wan"] = {**cfg.get("wan", {}), **BENCH_WAN}
    else:
        cfg = copy.deepcopy(base)
        cfg["wan"] = cfg.get("wan", {})
    instances = [
        _instance("prefill-0", Role.PREFILL.value, "A"),
        _instance("md-0", Role.MD.value, m.md_dc, prefix_cache=m.drc, dtype=decode_dtype),
    ]
    if m.relay:
        instances.insert(1, _instance("rld-0", Role.RLD.value, "A", kv_tokens=RLD_KV_TOKENS, dtype=decode_dtype))
    cfg["instances"] = instances
    cfg["scheduler"] = {
        **cfg.get("scheduler", {}),
        "default_pipeline": m.pipeline,
        "default_handoff": m.handoff,
        "ttft_slo_ms": SLO_TTFT_MS,
        "wan_mbps": cfg["wan"]["bandwidth_mbps"],
        "kv_wire": kv_wire if m.relay else NATIVE,
        **({} if m.md_suffix else {"md_suffix_max_tokens": 0}),
    }
    cfg["first_token"] = m.first_token
    cfg["warm_prefill"] = m.warm_prefill
    cfg["stream_kv"] = m.stream_kv
    cfg["lend_idle_cores"] = m.lend_cores
    if not m.by_layer:
        cfg["stream_layers_max_tokens"] = 0
    cfg["port"] = 0
    cfg["max_queue"] = max(cfg.get("max_queue", 64), 256)
    return cfg


def instance_counts(cfg: dict[str, Any]) -> dict[str, int]:
    counts = dict.fromkeys(Role, 0)
    for inst in cfg["instances"]:
        counts[inst["role"]] += 1
    return counts
