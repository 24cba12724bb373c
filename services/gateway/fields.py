"""A JSON body's typed fields: each parsed or refused with a 400 naming it (OpenAI answers 400
for wrong types too, not FastAPI's 422). `null` for an optional field means "use the default"."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

from services.gateway.errors import invalid

Json = dict[str, Any]


def load_object(body: bytes) -> Json:
    try:
        text = bytes(body).decode("utf-8")
    except UnicodeDecodeError as e:
        raise invalid(f"request body is not valid UTF-8 (bad byte at offset {e.start})", code="invalid_utf8") from None
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as e:
        raise invalid(f"malformed JSON: {e.msg} (line {e.lineno}, column {e.colno})", code="invalid_json") from None
    except ValueError as e:  # an integer of thousands of digits (Python's int conversion limit)
        raise invalid(f"malformed JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise invalid("malformed JSON: nested too deeply", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise invalid(f"request body must be a JSON object, got {json_type(obj)}", code="invalid_json")
    return obj


def _reject_constant(name: str) -> None:
    raise invalid(f"malformed JSON: {name} is not a JSON number", code="invalid_json")


def choice(value: Any, allowed: tuple[str, ...], param: str) -> str | None:
    if value is not None and value not in allowed:
        raise invalid(f"'{param}' must be one of {', '.join(allowed)}; got {show(value)}", param)
    return value


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def integer(obj: Json, key: str, default: int | None, ok: Callable[[int], bool] | None = None, rule: str = "") -> Any:
    """An integer passing `ok` (described by `rule`), or `default` when absent or null."""
    value = obj.get(key)
    if value is None:
        return default
    if not is_int(value):
        raise invalid(f"'{key}' must be an integer, got {json_type(value)} {show(value)}", key)
    if ok is not None and not ok(value):
        raise invalid(f"'{key}' must be {rule}, got {value}", key)
    return value


def number(
    obj: Json, key: str, default: float | None, ok: Callable[[float], bool], rule: str, param: str | None = None
) -> float | None:
    """A finite number passing `ok` (described by `rule`), or `default` when absent or null."""
    value, param = obj.get(key), param or key
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(f"'{param}' must be a number, got {json_type(value)} {show(value)}", param)
    if not ok(value):
        raise invalid(f"'{param}' must be {rule}, got {value}", param)
    return float(value)


def boolean(obj: Json, key: str, param: str | None = None) -> bool:
    value = obj.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"'{param or key}' must be a boolean, got {json_type(value)} {show(value)}", param or key)
    return value


def json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    names = {str: "string", int: "integer", float: "number", list: "array", dict: "object"}
    return next((n for t, n in names.items() if isinstance(v, t)), type(v).__name__)


def show(v: Any) -> str:
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."
