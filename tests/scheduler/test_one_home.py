"""One home each: the policy's knobs (shared/policy_knobs.py) and the KV wire formats' names
(shared/model_info.py `WireFormat`)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from services.scheduler.inputs import policy_config
from services.scheduler.policy import PolicyConfig
from shared.config import ConfigError, SchedulerConfig, config_from_dict
from shared.model_info import WIRE_FORMATS
from shared.policy_knobs import KNOBS, PolicyKnobs, knob_values

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pdd", "shared", "services", "benchmarks", "sim")
WIRE_HOME = {
    "shared/model_info.py",  # the names' one home
    "shared/runtime/kv_wire.py",  # implements the formats (to use WireFormat too, some day)
}
# the same spelling, another meaning: a dtype alias (models.py parses "bf16" as torch.bfloat16)
NOT_A_WIRE = {("shared/runtime/models.py", "bf16")}
INSTANCES = [{"id": "prefill-0", "role": "prefill", "dc": "A"}, {"id": "md-0", "role": "md", "dc": "B"}]


def _fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def test_wire_format_names_have_one_home():
    """Outside tests, a wire format's name is spelt only in shared/model_info.py (and the codec
    that implements the formats): everything else says `WireFormat.NATIVE` or `WIRE_FORMATS`."""
    spelt = sorted(
        f"{rel}:{node.lineno}: {node.value!r}"
        for pkg in PACKAGES
        for path in sorted((ROOT / pkg).rglob("*.py"))
        if (rel := path.relative_to(ROOT).as_posix()) not in WIRE_HOME
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in WIRE_FORMATS and (rel, node.value) not in NOT_A_WIRE
    )
    assert spelt == [], spelt


def test_both_configs_are_the_knobs_plus_their_own_fields():
    """The operator's section and the policy's config each add only what is theirs: a knob is
    declared (with its default and its check) once, in PolicyKnobs."""
    assert _fields(SchedulerConfig)[: len(KNOBS)] == list(KNOBS) == _fields(PolicyKnobs)
    assert _fields(SchedulerConfig)[len(KNOBS) :] == ["metrics_port", "kv_wire_in_dc"]
    assert _fields(PolicyConfig)[: len(KNOBS)] == list(KNOBS)
    assert set(_fields(PolicyConfig)[len(KNOBS) :]) == {
        "kv_bytes_per_token",
        "rld_slots",
        "wan_delay_ms",
        "local_mbps",
        "catchup_chunk",
        "wire_bytes_per_token",
    }
    assert knob_values(SchedulerConfig()) == knob_values(PolicyConfig()) == knob_values(PolicyKnobs())


def test_every_knob_of_the_section_reaches_the_policy():
    section = {
        "default_pipeline": "p-md",
        "default_handoff": "catchup",
        "hit_weight": 0.5,
        "ttft_slo_ms": 1500.0,
        "prefill_tok_s": 123.0,
        "wan_mbps": 77.0,
        "decode_step_ms": 40.0,
        "anomalous_min_uncached": 4096,
        "anomalous_max_output": 100,
        "catchup_threshold": 32,
        "rld_pressure": 0.5,
        "guard": False,
        "relay_finishes": True,
        "line_backlog": True,
        "kv_wire": "auto",
        "md_suffix_max_tokens": 64,
        "metrics_port": 9100,
        "kv_wire_in_dc": "bf16",
    }
    assert set(section) == set(_fields(SchedulerConfig))  # the test names every setting
    cfg = config_from_dict({"instances": [dict(i) for i in INSTANCES], "scheduler": section})
    policy = policy_config(
        knob_values(cfg.scheduler), kv_bytes_per_token=100, rld_slots=4, wan_delay_ms=5.0, catchup_chunk=16
    )
    assert knob_values(policy) == {k: v for k, v in section.items() if k in KNOBS}
    assert (policy.kv_bytes_per_token, policy.rld_slots, policy.wan_delay_ms, policy.catchup_chunk) == (100, 4, 5.0, 16)


@pytest.mark.parametrize(
    "knob, value",
    [
        ("default_pipeline", "p-rld"),
        ("default_handoff", "later"),
        ("kv_wire", "int4"),
        ("ttft_slo_ms", 0),
        ("prefill_tok_s", -1.0),
        ("rld_pressure", 1.5),
        ("md_suffix_max_tokens", -1),
    ],
)
def test_a_bad_knob_is_refused_by_both_naming_it(knob, value):
    """One check: the cluster config refuses it with a ConfigError, the policy with a ValueError."""
    with pytest.raises(ConfigError, match=rf"scheduler\.{knob}.*{value!r}"):
        SchedulerConfig(**{knob: value})
    with pytest.raises(ValueError, match=rf"{knob}.*{value!r}"):
        PolicyConfig(**{knob: value})


def test_the_section_own_settings_are_checked_there():
    with pytest.raises(ConfigError, match=r"kv_wire_in_dc.*'auto'"):  # no auto between relays in one site
        SchedulerConfig(kv_wire_in_dc="auto")
    with pytest.raises(ValueError, match="catchup_chunk"):
        PolicyConfig(catchup_chunk=0)
