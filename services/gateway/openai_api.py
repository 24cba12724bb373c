"""OpenAI request parsing: body bytes in, a validated `ParsedRequest` or an `APIError` out.

No I/O here. The HTTP layer hands over the body and a callback that tokenizes (a prompt, or a
chat rendered with the model's template), and turns an `APIError` into a response with
`status` and `to_json()`.

Conventions, chosen to match the OpenAI API itself:
- every validation error is 400 `invalid_request_error` naming the bad `param`, wrong types
  included (OpenAI answers 400 there, not FastAPI's 422); unknown model 404; body too big 413.
- `null` for an optional field means "use the default".
- a parameter that would change the output is honoured (penalties, stop_token_ids,
  min_tokens, logprobs, response_format, tools...) or refused with 400 naming it (n > 1,
  best_of > 1, echo, suffix, logit_bias, functions); only parameters that change nothing of the
  output (user, metadata, ...) are ignored.
- structured outputs and tool calls (services/gateway/structured.py): a grammar the engines
  enforce; a schema it cannot enforce is 400 naming the parameter.
- logprobs as each endpoint has them: chat `logprobs: true` with `top_logprobs` 0-20,
  completions `logprobs` 0-5 (the number of alternatives).
- an explicit max_tokens that does not fit the context is 400; the default is clipped to fit.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llguidance

from services.gateway import structured
from services.gateway.structured import Tools
from shared.messages import MAX_GRAMMAR_CHARS, MAX_TOP_LOGPROBS, MAX_TTFT_SLO_MS, Sampling
from shared.model_info import WIRE_FORMATS
from shared.pipelines import HANDOFFS, PIPELINES, Pipeline, hands_off

MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; a client wanting greedy output sends 0
MAX_STOP_STRINGS = 4
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound for /v1/completions' `logprobs`
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

Json = dict[str, Any]


class APIError(Exception):
    """An error for the client, in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
        counted: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after = retry_after if retry_after is not None else (1 if status in (429, 503) else None)
        self.counted = counted  # already in the request metrics (an admitted request's failure)

    def to_json(self) -> Json:
        message = self.message if self.status < 500 else public_message(self.message)
        return {"error": {"message": message, "type": self.type, "param": self.param, "code": self.code}}


# What a server-side failure may say about the cluster's insides: URLs, addresses and host:port
_INTERNAL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b|\b[\w.-]+:\d{2,5}\b", re.I)


def public_message(message: str) -> str:
    """A 5xx message as a client sees it: no internal host, address or port (the log keeps the
    full message under the request id)."""
    return _INTERNAL.sub("<internal>", message)


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class ParsedRequest:
    kind: str  # "completion" | "chat"
    model: str
    prompt_ids: list[int]
    sampling: Sampling
    stream: bool = False
    include_usage: bool = False  # streaming only: send a final chunk with usage
    pipeline: str | None = None  # forced by the client's `pdd` extension, else the policy decides
    handoff: str | None = None
    kv_wire: str | None = None  # forced WAN wire format (admins: `pdd.kv_wire`)
    ttft_slo_ms: float | None = None  # this request's TTFT SLO (admins: `pdd.ttft_slo_ms`)
    tools: Tools | None = None  # chat: the tools it may call (the answer is parsed for calls)

    @property
    def steers(self) -> bool:
        """It carries a `pdd` override (admin keys only)."""
        return any(v is not None for v in (self.pipeline, self.handoff, self.kv_wire, self.ttft_slo_ms))


def check_body_size(content_length: str | None, received: int | None = None, limit: int = MAX_BODY_BYTES) -> None:
    """413 when the declared Content-Length (check before reading) or the body read is too big."""
    if content_length is not None:
        if not re.fullmatch(r"\s*[0-9]+\s*", content_length):
            raise invalid(f"Content-Length {content_length!r} is not a non-negative integer", code="bad_content_length")
        received = max(int(content_length), received or 0)
    if received is not None and received > limit:
        raise APIError(413, f"request body is {received} bytes; the limit is {limit}", code="request_too_large")


def parse_completion(
    body: bytes,
    *,
    served_model: str,
    context_len: int,
    count_tokens: Callable[[str], list[int]],
    vocab_size: int | None = None,
    grammar_vocab: llguidance.LLTokenizer | None = None,
) -> ParsedRequest:
    """POST /v1/completions. `vocab_size`, when given, bounds prompts sent as token ids;
    `grammar_vocab` checks grammars against the model's vocabulary."""
    obj = _load_object(body)
    req = _common(obj, "completion", served_model)
    if obj.get("suffix"):
        raise invalid("'suffix' is not supported", "suffix", "unsupported_parameter")
    if obj.get("tool_choice") not in (None, "none") or (obj.get("tools") and obj.get("tool_choice") != "none"):
        param = "tools" if obj.get("tools") else "tool_choice"
        raise invalid("tool calls are a chat parameter: use /v1/chat/completions", param, "unsupported_parameter")
    req.sampling.grammar = _grammar(obj, None, grammar_vocab)
    req.prompt_ids = _prompt_ids(obj.get("prompt"), count_tokens, vocab_size)
    req.sampling.max_tokens = _max_tokens(obj, ("max_tokens",), DEFAULT_COMPLETION_MAX_TOKENS, req, context_len)
    return req


