"""Structured outputs and tool calls at the gateway: what `response_format`, `tools` and
`tool_choice` become (a grammar checked against the model's vocabulary, or a 400 naming the
parameter), the prompt a template without tools gets, and the tool-call stream that turns the
answer's text into OpenAI's `delta.tool_calls`, whatever the deltas' boundaries."""

from __future__ import annotations

import json
import random

import llguidance
import pytest

from services.gateway import structured
from services.gateway.errors import APIError
from services.gateway.openai_api import parse_chat, parse_completion
from services.gateway.structured import Tools, call_text, render_history, tool_grammar
from services.gateway.tool_calls import ToolCallStream

ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
CITY = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome"]}}, "required": ["city"]}
HUGE = {"enum": [f"value-{i}" for i in range(20_000)]}  # a grammar past what a task may carry
TOOLS = [
    {"type": "function", "function": {"name": "add", "description": "adds", "parameters": ADD}},
    {"type": "function", "function": {"name": "weather", "parameters": CITY}},
]


@pytest.fixture(scope="module")
def vocab(smol_dir):
    return llguidance.LLTokenizer(str(smol_dir / "tokenizer.json"), n_vocab=49152, eos_token=[2])


def chat(body: dict, vocab=None):
    raw = json.dumps({"messages": [{"role": "user", "content": "hi"}], **body}).encode()
    seen = {}

    def template(messages, tools=None):
        seen.update(messages=messages, tools=tools)
        return [1] * 10

    req = parse_chat(raw, served_model="m", context_len=4096, apply_template=template, grammar_vocab=vocab)
    return req, seen


def error(body: dict, vocab=None, endpoint=chat) -> APIError:
    with pytest.raises(APIError) as info:
        if endpoint is chat:
            chat(body, vocab)
        else:
            parse_completion(
                json.dumps({"prompt": "x", **body}).encode(),
                served_model="m",
                context_len=4096,
                count_tokens=lambda t: [1],
                grammar_vocab=vocab,
            )
    assert info.value.status == 400
    return info.value


def accepts(grammar: str, vocab, text: str) -> bool:
    m = llguidance.LLMatcher(vocab, grammar)
    ids = vocab.tokenize_str(text)
    return m.try_consume_tokens(ids) == len(ids) and m.is_accepting()


def test_response_format_becomes_a_grammar_in_one_json_spelling(vocab):
    req, _ = chat({"response_format": {"type": "json_object"}}, vocab)
    assert accepts(req.sampling.grammar, vocab, '{"a": [1, 2], "b": {"c": null}}')
    assert not accepts(req.sampling.grammar, vocab, '{"a":[1,2]}')  # one spelling: ", " and ": "
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": CITY, "strict": True}}
    req, _ = chat({"response_format": fmt}, vocab)
    assert accepts(req.sampling.grammar, vocab, '{"city": "Rome"}')
    assert not accepts(req.sampling.grammar, vocab, '{"city": "Paris"}')
    completion = parse_completion(
        json.dumps({"prompt": "x", "response_format": fmt}).encode(),
        served_model="m",
        context_len=4096,
        count_tokens=lambda t: [1],
        grammar_vocab=vocab,
    )
    assert completion.sampling.grammar == req.sampling.grammar
    assert chat({"response_format": {"type": "text"}})[0].sampling.grammar == ""


def test_bad_formats_and_tools_are_400_naming_the_parameter(vocab):
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}
    for body, param in (
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": bad_schema}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": HUGE}}},
            "response_format",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
            "messages[0].tool_calls[0]",
        ),
    ):
        assert error(body, vocab).param == param, body
    assert error({"tools": TOOLS}, vocab, endpoint=parse_completion).param == "tools"
    # tools passed with tool_choice none change nothing of the output: allowed, no grammar
    req, seen = chat({"tools": TOOLS, "tool_choice": "none"}, vocab)
    assert req.sampling.grammar == "" and seen["tools"].functions[0]["name"] == "add"


def test_each_tool_choice_allows_what_it_says(vocab):
    add = call_text("add", '{"a": 1, "b": 2}')
    rome = call_text("weather", '{"city": "Rome"}')
    functions = tuple(t["function"] for t in TOOLS)
    auto = tool_grammar(Tools(functions, "auto"))
    assert accepts(auto, vocab, "Just text, no call.") and accepts(auto, vocab, add + "\n" + rome)
    assert not accepts(auto, vocab, call_text("add", '{"a": 1}'))  # a call's arguments follow its schema
    required = tool_grammar(Tools(functions, "required"))
    assert accepts(required, vocab, rome) and not accepts(required, vocab, "text")
    one = tool_grammar(Tools(functions, "required", parallel=False))
    assert accepts(one, vocab, add) and not accepts(one, vocab, add + "\n" + rome)
    named = tool_grammar(Tools(functions, "function", named="weather"))
    assert accepts(named, vocab, rome) and not accepts(named, vocab, add)
    assert tool_grammar(Tools(functions, "none")) == ""


