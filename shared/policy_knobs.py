"""The scheduling policy's knobs: the one home of each knob, its default and its check.

Two configs are built on `PolicyKnobs` and add only their own fields:
- shared/config.py `SchedulerConfig`, the operator's `scheduler:` section of the cluster YAML:
  these knobs plus the scheduler process's own settings (`metrics_port`, `kv_wire_in_dc`);
- services/scheduler/policy.py `PolicyConfig`, what `choose_plan` reads (that module documents
  each rule): these knobs plus what the fleet fixes (KV size, relay slots, the line's delay, ...),
  built by services/scheduler/inputs.py from a `SchedulerConfig` or, in the simulator, a fleet.

Pure: plain values, no I/O (the policy imports it). A bad value raises ValueError naming the knob
and the value; `SchedulerConfig` turns it into a ConfigError.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from shared.model_info import WireFormat, parse_wire
from shared.pipelines import HANDOFFS, Pipeline

AUTO = "auto"  # default_pipeline / default_handoff: the policy decides
PINNABLE_PIPELINES = (Pipeline.P_MD.value, Pipeline.P_RLD_MD.value)  # what default_pipeline may pin


@dataclass(frozen=True)
class PolicyKnobs:
    """`default_pipeline` / `default_handoff` "auto" let the policy decide; a fixed value pins it
    (baselines and ablations). Defaults are plain strings, so a config round-trips through YAML."""

    default_pipeline: str = AUTO  # auto | p-md | p-rld-md
    default_handoff: str = AUTO  # auto | oneshot | catchup
    hit_weight: float = 1.0  # prefix hit vs load when choosing instances
    ttft_slo_ms: float = 1000.0  # p-md when its estimated TTFT meets this, else via the relay
    prefill_tok_s: float = 300.0  # prior for prefill speed, until prefill reports a measured figure
    wan_mbps: float = 1000.0  # prior until the WAN bandwidth estimator has samples
    decode_step_ms: float = 75.0  # prior for one decode step, until a decoder reports a measured one
    anomalous_min_uncached: int = 2048  # long uncached input (the report's "very long", for 8K context) ...
    anomalous_max_output: int = 500  # ... with a short output budget (max_tokens below this) runs p-rld
    catchup_threshold: int = 64  # expected relay backlog (tokens) above which catch-up beats one-shot
    rld_pressure: float = 0.75  # relay busy share above which handoff is as early as possible
    guard: bool = True  # oscillation guard: a saturated relay takes no more low-hit requests
    relay_finishes: bool = False  # p-rld when the relay will have streamed the whole answer before MD's KV lands
    line_backlog: bool = False  # p-md's TTFT estimate counts the KV already dispatched on the line
    kv_wire: str = WireFormat.NATIVE.value  # KV over the WAN: a wire format, or auto (narrow as the SLO needs)
    md_suffix_max_tokens: int = 256  # longest prompt suffix main-decode may compute itself (no KV pushed); 0 = off

    def __post_init__(self) -> None:
        if self.default_pipeline not in (AUTO, *PINNABLE_PIPELINES):
            raise ValueError(
                f"default_pipeline {self.default_pipeline!r} must be {AUTO}, {' or '.join(PINNABLE_PIPELINES)}"
            )
        if self.default_handoff not in (AUTO, *HANDOFFS):
            raise ValueError(f"default_handoff {self.default_handoff!r} must be {AUTO}, {' or '.join(HANDOFFS)}")
        try:
            parse_wire(self.kv_wire, allow_auto=True)
        except ValueError as e:
            raise ValueError(f"kv_wire: {e}") from None
        for name in ("ttft_slo_ms", "prefill_tok_s", "wan_mbps", "decode_step_ms"):
            check_positive(self, name)
        if self.md_suffix_max_tokens < 0:
            raise ValueError(f"md_suffix_max_tokens must be >= 0, got {self.md_suffix_max_tokens!r}")
        if not 0.0 < self.rld_pressure <= 1.0:
            raise ValueError(f"rld_pressure must be in (0, 1], got {self.rld_pressure!r}")


def check_positive(config: Any, name: str) -> None:
    if getattr(config, name) <= 0:
        raise ValueError(f"{name} must be > 0, got {getattr(config, name)!r}")


KNOBS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(PolicyKnobs))


def knob_values(config: PolicyKnobs) -> dict[str, Any]:
    """The knobs' values of `config` (a SchedulerConfig or a PolicyConfig), without its own fields."""
    return {name: getattr(config, name) for name in KNOBS}
