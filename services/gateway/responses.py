"""The OpenAI response shapes the gateway sends: streamed chunks, the usage chunk, whole
responses, and the `pdd` object as each key may see it."""

from __future__ import annotations

import json
from typing import Any

from services.gateway.auth import Key

Json = dict[str, Any]
HIDDEN_FROM_USERS = ("instances", "plan_estimates", "prefix_hit_tokens", "md_cached_tokens", "recomputed_tokens")


def event(obj: Json) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def chunk(flow, model: str, text: str, finish: str | None, first: bool) -> Json:
    """One streamed chunk; `id` and `created` are the request's, the same in every chunk."""
    base = {"id": flow.request_id, "created": flow.created, "model": model}
    if flow.parsed.kind == "chat":
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {
            **base,
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
    return {
        **base,
        "object": "text_completion",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }


def usage_chunk(flow, model: str) -> Json:
    """`stream_options.include_usage`: the usage in a last chunk of its own, with no choices."""
    kind = "chat.completion.chunk" if flow.parsed.kind == "chat" else "text_completion"
    return {
        "id": flow.request_id,
        "created": flow.created,
        "model": model,
        "object": kind,
        "choices": [],
        "usage": usage(flow),
    }


def usage(flow) -> Json:
    p, c = len(flow.parsed.prompt_ids), flow.stats.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def whole(flow, model: str, text: str, finish: str | None, pdd: Json | None) -> Json:
    base = {"id": flow.request_id, "created": flow.created, "model": model, "usage": usage(flow)}
    if pdd is not None:
        base["pdd"] = pdd
    if flow.parsed.kind == "chat":
        message = {"role": "assistant", "content": text}
        return {
            **base,
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
        }
    return {
        **base,
        "object": "text_completion",
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }


def pdd_for(key: Key, pdd: Json, setting: str) -> Json | None:
    """The `pdd` object as this key may see it: admins all of it; users (gateway.pdd_object)
    all of it, none of it, or without instance ids, cache-hit counts and estimates."""
    if key.admin or setting == "full":
        return pdd
    if setting == "none":
        return None
    return {k: v for k, v in pdd.items() if k not in HIDDEN_FROM_USERS}
