"""docs/request-path.md stays true: every file it names exists, every message it names is a
message class of the control plane or the KV plane, and every subject is one `shared/subjects.py`
lists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "request-path.md").read_text()
MESSAGE_MODULES = ("shared/messages.py", "shared/kv_transport.py")


def _classes(path: str) -> set[str]:
    tree = ast.parse((ROOT / path).read_text())
    return {node.name for node in ast.walk(tree) if isinstance(node, ast.ClassDef)}


def _rows() -> list[list[str]]:
    rows = [line.split("|")[1:-1] for line in DOC.splitlines() if re.match(r"\|\s*\d+\s*\|", line)]
    return [[cell.strip() for cell in row] for row in rows]


def test_the_hops_are_numbered_in_order():
    assert [int(row[0]) for row in _rows()] == list(range(1, len(_rows()) + 1))


def test_every_file_named_exists():
    named = set(re.findall(r"`((?:services|shared|tests|docs)/[\w/.-]+)`", DOC))
    assert named and not {p for p in named if not (ROOT / p).exists()}


def test_every_message_named_is_a_message_class():
    classes = set().union(*(_classes(m) for m in MESSAGE_MODULES))
    named = {name for row in _rows() for name in re.findall(r"`([A-Z]\w+)`", row[3])}
    assert named and not named - classes, sorted(named - classes)


def test_every_subject_named_is_listed_in_subjects():
    listed = (ROOT / "shared" / "subjects.py").read_text()
    named = set(re.findall(r"`(pdd\.[\w.<>]+)`", DOC))
    assert named and not {s for s in named if s not in listed}


def test_the_check_fails_on_a_name_that_is_gone():
    """A renamed message would fail the check above (it is not a class of either module)."""
    classes = set().union(*(_classes(m) for m in MESSAGE_MODULES))
    assert "TokenChunk" in classes and "DoneFrame" not in classes
