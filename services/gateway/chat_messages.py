"""A chat request's `messages`: roles, text content (or text parts), and the tool calls and
tool results an agent loop sends back (services/gateway/structured.py renders them)."""

from __future__ import annotations

from typing import Any

from services.gateway import structured
from services.gateway.errors import invalid
from services.gateway.fields import json_type, show

Json = dict[str, Any]
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def parse_messages(value: Any) -> list[Json]:
    if value is None:
        raise invalid("'messages' is required", "messages")
    if not isinstance(value, list):
        raise invalid(f"'messages' must be an array, got {json_type(value)}", "messages")
    if not value:
        raise invalid("'messages' must not be empty", "messages")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(value)]


def _message(msg: Any, param: str) -> Json:
    if not isinstance(msg, dict):
        raise invalid(f"'{param}' must be an object, got {json_type(msg)}", param)
    role = msg.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise invalid(f"'{param}.role' must be one of {', '.join(CHAT_ROLES)}; got {show(role)}", f"{param}.role")
    out: Json = {"role": role, "content": _content(msg.get("content"), role, f"{param}.content")}
    if role == "assistant" and msg.get("tool_calls"):
        try:
            out["tool_calls"] = structured.parse_history_calls(msg["tool_calls"], f"{param}.tool_calls")
        except structured.SpecError as e:
            raise invalid(str(e), e.param) from None
    if role == "tool" and isinstance(msg.get("tool_call_id"), str):
        out["tool_call_id"] = msg["tool_call_id"]
    return out


def _content(value: Any, role: str, param: str) -> str:
    """A string, or a list of text parts (joined); an assistant turn may have none."""
    if isinstance(value, str):
        return value
    if value is None and role == "assistant":
        return ""
    if isinstance(value, list):
        texts = [p.get("text") for p in value if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) == len(value) and all(isinstance(t, str) for t in texts):
            return "".join(texts)
        raise invalid(f"'{param}': only text content parts are supported", param, "unsupported_parameter")
    raise invalid(f"'{param}' must be a string, got {json_type(value)}", param)