def parse_chat(
    body: bytes,
    *,
    served_model: str,
    context_len: int,
    apply_template: Callable[[list[Json], Tools | None], list[int]],
    grammar_vocab: llguidance.LLTokenizer | None = None,
) -> ParsedRequest:
    """POST /v1/chat/completions. `apply_template` renders the messages (and the tools) and
    tokenizes them; `grammar_vocab` checks grammars against the model's vocabulary."""
    obj = _load_object(body)
    req = _common(obj, "chat", served_model)
    try:
        req.tools = structured.parse_tools(obj)
    except structured.SpecError as e:
        raise invalid(str(e), e.param) from None
    req.sampling.grammar = _grammar(obj, req.tools, grammar_vocab)
    messages = _messages(obj.get("messages"))
    try:
        req.prompt_ids = list(apply_template(messages, req.tools))
    except Exception as e:  # a template may reject a conversation (e.g. roles out of order)
        raise invalid(f"'messages' could not be rendered with the chat template: {e}", "messages") from None
    if not req.prompt_ids:
        raise invalid("'messages' rendered to an empty prompt", "messages")
    keys = ("max_completion_tokens", "max_tokens")  # the newer name wins when both are sent
    req.sampling.max_tokens = _max_tokens(obj, keys, DEFAULT_CHAT_MAX_TOKENS, req, context_len)
    return req


# --- the body and the fields both endpoints share ------------------------------------------


def _load_object(body: bytes) -> Json:
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
        raise invalid(f"request body must be a JSON object, got {_json_type(obj)}", code="invalid_json")
    return obj


def _reject_constant(name: str) -> None:
    raise invalid(f"malformed JSON: {name} is not a JSON number", code="invalid_json")


def _common(obj: Json, kind: str, served_model: str) -> ParsedRequest:
    """Everything but the prompt and max_tokens, checked before the (costlier) tokenization."""
    model = _model(obj.get("model"), served_model)
    _reject_unsupported(obj)
    stream = _bool(obj, "stream")
    overrides = _pdd(obj.get("pdd"))
    sampling = Sampling(
        temperature=_number(obj, "temperature", DEFAULT_TEMPERATURE, lambda v: 0 <= v <= 2, "in [0, 2]"),
        top_p=_number(obj, "top_p", 1.0, lambda v: 0 < v <= 1, "in (0, 1]"),
        top_k=max(_int(obj, "top_k", 0, lambda v: v >= -1, ">= 0 (or -1 for off)"), 0),  # Sampling: 0 = off
        seed=_int(obj, "seed", None, lambda v: -(2**63) <= v < 2**64, "a 64-bit integer"),
        stop=_stops(obj.get("stop")),
        ignore_eos=_bool(obj, "ignore_eos"),
        presence_penalty=_number(obj, "presence_penalty", 0.0, lambda v: -2 <= v <= 2, "in [-2, 2]"),
        frequency_penalty=_number(obj, "frequency_penalty", 0.0, lambda v: -2 <= v <= 2, "in [-2, 2]"),
        repetition_penalty=_number(obj, "repetition_penalty", 1.0, lambda v: 0 < v <= 2, "in (0, 2]"),
        min_tokens=_int(obj, "min_tokens", 0, lambda v: v >= 0, ">= 0"),
        stop_token_ids=_stop_token_ids(obj.get("stop_token_ids")),
        logprobs=_logprobs(obj, kind),
    )
    return ParsedRequest(
        kind=kind,
        model=model,
        prompt_ids=[],
        sampling=sampling,
        stream=stream,
        include_usage=_include_usage(obj.get("stream_options")) and stream,
        **overrides,
    )


def _model(value: Any, served_model: str) -> str:
    if value is None:
        return served_model
    if not isinstance(value, str):
        raise invalid(f"'model' must be a string, got {_json_type(value)}", "model")
    if value != served_model:
        msg = f"the model {value!r} does not exist; this server serves {served_model!r}"
        raise APIError(404, msg, type="not_found_error", param="model", code="model_not_found")
    return value


