"""The OpenAI response shapes the gateway sends: streamed chunks, the usage chunk, whole
responses, their logprobs, and the `pdd` object as each key may see it."""

from __future__ import annotations

import json
from typing import Any

from services.gateway.auth import Key
from shared.messages import Logprob

Json = dict[str, Any]
Tokens = list[tuple[int, Logprob | None]]  # tokens with their logprobs (services/gateway/flow.py `Delta`)
HIDDEN_FROM_USERS = (
    "instances",
    "scheduler",
    "dispatch_id",
    "plan_estimates",
    "prefix_hit_tokens",
    "md_cached_tokens",
    "md_computes_suffix",  # with the prompt's length, main-decode's cache hit
    "md_suffix_reason",
    "recomputed_tokens",
)


def event(obj: Json) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def chunk(
    flow,
    model: str,
    text: str,
    finish: str | None,
    first: bool,
    logprobs: Json | None = None,
    tool_calls: list[Json] | None = None,
) -> Json:
    """One streamed chunk; `id` and `created` are the request's, the same in every chunk."""
    base = {"id": flow.request_id, "created": flow.created, "model": model}
    if flow.parsed.kind == "chat":
        delta: Json = {"role": "assistant", "content": text} if first else {"content": text}
        if tool_calls:
            delta = {**delta, "content": text or None, "tool_calls": tool_calls}
        return {
            **base,
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        }
    return {
        **base,
        "object": "text_completion",
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
    }


class LogprobsView:
    """A request's logprobs in its endpoint's shape, delta by delta: chat's `content` entries
    (token, logprob, bytes, top_logprobs), completions' parallel lists (tokens, token_logprobs,
    top_logprobs, text_offset, counted over the token strings so far). None for a request that
    did not ask for them."""

    def __init__(self, flow, tokenizer) -> None:
        self.chat = flow.parsed.kind == "chat"
        self.wanted = flow.parsed.sampling.logprobs is not None
        self.tokenizer = tokenizer
        self.text_offset = 0

    def render(self, tokens: Tokens) -> Json | None:
        if not self.wanted:
            return None
        if self.chat:
            return {"content": [self._chat_entry(t, lp) for t, lp in tokens], "refusal": None}
        out: Json = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, lp in tokens:
            text = self._text(token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(lp.logprob if lp else None)
            top = zip(lp.top_ids, lp.top_logprobs) if lp else ()
            out["top_logprobs"].append({self._text(i): v for i, v in top})
            out["text_offset"].append(self.text_offset)
            self.text_offset += len(text)
        return out

    def _chat_entry(self, token_id: int, lp: Logprob | None) -> Json:
        top = zip(lp.top_ids, lp.top_logprobs) if lp else ()
        entry = self._token(token_id, lp.logprob if lp else None)
        return {**entry, "top_logprobs": [self._token(i, v) for i, v in top]}

    def _token(self, token_id: int, logprob: float | None) -> Json:
        text = self._text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    def _text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


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


def whole(
    flow,
    model: str,
    text: str,
    finish: str | None,
    pdd: Json | None,
    logprobs: Json | None = None,
    tool_calls: list[Json] | None = None,
) -> Json:
    base = {"id": flow.request_id, "created": flow.created, "model": model, "usage": usage(flow)}
    if pdd is not None:
        base["pdd"] = pdd
    if flow.parsed.kind == "chat":
        message: Json = {"role": "assistant", "content": text}
        if tool_calls:
            message = {"role": "assistant", "content": text or None, "tool_calls": tool_calls}
        return {
            **base,
            "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}],
        }
    return {
        **base,
        "object": "text_completion",
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
    }


def pdd_for(key: Key, pdd: Json, setting: str) -> Json | None:
    """The `pdd` object as this key may see it: admins all of it; users (gateway.pdd_object)
    all of it, none of it, or without instance ids, cache-hit counts and estimates."""
    if key.admin or setting == "full":
        return pdd
    if setting == "none":
        return None
    return {k: v for k, v in pdd.items() if k not in HIDDEN_FROM_USERS}
