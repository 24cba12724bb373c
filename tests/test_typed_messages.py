"""Roles and an instance's figures cross as typed values: a Role is its plain name on the wire
(as WireFormat is) and a Role again once decoded; `InstanceState` carries typed figures, not a map."""

from __future__ import annotations

import json
import typing

import msgpack
import pytest

from shared.config import ClusterConfig, ConfigError, InstanceConfig, to_dict
from shared.messages import BadMessage, EngineFigures, InstanceFigures, InstanceState, KVTarget, TokenChunk
from shared.pipelines import Role


def test_a_role_crosses_as_its_plain_name_and_decodes_as_a_role():
    sent = KVTarget("md-0", Role.MD, "h", 1)
    assert sent.encode() == KVTarget("md-0", "md", "h", 1).encode()  # the same bytes as a plain string
    assert type(msgpack.unpackb(sent.encode())["role"]) is str
    assert type(KVTarget.decode(sent.encode()).role) is Role
    assert TokenChunk.decode(TokenChunk("r", 0, []).encode()).role is None  # the gateway's own chunk
    with pytest.raises(BadMessage, match="KVTarget.role: 'gateway' is not one of prefill, rld, md"):
        KVTarget.decode(KVTarget("x", "gateway", "h", 1).encode())


def test_a_role_reads_as_its_name_in_text_json_and_config():
    logged = "%s" % Role.RLD  # noqa: UP031 (as logging formats it)
    assert (str(Role.RLD), f"pdd.{Role.RLD}.x", logged) == ("rld", "pdd.rld.x", "rld")
    assert json.dumps({Role.MD: Role.MD}) == '{"md": "md"}'
    inst = InstanceConfig("md-0", "md")
    plain = to_dict(ClusterConfig(instances=(inst,)))["instances"][0]["role"]  # for YAML
    assert type(inst.role) is Role and type(plain) is str
    with pytest.raises(ConfigError, match=r"role 'relay' is not one of \('prefill', 'rld', 'md'\)"):
        InstanceConfig("x", "relay")


def test_an_instance_state_carries_typed_figures():
    figures = InstanceFigures(EngineFigures(running=2, cached_blocks=5, step_ms=12.5), held=3, handing=1)
    state = InstanceState("rld-0", Role.RLD, ["r1"], 10, 20, figures, ["_heartbeat"], {"requests": 1})
    back = InstanceState.decode(state.encode())
    assert back == state and type(back.figures.engine) is EngineFigures
    assert back.figures.engine.cached_blocks == 5 and back.state == {"requests": 1}
    assert "extra" not in msgpack.unpackb(state.encode())  # no untyped map rides along


@pytest.mark.parametrize(
    "figures, field",
    [
        ({"engine": {"running": "two"}}, "EngineFigures.running"),
        ({"held": 1.5}, "InstanceFigures.held"),
        ("many", "InstanceFigures"),
    ],
)
def test_malformed_figures_fail_their_message(figures, field):
    raw = msgpack.packb({"instance_id": "md-0", "role": "md", "figures": figures})
    with pytest.raises(BadMessage, match=field):
        InstanceState.decode(raw)


def test_state_sizes_are_counts():
    raw = msgpack.packb({"instance_id": "md-0", "role": "md", "state": {"requests": "3"}})
    with pytest.raises(BadMessage, match="InstanceState.state.requests"):
        InstanceState.decode(raw)


def _untyped(tp: object) -> bool:
    """Whether a field's type lets anything through: Any, or a container of Any."""
    return tp is typing.Any or any(_untyped(arg) for arg in typing.get_args(tp))


def test_no_message_or_frame_carries_an_untyped_field():
    """Everything that crosses a process (every Message: control messages and the KV plane's
    frames) has typed fields, checked on decode; none is a map or value of Any."""
    from shared import kv_transport, messages

    classes = {
        c
        for module in (messages, kv_transport)
        for c in vars(module).values()
        if isinstance(c, type) and issubclass(c, messages.Message) and c is not messages.Message
    }
    untyped = {f"{c.__name__}.{n}" for c in classes for n, tp in typing.get_type_hints(c).items() if _untyped(tp)}
    assert len(classes) > 30 and untyped == set(), untyped


def test_a_message_encodes_as_asdict_did_without_copying_its_token_ids():
    """`encode` skips `dataclasses.asdict`'s deep copies (a 4,000-token prompt in three tasks per
    plan); the bytes are what they were, and a list of ids is still checked element by element
    when one is not an int."""
    import dataclasses

    from shared.messages import Plan, PrefillTask, Sampling, Submit

    targets = [KVTarget("md-0", Role.MD, "h", 1)]
    task = PrefillTask("r", list(range(4000)), Sampling(stop=["x"]), targets, Plan("r", pipeline="p-md", md="md-0"))
    assert task.encode() == msgpack.packb(dataclasses.asdict(task), use_bin_type=True)
    assert PrefillTask.decode(task.encode()) == task
    bad = msgpack.packb({"request_id": "r", "prompt_ids": [1, True, 3], "sampling": {}})
    with pytest.raises(BadMessage, match=r"Submit.prompt_ids\[\]: expected int, got bool"):
        Submit.decode(bad)
