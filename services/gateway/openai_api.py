"""OpenAI request parsing: body bytes in, a validated `ParsedRequest` or an `APIError` out.

No I/O here. The HTTP layer hands over the body and a callback that tokenizes (a prompt, or a
chat rendered with the model's template), and turns an `APIError` (services/gateway/errors.py)
into a response with `status` and `to_json()`. The body's typed fields are read by
services/gateway/fields.py, a chat's messages by services/gateway/chat_messages.py.

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

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import llguidance

from services.gateway import structured
from services.gateway.chat_messages import parse_messages
from services.gateway.errors import APIError, invalid
from services.gateway.fields import boolean, choice, integer, is_int, json_type, load_object, number, show
from services.gateway.structured import Tools
from shared.messages import MAX_GRAMMAR_CHARS, MAX_TOP_LOGPROBS, MAX_TTFT_SLO_MS, Sampling
from shared.model_info import WIRE_FORMATS
from shared.pipelines import HANDOFFS, PIPELINES, Pipeline, hands_off

DEFAULT_COMPLETION_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 256
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default; a client wanting greedy output sends 0
MAX_STOP_STRINGS = 4
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound for /v1/completions' `logprobs`

Json = dict[str, Any]


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
    obj = load_object(body)
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
    obj = load_object(body)
    req = _common(obj, "chat", served_model)
    try:
        req.tools = structured.parse_tools(obj)
    except structured.SpecError as e:
        raise invalid(str(e), e.param) from None
    req.sampling.grammar = _grammar(obj, req.tools, grammar_vocab)
    messages = parse_messages(obj.get("messages"))
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


def _common(obj: Json, kind: str, served_model: str) -> ParsedRequest:
    """Everything but the prompt and max_tokens, checked before the (costlier) tokenization."""
    model = _model(obj.get("model"), served_model)
    _reject_unsupported(obj)
    stream = boolean(obj, "stream")
    overrides = _pdd(obj.get("pdd"))
    sampling = Sampling(
        temperature=number(obj, "temperature", DEFAULT_TEMPERATURE, lambda v: 0 <= v <= 2, "in [0, 2]"),
        top_p=number(obj, "top_p", 1.0, lambda v: 0 < v <= 1, "in (0, 1]"),
        top_k=max(integer(obj, "top_k", 0, lambda v: v >= -1, ">= 0 (or -1 for off)"), 0),  # Sampling: 0 = off
        seed=integer(obj, "seed", None, lambda v: -(2**63) <= v < 2**64, "a 64-bit integer"),
        stop=_stops(obj.get("stop")),
        ignore_eos=boolean(obj, "ignore_eos"),
        presence_penalty=number(obj, "presence_penalty", 0.0, lambda v: -2 <= v <= 2, "in [-2, 2]"),
        frequency_penalty=number(obj, "frequency_penalty", 0.0, lambda v: -2 <= v <= 2, "in [-2, 2]"),
        repetition_penalty=number(obj, "repetition_penalty", 1.0, lambda v: 0 < v <= 2, "in (0, 2]"),
        min_tokens=integer(obj, "min_tokens", 0, lambda v: v >= 0, ">= 0"),
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
        raise invalid(f"'model' must be a string, got {json_type(value)}", "model")
    if value != served_model:
        msg = f"the model {value!r} does not exist; this server serves {served_model!r}"
        raise APIError(404, msg, type="not_found_error", param="model", code="model_not_found")
    return value


def _reject_unsupported(obj: Json) -> None:
    for key in ("n", "best_of"):
        value = integer(obj, key, 1)
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
        return integer(obj, "logprobs", None, lambda v: 0 <= v <= MAX_COMPLETION_LOGPROBS, rule)
    top = integer(obj, "top_logprobs", None, lambda v: 0 <= v <= MAX_TOP_LOGPROBS, f"in [0, {MAX_TOP_LOGPROBS}]")
    if not boolean(obj, "logprobs"):
        if top is not None:
            raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return None
    return top or 0


def _include_usage(options: Any) -> bool:
    if options is None:
        return False
    if not isinstance(options, dict):
        raise invalid(f"'stream_options' must be an object, got {json_type(options)}", "stream_options")
    return boolean(options, "include_usage", param="stream_options.include_usage")


PDD_OVERRIDES = ("pipeline", "handoff", "kv_wire", "ttft_slo_ms")


def _pdd(ext: Any) -> dict[str, Any]:
    """The `pdd` extension's overrides, as ParsedRequest fields."""
    if ext is None:
        return {}
    if not isinstance(ext, dict):
        raise invalid(f"'pdd' must be an object, got {json_type(ext)}", "pdd")
    for key in ext:
        if key not in PDD_OVERRIDES:
            raise invalid(f"unknown field 'pdd.{key}'; known: {', '.join(PDD_OVERRIDES)}", f"pdd.{key}")
    pipeline = choice(ext.get("pipeline"), PIPELINES, "pdd.pipeline")
    handoff = choice(ext.get("handoff"), HANDOFFS, "pdd.handoff")
    if handoff is not None and pipeline is not None and not hands_off(pipeline):
        raise invalid(
            f"'pdd.handoff' applies only to pipeline {Pipeline.P_RLD_MD.value}, not {pipeline!r}", "pdd.handoff"
        )
    slo_rule = f"in (0, {MAX_TTFT_SLO_MS:.0f}] ms"
    slo = number(ext, "ttft_slo_ms", None, lambda v: 0 < v <= MAX_TTFT_SLO_MS, slo_rule, "pdd.ttft_slo_ms")
    return {
        "pipeline": pipeline,
        "handoff": handoff,
        "kv_wire": choice(ext.get("kv_wire"), WIRE_FORMATS, "pdd.kv_wire"),
        "ttft_slo_ms": slo,
    }


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
    elif isinstance(value, list) and all(is_int(t) for t in value):
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


def _max_tokens(obj: Json, keys: tuple[str, ...], default: int, req: ParsedRequest, context_len: int) -> int:
    prompt_len, where = len(req.prompt_ids), ("prompt" if req.kind == "completion" else "messages")
    room = context_len - prompt_len
    if room < 1:
        msg = f"the prompt is {prompt_len} tokens; the model's context is {context_len}, leaving no room to generate"
        raise invalid(msg, where, "context_length_exceeded")
    key = next((k for k in keys if obj.get(k) is not None), None)
    if key is None:
        return min(default, room)
    value = integer(obj, key, None, lambda v: v >= 1, ">= 1")
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


def _stop_token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(is_int(t) and t >= 0 for t in value) or len(value) > 64:
        raise invalid("'stop_token_ids' must be an array of at most 64 token ids", "stop_token_ids")
    return list(value)


def _stops(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list):
        raise invalid(f"'stop' must be a string or an array of strings, got {json_type(value)}", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid(f"'stop' has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
    for s in stops:
        if not isinstance(s, str) or not s:
            raise invalid(f"'stop' strings must be non-empty strings, got {show(s)}", "stop")
    return list(dict.fromkeys(stops))
