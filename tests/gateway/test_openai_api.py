from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from services.gateway.deadlines import MAX_BODY_BYTES, check_body_size
from services.gateway.errors import APIError, internal_names
from services.gateway.openai_api import ParsedRequest, parse_chat, parse_completion
from shared.config import ControlPlaneConfig, load_config

MODEL = "smollm2-135m-instruct"
CONTEXT = 64


def chars(text: str) -> list[int]:
    """A fake tokenizer: one token per character, so lengths are easy to reason about."""
    return [ord(c) for c in text]


def render(messages: list[dict], tools=None) -> list[int]:
    return chars("".join(f"<{m['role']}>{m['content']}" for m in messages))


def completion(body: Any, context_len: int = CONTEXT, vocab_size: int | None = None) -> ParsedRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_completion(raw, served_model=MODEL, context_len=context_len, count_tokens=chars, vocab_size=vocab_size)


def chat(body: Any, context_len: int = 8192, apply_template=render) -> ParsedRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_chat(raw, served_model=MODEL, context_len=context_len, apply_template=apply_template)


def error_of(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args, **kwargs)
    return info.value


# --- valid requests --------------------------------------------------------------------------


def test_minimal_completion_gets_defaults():
    req = completion({"prompt": "hello"})
    assert req.kind == "completion"
    assert req.model == MODEL
    assert req.prompt_ids == chars("hello")
    assert req.sampling.max_tokens == 16
    assert req.sampling.temperature == 1.0
    assert req.sampling.top_p == 1.0 and req.sampling.top_k == 0
    assert req.sampling.seed is None and req.sampling.stop == [] and not req.sampling.ignore_eos
    assert not req.stream and not req.include_usage
    assert req.pipeline is None and req.handoff is None


def test_completion_with_every_option():
    req = completion(
        {
            "model": MODEL,
            "prompt": "hi",
            "max_tokens": 5,
            "temperature": 0,
            "top_p": 0.5,
            "top_k": 7,
            "seed": 42,
            "stop": ["a", "b"],
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "n": 1,
            "pdd": {"pipeline": "p-rld-md", "handoff": "catchup"},
        }
    )
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (5, 0.0, 0.5, 7, 42)
    assert s.stop == ["a", "b"] and s.ignore_eos
    assert req.stream and req.include_usage
    assert (req.pipeline, req.handoff) == ("p-rld-md", "catchup")


@pytest.mark.parametrize(
    "prompt, ids",
    [
        ("abc", chars("abc")),
        (["abc"], chars("abc")),
        ([5, 6, 7], [5, 6, 7]),
        ([[5, 6]], [5, 6]),
    ],
)
def test_prompt_forms(prompt, ids):
    assert completion({"prompt": prompt}).prompt_ids == ids


def test_nulls_mean_defaults():
    req = completion(
        {
            "prompt": "x",
            "model": None,
            "max_tokens": None,
            "temperature": None,
            "stop": None,
            "seed": None,
            "stream": None,
            "pdd": None,
            "logprobs": None,
            "echo": False,
        }
    )
    assert req.model == MODEL and req.sampling.max_tokens == 16 and req.sampling.temperature == 1.0


def test_fields_that_change_nothing_of_the_output_are_ignored():
    req = completion(
        {
            "prompt": "x",
            "user": "u",
            "metadata": {"a": "b"},
            "tools": [{"type": "function"}],
            "tool_choice": "none",
            "response_format": {"type": "text"},
        }
    )
    assert req.prompt_ids == chars("x")


def test_parameters_that_change_the_output_are_parsed_or_refused():
    s = completion(
        {
            "prompt": "x",
            "presence_penalty": 0.5,
            "frequency_penalty": -1,
            "repetition_penalty": 1.3,
            "min_tokens": 3,
            "stop_token_ids": [7, 9],
        }
    ).sampling
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_tokens, s.stop_token_ids) == (
        0.5,
        -1.0,
        1.3,
        3,
        [7, 9],
    )
    for body, param in (
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"logit_bias": {"1": 2}}, "logit_bias"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ):
        assert error_of(completion, {"prompt": "x", **body}).param == param, body


def test_include_usage_only_when_streaming():
    assert not completion({"prompt": "x", "stream_options": {"include_usage": True}}).include_usage
    assert completion({"prompt": "x", "stream": True, "stream_options": {"include_usage": True}}).include_usage


def test_stop_string_and_duplicates():
    assert completion({"prompt": "x", "stop": "END"}).sampling.stop == ["END"]
    assert completion({"prompt": "x", "stop": ["a", "a", "b"]}).sampling.stop == ["a", "b"]
    assert completion({"prompt": "x", "stop": []}).sampling.stop == []
    assert completion({"prompt": "x", "stop": ["1", "2", "3", "4"]}).sampling.stop == ["1", "2", "3", "4"]


