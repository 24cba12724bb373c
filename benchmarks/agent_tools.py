"""The tools of the `agentic-tools` workload (benchmarks/agentic.py): three coding tools whose
parameters cover what a grammar must hold arguments to (a nested object, an enum, an array)."""

from __future__ import annotations

from typing import Any

TOOLS_PROMPT_TOKENS = 120  # the fallback tools prompt's own words (services/gateway/structured.py)


def _strict(**properties: Any) -> dict[str, Any]:
    """An object schema whose every property is required and nothing else allowed."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


def _tool(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


LINE = {"type": "integer", "minimum": 1, "maximum": 9999}
TOOLS = [
    _tool(
        "read_file",
        "Read part of a file of the repository.",
        _strict(path={"type": "string", "maxLength": 48}, lines=_strict(start=LINE, end=LINE)),
    ),
    _tool(
        "run_tests",
        "Run some of the test suite.",
        _strict(suite={"enum": ["unit", "integration", "all"]}, filter={"type": "string", "maxLength": 32}),
    ),
    _tool(
        "search_code",
        "Search the repository for words.",
        _strict(words={"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1, "maxItems": 3}),
    ),
]