def _reject_unsupported(obj: Json) -> None:
    for key in ("n", "best_of"):
        value = _int(obj, key, 1)
        if value != 1:
            raise invalid(f"'{key}' = {value} is not supported; only 1", key, "unsupported_parameter")
    for key in ("echo", "logit_bias", "functions"):
        value = obj.get(key)
        if not (value is None or value is False or value == {} or value == []):
            raise invalid(f"'{key}' is not supported", key, "unsupported_parameter")


def _grammar(obj: Json, tools: Tools | None, vocab: llguidance.LLTokenizer | None) -> str:
    """The grammar the answer must follow: `response_format`'s or the tools' ("" for none)."""
    param = "response_format"
    try:
        grammar = structured.parse_response_format(obj.get("response_format"))
        if tools is not None and tools.may_call:
            if grammar:
                raise invalid(
                    "send either 'response_format' or 'tools' that may be called, not both", "response_format"
                )
            grammar, param = structured.tool_grammar(tools), "tools"
        if len(grammar) > MAX_GRAMMAR_CHARS:
            raise invalid(f"'{param}' makes a grammar of {len(grammar)} characters; at most {MAX_GRAMMAR_CHARS}", param)
        if grammar:
            structured.check_grammar(grammar, vocab, param)
    except structured.SpecError as e:
        raise invalid(str(e), e.param) from None
    except ValueError as e:  # llguidance: a schema that is not a JSON object
        raise invalid(f"'{param}' is not a JSON schema: {e}", param) from None
    return grammar


def _logprobs(obj: Json, kind: str) -> int | None:
    """How many alternatives to return with each token's log-probability (None: no logprobs)."""
    if kind == "completion":
        if "top_logprobs" in obj and obj["top_logprobs"] is not None:
            raise invalid("'top_logprobs' is a chat parameter; completions take 'logprobs': N", "top_logprobs")
        rule = f"in [0, {MAX_COMPLETION_LOGPROBS}]"
        return _int(obj, "logprobs", None, lambda v: 0 <= v <= MAX_COMPLETION_LOGPROBS, rule)
    top = _int(obj, "top_logprobs", None, lambda v: 0 <= v <= MAX_TOP_LOGPROBS, f"in [0, {MAX_TOP_LOGPROBS}]")
    if not _bool(obj, "logprobs"):
        if top is not None:
            raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return top or 0


def _include_usage(options: Any) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict):
        raise invalid(f"'stream_options' must be an object, got {_json_type(options)}", "stream_options")
    return _bool(options, "include_usage", param="stream_options.include_usage")


PDD_OVERRIDES = ("pipeline", "handoff", "kv_wire", "ttft_slo_ms")


def _pdd(ext: Any) -> dict[str, Any]:
    """The `pdd` extension's overrides, as ParsedRequest fields."""
    if ext is None:
        return {}
    if not isinstance(ext, dict):
        raise invalid(f"'pdd' must be an object, got {_json_type(ext)}", "pdd")
    for key in ext:
        if key not in PDD_OVERRIDES:
            raise invalid(f"unknown field 'pdd.{key}'; known: {', '.join(PDD_OVERRIDES)}", f"pdd.{key}")
    pipeline = _choice(ext.get("pipeline"), PIPELINES, "pdd.pipeline")
    handoff = _choice(ext.get("handoff"), HANDOFFS, "pdd.handoff")
    if handoff is not None and pipeline is not None and not hands_off(pipeline):
        raise invalid(
            f"'pdd.handoff' applies only to pipeline {Pipeline.P_RLD_MD.value}, not {pipeline!r}", "pdd.handoff"
        )
    slo_rule = f"in (0, {MAX_TTFT_SLO_MS:.0f}] ms"
    slo = _number(ext, "ttft_slo_ms", None, lambda v: 0 < v <= MAX_TTFT_SLO_MS, slo_rule, "pdd.ttft_slo_ms")
    return {
        "pipeline": pipeline,
        "handoff": handoff,
        "kv_wire": _choice(ext.get("kv_wire"), WIRE_FORMATS, "pdd.kv_wire"),
        "ttft_slo_ms": slo,
    }


def _choice(value: Any, allowed: tuple[str, ...], param: str) -> str | None:
    if value is not None and value not in allowed:
        raise invalid(f"'{param}' must be one of {', '.join(allowed)}; got {_show(value)}", param)
    return value


# --- the prompt ------------------------------------------------------------------------------