def test_range_edges_are_accepted():
    req = completion({"prompt": "x", "temperature": 2, "top_p": 1, "top_k": -1, "seed": 0})
    assert req.sampling.temperature == 2.0 and isinstance(req.sampling.temperature, float)
    assert req.sampling.top_k == 0  # -1 means off
    assert req.sampling.seed == 0


# --- the body --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, code",
    [
        (b"{not json", "invalid_json"),
        (b"", "invalid_json"),
        (b'{"prompt": "x",}', "invalid_json"),
        (b'{"prompt": "x", "temperature": NaN}', "invalid_json"),
        (b'["prompt"]', "invalid_json"),
        (b'"hello"', "invalid_json"),
        (b'{"prompt": "\xff\xfe"}', "invalid_utf8"),
    ],
)
def test_bad_bodies_are_400(body, code):
    e = error_of(completion, body)
    assert e.status == 400 and e.code == code and e.type == "invalid_request_error"


def test_error_json_shape():
    e = error_of(completion, {"prompt": "x", "temperature": "hot"})
    assert e.to_json() == {
        "error": {"message": e.message, "type": "invalid_request_error", "param": "temperature", "code": None}
    }
    assert "temperature" in e.message and "hot" in e.message


def test_a_server_error_names_no_internal_host_or_port():
    inside = "KV push to md-0.site-b.internal:7500 (10.1.2.3:7500) failed; nats://10.0.0.9:4222 timed out"
    message = APIError(500, inside, type="server_error").to_json()["error"]["message"]
    assert message == "KV push to <internal> (<internal>) failed; <internal> timed out"
    assert APIError(400, "'max_tokens' must be >= 1, got 0").to_json()["error"]["message"].endswith("got 0")


def test_an_error_names_no_instance_to_a_client():
    ids = ["md-1", "md-10", "prefill-0"]
    full = APIError(429, "every md instance is full (md-1, md-10)", type="rate_limit_error").to_json(ids)
    assert full["error"]["message"] == "every md instance is full (<instance>, <instance>)"
    gone = APIError(503, "no alive md instance but md-1, which failed this request").to_json(ids)
    assert gone["error"]["message"] == "no alive md instance but <instance>, which failed this request"
    moved = APIError(500, "could not move the request after ['prefill-0'] failed").to_json(ids)
    assert moved["error"]["message"] == "could not move the request after ['<instance>'] failed"
    assert APIError(400, "'md-1x' is not a model").to_json(ids)["error"]["message"] == "'md-1x' is not a model"


def test_a_client_error_names_no_host_address_port_or_process_either():
    """4xx bodies are scrubbed as 5xx are: a scheduler's 429 may carry an instance's refusal with
    its endpoint; the client learns the cluster is full, not where or what is in it."""
    cfg = dataclasses.replace(load_config(None), control_plane=ControlPlaneConfig(gateways=2, schedulers=2))
    inside = "md-0 refused: KV listener md-0.site-b.internal:7500 (10.1.2.3:7500) full; scheduler-1 saw it"
    for status in (400, 404, 409, 429):
        message = APIError(status, inside).to_json(internal_names(cfg))["error"]["message"]
        assert message == "<instance> refused: KV listener <internal> (<internal>) full; <instance> saw it"
    lone = internal_names(load_config(None))  # a lone scheduler's name is only its role's word: kept
    assert "scheduler" not in lone and "md-0" in lone


def test_unknown_model_is_404():
    e = error_of(completion, {"prompt": "x", "model": "gpt-4"})
    assert (e.status, e.param, e.type, e.code) == (404, "model", "not_found_error", "model_not_found")
    assert "gpt-4" in e.message and MODEL in e.message
    assert error_of(completion, {"prompt": "x", "model": 3}).status == 400


def test_body_size():
    check_body_size(None)
    check_body_size("123")
    check_body_size(str(MAX_BODY_BYTES))
    assert error_of(check_body_size, str(MAX_BODY_BYTES + 1)).status == 413
    assert error_of(check_body_size, None, MAX_BODY_BYTES + 1).status == 413
    assert error_of(check_body_size, "10", 200, limit=100).status == 413  # a body longer than declared
    assert error_of(check_body_size, "abc").status == 400
    assert error_of(check_body_size, "-5").status == 400