def test_a_template_without_tools_reads_them_and_the_history_as_the_model_writes_them():
    tools = structured.parse_tools({"tools": TOOLS})
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "content": "3", "tool_call_id": "call_1"},
    ]
    out = render_history(messages, tools)
    assert out[0]["content"].startswith("Be brief.\n\n# Tools") and '"name": "add"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": call_text("add", '{"a": 1}')}  # exactly what was generated
    assert out[3] == {"role": "tool", "content": "<tool_response>\n3\n</tool_response>"}
    assert render_history(messages[1:2], tools)[0]["role"] == "system"  # no system message: one is added


def feed_in_pieces(text: str, seed: int) -> tuple[str, list[dict], ToolCallStream]:
    rng, stream, content, deltas, i = random.Random(seed), ToolCallStream(), "", [], 0
    while i < len(text):
        n = rng.randint(1, 7)
        c, d = stream.delta(text[i : i + n], finished=i + n >= len(text))
        content, deltas, i = content + c, deltas + d, i + n
    return content, deltas, stream


def test_the_tool_call_stream_is_the_same_whatever_the_delta_boundaries():
    tricky = '{"a": 1, "b": "}\\n</tool_call> inside a string"}'  # the closing frame inside an argument
    text = call_text("add", tricky) + "\n" + call_text("weather", "{}")
    for seed in range(50):
        content, deltas, stream = feed_in_pieces(text, seed)
        assert content == "" and stream.finish_reason("stop") == "tool_calls"
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in stream.calls] == [
            ("add", tricky),
            ("weather", "{}"),
        ]
        firsts = [d for d in deltas if "id" in d]
        assert [(d["index"], d["function"]["name"], d["type"]) for d in firsts] == [
            (0, "add", "function"),
            (1, "weather", "function"),
        ]
        joined = {}
        for d in deltas:
            joined[d["index"]] = joined.get(d["index"], "") + d["function"]["arguments"]
        assert joined == {0: tricky, 1: "{}"}
    for seed in range(10):
        content, deltas, stream = feed_in_pieces("<toast> is not a call", seed)
        assert content == "<toast> is not a call" and deltas == [] and stream.finish_reason("stop") == "stop"


def test_a_call_cut_by_max_tokens_ends_with_the_arguments_it_has():
    stream = ToolCallStream()
    content, deltas = stream.delta(call_text("add", '{"a": 1, "b"')[: -len("}\n</tool_call>")], finished=True)
    assert content == "" and stream.calls[0]["function"]["arguments"] == '{"a": 1, "b"'
    assert stream.finish_reason("length") == "length"
    head = call_text("add", "")[: -len("}\n</tool_call>")]
    for tail, arguments in (
        ('{"a": 1}}', '{"a": 1}'),  # the lone brace after whole arguments is the closing frame's
        ('{"a": 1}}\n</', '{"a": 1}'),
        ('{"a": {"b": 1}}', '{"a": {"b": 1}}'),  # this brace closes the arguments themselves
    ):
        stream = ToolCallStream()
        stream.delta(head + tail, finished=True)
        assert stream.calls[0]["function"]["arguments"] == arguments, tail


def test_a_template_that_knows_tools_renders_them_itself(tmp_path, smol_dir):
    import shutil
    from types import SimpleNamespace

    from services.gateway.gateway import Gateway
    from services.gateway.tokenizer import TextTokenizer

    shutil.copy(smol_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text(
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}: {{ m.content }}"
        "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments.a }}]{% endfor %}"
        "\n{% endfor %}"
    )
    native = SimpleNamespace(tokenizer=TextTokenizer(tmp_path))
    assert native.tokenizer.knows_tools and not TextTokenizer(smol_dir).knows_tools
    tools = structured.parse_tools({"tools": TOOLS})
    messages = [
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": '{"a": 1}'}}]},
    ]
    ids = Gateway.apply_chat_template(native, messages, tools)
    assert native.tokenizer.decode(ids) == "TOOLS:add;weather;user: 1+2?assistant: [add 1]"  # arguments as an object


def test_a_schema_cannot_change_the_json_spelling(vocab):
    loose = {"type": "object", "x-guidance": {"whitespace_flexible": True, "lenient": True}}
    for x_guidance in (loose["x-guidance"], "not an object"):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {**loose, "x-guidance": x_guidance}}}
        req, _ = chat({"response_format": fmt}, vocab)
        assert accepts(req.sampling.grammar, vocab, '{"a": 1}') and not accepts(
            req.sampling.grammar, vocab, '{ "a" :1}'
        )