def _prompt_ids(value: Any, count_tokens: Callable[[str], list[int]], vocab_size: int | None) -> list[int]:
    if value is None:
        raise invalid("'prompt' is required", "prompt")
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one prompt
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise invalid("a batch of prompts is not supported; send one prompt per request", "prompt")
    if isinstance(value, str):
        ids = list(count_tokens(value)) if value else []
    elif isinstance(value, list) and all(_is_int(t) for t in value):
        ids = _token_ids(value, vocab_size)
    else:
        raise invalid("'prompt' must be a string, an array of one string, or an array of token ids", "prompt")
    if not ids:
        raise invalid("'prompt' must not be empty", "prompt")
    return ids


def _token_ids(ids: list[int], vocab_size: int | None) -> list[int]:
    high = vocab_size if vocab_size is not None else math.inf
    for i, t in enumerate(ids):
        if not 0 <= t < high:
            raise invalid(f"'prompt[{i}]' = {t} is not a token id of this model (0 <= id < {vocab_size})", "prompt")
    return list(ids)


def _messages(value: Any) -> list[Json]:
    if value is None:
        raise invalid("'messages' is required", "messages")
    if not isinstance(value, list):
        raise invalid(f"'messages' must be an array, got {_json_type(value)}", "messages")
    if not value:
        raise invalid("'messages' must not be empty", "messages")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(value)]


def _message(msg: Any, param: str) -> Json:
    if not isinstance(msg, dict):
        raise invalid(f"'{param}' must be an object, got {_json_type(msg)}", param)
    role = msg.get("role")
    if not isinstance(role, str) or role not in CHAT_ROLES:
        raise invalid(f"'{param}.role' must be one of {', '.join(CHAT_ROLES)}; got {_show(role)}", f"{param}.role")
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
    raise invalid(f"'{param}' must be a string, got {_json_type(value)}", param)


def _max_tokens(obj: Json, keys: tuple[str, ...], default: int, req: ParsedRequest, context_len: int) -> int:
    prompt_len, where = len(req.prompt_ids), ("prompt" if req.kind == "completion" else "messages")
    room = context_len - prompt_len
    if room < 1:
        msg = f"the prompt is {prompt_len} tokens; the model's context is {context_len}, leaving no room to generate"
        raise invalid(msg, where, "context_length_exceeded")
    key = next((k for k in keys if obj.get(k) is not None), None)
    if key is None:
        return min(default, room)
    value = _int(obj, key, None, lambda v: v >= 1, ">= 1")
    if value > context_len:
        msg = f"'{key}' = {value} is more than the model's context length of {context_len} tokens"
        raise invalid(msg, key, "context_length_exceeded")
    if value > room:
        msg = (
            f"the model's context length is {context_len} tokens, but {prompt_len + value} were requested "
            f"({prompt_len} in the prompt + {value} for '{key}')"
        )
        raise invalid(msg, key, "context_length_exceeded")
    return value


# --- typed fields ----------------------------------------------------------------------------


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(obj: Json, key: str, default: int | None, ok: Callable[[int], bool] | None = None, rule: str = "") -> Any:
    """An integer passing `ok` (described by `rule`), or `default` when absent or null."""
    value = obj.get(key)
    if value is None:
        return default
    if not _is_int(value):
        raise invalid(f"'{key}' must be an integer, got {_json_type(value)} {_show(value)}", key)
    if ok is not None and not ok(value):
        raise invalid(f"'{key}' must be {rule}, got {value}", key)
    return value


def _number(
    obj: Json, key: str, default: float | None, ok: Callable[[float], bool], rule: str, param: str | None = None
) -> float | None:
    """A finite number passing `ok` (described by `rule`), or `default` when absent or null."""
    value, param = obj.get(key), param or key
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(f"'{param}' must be a number, got {_json_type(value)} {_show(value)}", param)
    if not ok(value):
        raise invalid(f"'{param}' must be {rule}, got {value}", param)
    return float(value)


def _bool(obj: Json, key: str, param: str | None = None) -> bool:
    value = obj.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"'{param or key}' must be a boolean, got {_json_type(value)} {_show(value)}", param or key)
    return value


def _stop_token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(_is_int(t) and t >= 0 for t in value) or len(value) > 64:
        raise invalid("'stop_token_ids' must be an array of at most 64 token ids", "stop_token_ids")
    return list(value)


def _stops(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list):
        raise invalid(f"'stop' must be a string or an array of strings, got {_json_type(value)}", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid(f"'stop' has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
    for s in stops:
        if not isinstance(s, str) or not s:
            raise invalid(f"'stop' strings must be non-empty strings, got {_show(s)}", "stop")
    return list(dict.fromkeys(stops))


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    names = {str: "string", int: "integer", float: "number", list: "array", dict: "object"}
    return next((n for t, n in names.items() if isinstance(v, t)), type(v).__name__)


def _show(v: Any) -> str:
    text = json.dumps(v)
    return text if len(text) <= 40 else text[:37] + "..."