# --- field validation: every bad input names its param ---------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", "ten"),
        ("max_tokens", 1.5),
        ("max_tokens", True),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("temperature", "hot"),
        ("temperature", True),
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("top_p", 0),
        ("top_p", 1.01),
        ("top_p", "all"),
        ("top_k", 1.5),
        ("top_k", -2),
        ("seed", "s"),
        ("seed", 2**64),
        ("seed", 1.0),
        ("stream", "yes"),
        ("stream", 1),
        ("ignore_eos", "true"),
        ("stop", 5),
        ("stop", [1]),
        ("stop", ""),
        ("stop", ["ok", ""]),
        ("stop", ["1", "2", "3", "4", "5"]),
        ("stream_options", "yes"),
        ("n", 2),
        ("n", 0),
        ("n", "1"),
        ("best_of", 3),
        ("logprobs", 6),
        ("logprobs", -1),
        ("logprobs", True),
        ("logprobs", 1.5),
        ("top_logprobs", 2),
        ("echo", True),
        ("suffix", "tail"),
        ("pdd", "p-md"),
    ],
)
def test_bad_field_is_400_naming_it(field, value):
    e = error_of(completion, {"prompt": "x", field: value})
    assert e.status == 400
    assert e.param == field
    assert field in e.message


def test_include_usage_must_be_boolean():
    e = error_of(completion, {"prompt": "x", "stream": True, "stream_options": {"include_usage": "y"}})
    assert (e.status, e.param) == (400, "stream_options.include_usage")


def test_unsupported_features_say_so():
    e = error_of(completion, {"prompt": "x", "n": 3})
    assert e.code == "unsupported_parameter" and "not supported" in e.message


@pytest.mark.parametrize(
    "pdd, param",
    [
        ({"pipeline": "p-x"}, "pdd.pipeline"),
        ({"pipeline": 1}, "pdd.pipeline"),
        ({"handoff": "later"}, "pdd.handoff"),
        ({"route": "p-md"}, "pdd.route"),
        ({"pipeline": "p-md", "handoff": "catchup"}, "pdd.handoff"),  # p-md has no handoff
        ({"ttft_slo_ms": 0}, "pdd.ttft_slo_ms"),
        ({"ttft_slo_ms": -100}, "pdd.ttft_slo_ms"),
        ({"ttft_slo_ms": 1e12}, "pdd.ttft_slo_ms"),
        ({"ttft_slo_ms": "fast"}, "pdd.ttft_slo_ms"),
        ({"ttft_slo_ms": True}, "pdd.ttft_slo_ms"),
    ],
)
def test_bad_pdd_extension(pdd, param):
    e = error_of(completion, {"prompt": "x", "pdd": pdd})
    assert (e.status, e.param) == (400, param)


def test_pdd_handoff_alone_is_a_hint_for_the_policy():
    req = completion({"prompt": "x", "pdd": {"handoff": "oneshot"}})
    assert (req.pipeline, req.handoff) == (None, "oneshot")


def test_pdd_ttft_slo_is_the_requests_own_target():
    req = completion({"prompt": "x", "pdd": {"ttft_slo_ms": 250}})
    assert (req.ttft_slo_ms, req.pipeline, req.steers) == (250.0, None, True)
    assert completion({"prompt": "x"}).steers is False


# --- prompts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"prompt": None},
        {"prompt": ""},
        {"prompt": []},
        {"prompt": [""]},
        {"prompt": [[]]},
        {"prompt": 5},
        {"prompt": {"text": "x"}},
        {"prompt": [1, "a"]},
        {"prompt": [1, True]},
        {"prompt": [1.0]},
        {"prompt": ["a", "b"]},
        {"prompt": [[1], [2]]},
        {"prompt": [-1, 2]},
    ],
)
def test_bad_prompt_is_400(body):
    e = error_of(completion, body)
    assert (e.status, e.param) == (400, "prompt")


def test_token_ids_beyond_the_vocabulary():
    assert completion({"prompt": [0, 99]}, vocab_size=100).prompt_ids == [0, 99]
    e = error_of(completion, {"prompt": [0, 100]}, vocab_size=100)
    assert e.param == "prompt" and "100" in e.message


# --- the context window ----------------------------------------------------------------------


def test_prompt_longer_than_context():
    e = error_of(completion, {"prompt": "x" * (CONTEXT + 1)})
    assert (e.status, e.param, e.code) == (400, "prompt", "context_length_exceeded")
    assert str(CONTEXT + 1) in e.message and str(CONTEXT) in e.message


def test_prompt_filling_the_context_leaves_no_room():
    e = error_of(completion, {"prompt": "x" * CONTEXT})
    assert e.param == "prompt"


