"""Structured outputs and tool calls through the official OpenAI SDK against the live float32
cluster, on every pipeline: the grammar is enforced by whichever role samples (prefill the first
token, the relay, main-decode after the handoff, each rebuilding the grammar's state from the
ids it holds), so every call's arguments parse and validate, a JSON answer handed over in its
middle is the one `p-md` gives, and an agent loop's turns hit the prefix caches."""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest

from tests.cluster.conftest import fresh_prompt
from tests.cluster.test_relay import PLANS

pytestmark = pytest.mark.slow

WEATHER = {  # enums
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
FLIGHT = {  # nested objects
    "type": "object",
    "properties": {
        "origin": {"type": "string", "maxLength": 16},
        "destination": {"type": "string", "maxLength": 16},
        "passengers": {
            "type": "object",
            "properties": {
                "adults": {"type": "integer", "minimum": 1, "maximum": 9},
                "children": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["adults", "children"],
            "additionalProperties": False,
        },
    },
    "required": ["origin", "destination", "passengers"],
    "additionalProperties": False,
}
SUM = {  # arrays
    "type": "object",
    "properties": {
        "numbers": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "maxItems": 4}
    },
    "required": ["numbers"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "book_flight": FLIGHT, "add_numbers": SUM}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": f"{name.replace('_', ' ')}", "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
ASK = {
    "get_weather": "What is the weather in Lisbon?",
    "book_flight": "Book a flight from Oslo to Rome for two adults and one child.",
    "add_numbers": "Add 12, 30 and 7.",
}


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused-on-an-open-gateway", max_retries=0)


def _plan(pipeline: str, handoff: str | None) -> dict:
    return {"pdd": {"pipeline": pipeline, **({"handoff": handoff} if handoff else {})}}


def _valid_calls(calls, allowed: set[str]) -> list[tuple[str, dict]]:
    out = []
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in allowed
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        out.append((call.function.name, arguments))
    return out


def _streamed_calls(stream) -> tuple[list[tuple[str, dict]], str | None]:
    """The calls of a streamed answer, put together from `delta.tool_calls` as a client does."""
    names, arguments, finish = {}, {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            if d.function.name:
                names[d.index] = d.function.name
                assert d.id.startswith("call_") and d.type == "function"
            arguments[d.index] = arguments.get(d.index, "") + (d.function.arguments or "")
    return [(names[i], json.loads(arguments[i])) for i in sorted(names)], finish


def test_named_and_required_calls_parse_and_validate_on_every_pipeline(client, model_id):
    names = list(SCHEMAS)
    for i, (pipeline, handoff) in enumerate(PLANS):
        name = names[i % len(names)]
        messages = [{"role": "user", "content": ASK[name]}]
        kwargs = dict(model=model_id, messages=messages, max_tokens=120, temperature=0, tools=TOOLS)
        named = {"type": "function", "function": {"name": name}}
        whole = client.chat.completions.create(**kwargs, tool_choice=named, extra_body=_plan(pipeline, handoff))
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [(called, args)] = _valid_calls(choice.message.tool_calls, {name})
        print(f"\n{pipeline} {handoff or ''}: {called}({args}) {whole.model_extra['pdd']['tokens_by_role']}")
        assert called == name
        stream = client.chat.completions.create(
            **kwargs, tool_choice=named, stream=True, extra_body=_plan(pipeline, handoff)
        )
        assert _streamed_calls(stream) == ([(name, args)], "tool_calls"), (pipeline, handoff)
        if (pipeline, handoff) == ("p-rld-md", "catchup"):  # required: any of the three, whole and streamed
            required = dict(
                kwargs, tool_choice="required", parallel_tool_calls=False, extra_body=_plan(pipeline, handoff)
            )
            whole = client.chat.completions.create(**required)
            assert whole.choices[0].finish_reason == "tool_calls"
            [(called, args)] = _valid_calls(whole.choices[0].message.tool_calls, set(names))
            assert _streamed_calls(client.chat.completions.create(**required, stream=True)) == (
                [(called, args)],
                "tool_calls",
            )


class Forecast(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=24)
    unit: str = pydantic.Field(pattern="^(celsius|fahrenheit)$")
    highs: list[int] = pydantic.Field(max_length=3)


def test_parse_with_a_pydantic_model_returns_a_valid_object(client, model_id):
    messages = [{"role": "user", "content": "Give me the forecast for Madrid for three days."}]
    r = client.chat.completions.parse(
        model=model_id,
        messages=messages,
        response_format=Forecast,
        max_tokens=100,
        temperature=0,
        extra_body=_plan("p-rld-md", "catchup"),
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Forecast) and r.choices[0].finish_reason == "stop"
    assert Forecast.model_validate_json(r.choices[0].message.content) == parsed


def test_a_json_answer_handed_over_in_its_middle_equals_p_md(client, model_id):
    fmt = {"type": "json_schema", "json_schema": {"name": "flight", "schema": FLIGHT, "strict": True}}
    prompt = fresh_prompt(20, "json-handoff-") + " Book a flight from Paris to Tokyo for one adult, as JSON."
    seen = {}
    for pipeline, handoff in PLANS:
        r = client.chat.completions.create(
            model=model_id,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=100,
            temperature=0,
            response_format=fmt,
            extra_body=_plan(pipeline, handoff),
        )
        text = r.choices[0].message.content
        jsonschema.validate(json.loads(text), FLIGHT)
        seen[(pipeline, handoff)] = (text, r.model_extra["pdd"]["tokens_by_role"])
    print(f"\n{seen}")
    roles = seen[("p-rld-md", "catchup")][1]
    assert roles["rld"] > 0 and roles["md"] > 0, roles  # the JSON was started by the relay, ended by main-decode
    assert len({text for text, _ in seen.values()}) == 1, seen


@pytest.mark.parametrize("pipeline, handoff", PLANS)
def test_an_agent_loop_is_valid_at_every_turn_and_hits_the_caches(client, model_id, cluster, pipeline, handoff):
    """call, tool result, call, tool result, answer; each turn's prefix is the last turn's prompt."""
    block = cluster.cfg.block_size
    messages = [
        {"role": "system", "content": "You are a travel agent. " + fresh_prompt(10, "agent-")},
        {"role": "user", "content": "I want to fly from Oslo to Rome with my son. How is the weather there?"},
    ]
    turns = [{"type": "function", "function": {"name": "book_flight"}}, "required", "none"]
    results = ['{"booked": true, "ref": "QX7"}', '{"temperature": 24, "sky": "clear"}']
    last_prompt = 0
    for turn, choice in enumerate(turns):
        r = client.chat.completions.create(
            model=model_id,
            messages=messages,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            max_tokens=120 if choice != "none" else 24,
            temperature=0,
            extra_body=_plan(pipeline, handoff),
        )
        message, pdd = r.choices[0].message, r.model_extra["pdd"]
        hit = pdd["prefix_hit_tokens"]["prefill"]
        assert hit >= (last_prompt // block) * block, (turn, hit, last_prompt)  # the previous turn's prompt
        last_prompt = r.usage.prompt_tokens
        print(f"\nturn {turn}: prompt {last_prompt}, prefill hit {hit}: {message.tool_calls or message.content}")
        if choice == "none":
            assert message.tool_calls is None and message.content and r.choices[0].finish_reason in ("stop", "length")
            break
        [(name, _)] = _valid_calls(message.tool_calls, set(SCHEMAS))
        assert turn or name == "book_flight"
        messages.append(message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": results[turn]})
