"""Wide messages are built with keywords: a call to a message class (shared/messages.py, the
KV plane's frames, the policy's PlanRequest) passes at most MAX_POSITIONAL arguments by position,
so a reader sees which field each value fills and a reordered field cannot shift them silently."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_POSITIONAL = 3
SOURCES = ("services", "shared", "pdd", "benchmarks", "sim")
DEFINING = ("shared/messages.py", "shared/kv_transport.py", "services/scheduler/policy.py")


def _message_classes() -> set[str]:
    names = set()
    for rel in DEFINING:
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            if isinstance(node, ast.ClassDef) and any(
                isinstance(d, ast.Name | ast.Call) and "dataclass" in ast.unparse(d) for d in node.decorator_list
            ):
                names.add(node.name)
    return names


def _wide_calls(source: str, classes: set[str]) -> list[tuple[int, str, int]]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            if name in classes and len(node.args) > MAX_POSITIONAL:
                out.append((node.lineno, name, len(node.args)))
    return out


def test_wide_messages_are_built_with_keywords():
    classes = _message_classes()
    assert {"DecodeTask", "PrefillTask", "PlanRequest", "TransferHead", "InstanceInfo"} <= classes
    wide = [
        f"{path.relative_to(ROOT)}:{line} {name}(...) with {n} positional arguments"
        for top in SOURCES
        for path in sorted((ROOT / top).rglob("*.py"))
        for line, name, n in _wide_calls(path.read_text(), classes)
    ]
    assert not wide, "\n".join(wide)


def test_the_check_catches_a_positional_call():
    assert _wide_calls("DecodeTask('r', [1], s, plan)", {"DecodeTask"}) == [(1, "DecodeTask", 4)]
    assert _wide_calls("DecodeTask('r', prompt_ids=[1], sampling=s, plan=plan)", {"DecodeTask"}) == []