def test_max_tokens_beyond_context():
    e = error_of(completion, {"prompt": "x", "max_tokens": CONTEXT + 1})
    assert (e.status, e.param) == (400, "max_tokens")
    assert str(CONTEXT + 1) in e.message and str(CONTEXT) in e.message


def test_prompt_plus_max_tokens_beyond_context():
    assert completion({"prompt": "x" * 40, "max_tokens": CONTEXT - 40}).sampling.max_tokens == CONTEXT - 40
    e = error_of(completion, {"prompt": "x" * 40, "max_tokens": CONTEXT - 39})
    assert (e.status, e.param, e.code) == (400, "max_tokens", "context_length_exceeded")
    assert all(str(n) in e.message for n in (40, CONTEXT - 39, CONTEXT + 1, CONTEXT))


def test_default_max_tokens_is_clipped_to_fit():
    assert completion({"prompt": "x" * (CONTEXT - 5)}).sampling.max_tokens == 5


# --- chat ------------------------------------------------------------------------------------


def test_chat_renders_messages_with_the_template():
    seen = []

    def template(messages, tools=None):
        seen.append(messages)
        return render(messages)

    body = {"messages": [{"role": "system", "content": "be brief", "name": "x"}, {"role": "user", "content": "hi"}]}
    req = chat(body, apply_template=template)
    assert req.kind == "chat"
    assert seen == [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]]
    assert req.prompt_ids == render(seen[0])
    assert req.sampling.max_tokens == 256


def test_chat_default_max_tokens_fits_the_context():
    req = chat({"messages": [{"role": "user", "content": "hi"}]}, context_len=20)
    assert req.sampling.max_tokens == 20 - len(render([{"role": "user", "content": "hi"}]))


def test_chat_max_completion_tokens_wins():
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "max_completion_tokens": 7}
    assert chat(body).sampling.max_tokens == 7
    assert chat({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9}).sampling.max_tokens == 9
    e = error_of(chat, {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9000})
    assert e.param == "max_completion_tokens" and "8192" in e.message


def test_chat_content_parts_and_tool_only_assistant_turns():
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "tool", "content": "42"},
    ]
    assert chat({"messages": msgs}).prompt_ids == render(
        [{"role": "user", "content": "ab"}, {"role": "assistant", "content": ""}, {"role": "tool", "content": "42"}]
    )


@pytest.mark.parametrize(
    "messages, param",
    [
        (None, "messages"),
        ("hi", "messages"),
        ({"role": "user"}, "messages"),
        ([], "messages"),
        (["hi"], "messages[0]"),
        ([{"content": "hi"}], "messages[0].role"),
        ([{"role": "robot", "content": "hi"}], "messages[0].role"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": 5}], "messages[1].content"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content"),
    ],
)
def test_bad_messages_are_400(messages, param):
    body = {} if messages is None else {"messages": messages}
    e = error_of(chat, body)
    assert (e.status, e.param) == (400, param)


def test_template_failure_is_400():
    def template(messages, tools=None):
        raise ValueError("roles must alternate")

    e = error_of(chat, {"messages": [{"role": "user", "content": "hi"}]}, apply_template=template)
    assert (e.status, e.param) == (400, "messages") and "roles must alternate" in e.message


def test_chat_validates_shared_fields_too():
    e = error_of(chat, {"messages": [{"role": "user", "content": "hi"}], "model": "other"})
    assert e.status == 404
    e = error_of(chat, {"messages": [{"role": "user", "content": "hi"}], "logprobs": "yes"})
    assert e.param == "logprobs"


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true, as OpenAI refuses it
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"logprobs": 3}, "logprobs"),  # chat's is a boolean
    ],
)
def test_chat_logprobs_fields_are_checked(fields, param):
    e = error_of(chat, {"messages": [{"role": "user", "content": "hi"}], **fields})
    assert (e.status, e.param) == (400, param), e.message


def test_logprobs_reach_the_sampling_parameters():
    """The number of alternatives travels in `Sampling.logprobs` to every role (None: none)."""
    hi = [{"role": "user", "content": "hi"}]
    assert chat({"messages": hi}).sampling.logprobs is None
    assert chat({"messages": hi, "logprobs": True}).sampling.logprobs == 0
    assert chat({"messages": hi, "logprobs": True, "top_logprobs": 5}).sampling.logprobs == 5
    assert chat({"messages": hi, "logprobs": False, "top_logprobs": None}).sampling.logprobs is None
    assert completion({"prompt": "x"}).sampling.logprobs is None
    assert completion({"prompt": "x", "logprobs": 0}).sampling.logprobs == 0
    assert completion({"prompt": "x", "logprobs": 5}).sampling.logprobs == 5
