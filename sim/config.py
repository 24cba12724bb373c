"""A simulated deployment, read from one YAML file (configs/sim/*.yaml).

    profiles: [profiles.yaml, ...]   # chip profile files (relative to this file)
    chips: {A: <profile>, B: <profile>}   # datacenter A (prefill + RLD) and B (main-decode)
    roles: {rld: {kv_tokens: 16384}}      # per-role overrides of the chip profile
    wan: {bandwidth_mbps, delay_ms, jitter_ms, swing, low, period_s, step, seed, control_crosses,
          connect_rtts}                   # control_crosses (default true, as the real two-site
                                          # topology since 0dac70d): control messages between the
                                          # sites pay the line's delay (sim/pipeline.py);
                                          # connect_rtts (default 0): round trips a KV push across
                                          # spends opening its connection (TCP + TLS 1.3: 2)
    local: {mbps, delay_ms}               # in-DC KV path
    handoff: {chunk_tokens, final_tokens, warm_md_cache}
                                          # warm_md_cache (default true, as shared/config.py's): a request
                                          # the relay finishes still lands MD's KV, into its DRC only;
                                          # false: that KV is cancelled on the line (sim/pipeline.py)
    scheduler: {...}                      # the policy's knobs (shared/policy_knobs.py) and priors (local_mbps);
                                          # each mode pins its own pipeline
    fleets: {default: {prefill, rld, md}, <mode>: {...}}
    slo: {ttft_ms, tpot_ms}
    prices: {wan_line, wan_line_gbps}     # the line's price (for a line of that size); chips: the profiles
    host: {cores, background_cores, request_overhead_ms, cold_start_ms, interleave_prefill}
                                          # sim/host.py; absent: every instance on its own chip
    views: {heartbeat_s, measured}        # sim/views.py: what the scheduler sees; absent: live, measured

Modes mean what they mean in `pdd bench`: benchmarks/modes.py's `MODE_TABLE` says where MD runs
(pd-local: chip A in datacenter A, no WAN), whether it keeps a DRC (not in pd-wan), whether a
relay exists (the pdd modes) and what the scheduler pins. The scheduler's inputs are built by
services/scheduler/inputs.py, as the scheduler service builds them (`policy_config` here).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from benchmarks.modes import mode
from services.scheduler import inputs
from services.scheduler.policy import PolicyConfig
from shared.pipelines import Role
from sim.host import HostSpec
from sim.link import BandwidthSchedule
from sim.profiles import ChipProfile, load_profiles
from sim.views import ViewSpec

HANDOFF_KEYS = {"chunk_tokens", "final_tokens", "warm_md_cache"}


@dataclass(frozen=True)
class Group:
    role: Role
    dc: str
    profile: ChipProfile
    count: int
    prefix_cache: bool = True


@dataclass(frozen=True)
class SimConfig:
    profiles: dict[str, ChipProfile]
    chips: dict[str, str]
    wan: dict[str, Any]
    local: dict[str, Any] = field(default_factory=lambda: {"mbps": 10_000.0, "delay_ms": 0.05})
    handoff: dict[str, Any] = field(
        default_factory=lambda: {"chunk_tokens": 64, "final_tokens": 8, "warm_md_cache": True}
    )
    scheduler: dict[str, Any] = field(default_factory=dict)
    fleets: dict[str, dict[str, int]] = field(default_factory=dict)
    roles: dict[str, dict[str, Any]] = field(default_factory=dict)
    slo: dict[str, float] = field(default_factory=lambda: {"ttft_ms": 2000.0, "tpot_ms": 400.0})
    prices: dict[str, float] = field(default_factory=dict)
    drc: bool = True  # False: main-decode keeps no radix cache in any mode (an ablation)
    host: dict[str, Any] = field(default_factory=dict)
    views: dict[str, Any] = field(default_factory=dict)
    path: str = ""

    def chip(self, dc: str, role: Role) -> ChipProfile:
        name = self.chips[dc]
        if name not in self.profiles:
            raise ValueError(f"{self.path}: chips.{dc} = {name!r} is not a profile ({sorted(self.profiles)})")
        return dataclasses.replace(self.profiles[name], **self.roles.get(role, {}))

    def fleet(self, name: str) -> dict[str, int]:
        counts = {**dict.fromkeys(Role, 1), **self.fleets.get("default", {}), **self.fleets.get(name, {})}
        if not mode(name).relay:
            counts[Role.RLD] = 0
        return counts

    def groups(self, name: str) -> list[Group]:
        counts, m = self.fleet(name), mode(name)
        groups = [
            Group(Role.PREFILL, "A", self.chip("A", Role.PREFILL), counts[Role.PREFILL]),
            Group(Role.RLD, "A", self.chip("A", Role.RLD), counts[Role.RLD]),
            Group(Role.MD, m.md_dc, self.chip(m.md_dc, Role.MD), counts[Role.MD], prefix_cache=m.drc and self.drc),
        ]
        return [g for g in groups if g.count > 0]

    @property
    def warm_md_cache(self) -> bool:
        """handoff.warm_md_cache (default true, as the real HandoffConfig's)."""
        return bool(self.handoff.get("warm_md_cache", True))

    @property
    def control_delay_ms(self) -> float:
        """One-way delay a control message between the sites pays: the line's, when the NATS link
        crosses it (wan.control_crosses, default true), else none."""
        return float(self.wan.get("delay_ms", 0.0)) if self.wan.get("control_crosses", True) else 0.0

    @property
    def connect_ms(self) -> float:
        """What opening a KV push's connection across the line adds before its KV is usable:
        wan.connect_rtts round trips (default 0: not modelled, as the fleet experiments ran)."""
        return float(self.wan.get("connect_rtts", 0)) * 2 * float(self.wan.get("delay_ms", 0.0))

    def check_handoff(self) -> None:
        unknown = sorted(set(self.handoff) - HANDOFF_KEYS)
        if unknown:
            raise ValueError(f"{self.path}: unknown handoff key(s) {unknown} (known: {sorted(HANDOFF_KEYS)})")
        if not isinstance(self.handoff.get("warm_md_cache", True), bool):
            raise ValueError(f"{self.path}: handoff.warm_md_cache must be true or false")

    def host_spec(self) -> HostSpec:
        return HostSpec.from_dict(self.host)

    def view_spec(self) -> ViewSpec:
        return ViewSpec.from_dict(self.views)

    def bandwidth(self) -> BandwidthSchedule:
        w = self.wan
        return BandwidthSchedule(
            float(w["bandwidth_mbps"]),
            w.get("swing", "none"),
            float(w.get("low", 1.0)),
            float(w.get("period_s", 10.0)),
            float(w.get("step", 0.2)),
            int(w.get("seed", 0)),
        )

    def settings_prices(self) -> dict[str, float]:
        """Chip A's and B's hourly price (from their profiles) and the line's: `prices.wan_line` for a
        line of `prices.wan_line_gbps`, scaled to this line's capacity (flat when no size is given)."""
        line = float(self.prices.get("wan_line", 0.0))
        if "wan_line_gbps" in self.prices:
            line *= float(self.wan["bandwidth_mbps"]) / 1000.0 / float(self.prices["wan_line_gbps"])
        return {
            "chip_a": self.chip("A", Role.PREFILL).price_per_hour,
            "chip_b": self.chip("B", Role.MD).price_per_hour,
            "wan_line": line,
        }


def policy_config(cfg: SimConfig, name: str) -> PolicyConfig:
    """The scheduler's config for mode `name`, built by services/scheduler/inputs.py as the service
    builds it: knobs (what the fleet's chips imply as priors, then the config's `scheduler:`
    section, then what the mode pins) plus what the fleet fixes (KV size, relay slots, the line's
    delay, the catch-up chunk). Main-decode never computes its suffix here: the simulated decoder
    does not model that extend, so the plan would get it for free."""
    m, groups = mode(name), {g.role: g for g in cfg.groups(name)}
    prefill, md = groups[Role.PREFILL].profile, groups[Role.MD].profile
    rld = groups.get(Role.RLD)
    priors = {
        "prefill_tok_s": prefill.prefill_tok_s(),
        "decode_step_ms": md.step_ms(1, 1024),
        "wan_mbps": float(cfg.wan["bandwidth_mbps"]),
        "local_mbps": float(cfg.local["mbps"]),
    }
    pinned = {"default_pipeline": m.pipeline, "default_handoff": m.handoff, "md_suffix_max_tokens": 0}
    knobs = {**priors, **cfg.scheduler, **pinned}
    return inputs.policy_config(
        knobs,
        kv_bytes_per_token=prefill.kv_bytes_per_token,
        rld_slots=rld.profile.max_running * rld.count if rld else 0,
        wan_delay_ms=float(cfg.wan.get("delay_ms", 0.0)),
        catchup_chunk=int(cfg.handoff["chunk_tokens"]),
    )


def load_sim_config(path: str | Path) -> SimConfig:
    path = Path(path)
    raw = yaml.safe_load(path.read_text()) or {}
    files = raw.pop("profiles", "profiles.yaml")
    profiles = {}
    for name in [files] if isinstance(files, str) else files:
        profiles.update(load_profiles(path.parent / name))
    known = {f.name for f in dataclasses.fields(SimConfig)} - {"profiles", "path"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {unknown}")
    cfg = SimConfig(profiles=profiles, path=str(path), **raw)
    for dc in ("A", "B"):
        cfg.chip(dc, Role.MD)  # names a real profile, or fail now with its name
    cfg.host_spec()  # a bad host value fails now, named
    cfg.check_handoff()
    cfg.view_spec()
    return cfg
