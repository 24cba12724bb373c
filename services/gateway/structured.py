"""Structured outputs and tool calls: `response_format`, `tools`, `tool_choice` and
`parallel_tool_calls` parsed into a grammar the engines enforce, and the tool-aware prompt.

The grammar is llguidance's (shared/runtime/grammar.py applies it): a JSON schema for
`response_format` (`json_object`: any object; `json_schema`: the schema, `strict` or not, both
enforced), a Lark grammar for tool calls. JSON is generated compact and in one spelling
(`", "` between items, `": "` after keys, no other whitespace), so a tool call's text is a
function of its name and arguments and the next turn's rendered history matches the tokens
generated here (the prefix caches hit as on plain chat turns).

Tool calls are written in the Hermes format (Qwen2.5, Hermes and many more were trained on it),
one call per block, blocks separated by a newline:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`tool_choice`: `none` (tools in the prompt, no call), `auto` (text, or calls: the grammar
allows either, decided by the first character), `required` (one call or more), a named
function (exactly one call of it). `parallel_tool_calls: false` allows one call at most. A
chat template that knows tools (it mentions `tools`) renders them itself; for one that does not
(SmolLM2's), the tools are described in the system message (`tools_prompt`) and the history's
calls and results are rendered as the model wrote and will read them (`render_history`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import llguidance

Json = dict[str, Any]

# one JSON spelling: compact separators, no free whitespace (a small model can loop on it)
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CALL_OPEN = '<tool_call>\n{"name": "'
CALL_ARGS = '", "arguments": '
CALL_CLOSE = "}\n</tool_call>"
CALL_SEP = "\n"
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule
MAX_TOOLS = 128
TOOL_CHOICES = ("none", "auto", "required")


class SpecError(ValueError):
    """A bad `response_format` or `tools`: the message and the parameter it names."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tools:
    """A chat request's tools as the answer treats them."""

    functions: tuple[Json, ...]  # each tool's `function` object (name, description, parameters)
    choice: str  # "none" | "auto" | "required" | "function" (the named one)
    named: str | None = None
    parallel: bool = True

    @property
    def may_call(self) -> bool:
        return self.choice != "none"


def parse_response_format(value: Any) -> str:
    """The grammar of a `response_format` ("" for text)."""
    if value is None:
        return ""
    if not isinstance(value, dict):
        raise SpecError("'response_format' must be an object", "response_format")
    kind = value.get("type", "text")
    if kind == "text":
        return ""
    if kind == "json_object":
        return json_grammar({"type": "object"})
    if kind != "json_schema":
        raise SpecError(
            f"'response_format.type' must be text, json_object or json_schema; got {kind!r}", "response_format.type"
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise SpecError("'response_format.json_schema' must be an object with a 'name'", "response_format.json_schema")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise SpecError("'response_format.json_schema.strict' must be a boolean", "response_format.json_schema.strict")
    schema = spec.get("schema", {"type": "object"})  # OpenAI: no schema means any JSON object
    if not isinstance(schema, dict):
        raise SpecError("'response_format.json_schema.schema' must be an object", "response_format.json_schema.schema")
    return json_grammar(schema)


def json_grammar(schema: Json) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(_styled(schema))


def parse_tools(obj: Json) -> Tools | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat request (None without tools)."""
    tools, choice = obj.get("tools"), obj.get("tool_choice")
    parallel = obj.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise SpecError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise SpecError("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise SpecError(f"'tools' must be an array of at most {MAX_TOOLS} tools", "tools")
    functions = tuple(_function(t, f"tools[{i}]") for i, t in enumerate(tools))
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise SpecError("'tools' name a function twice", "tools")
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function")
        named = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or named not in names:
            raise SpecError(f"'tool_choice' must name one of the tools ({', '.join(names)})", "tool_choice")
        choice = "function"
    elif choice not in TOOL_CHOICES:
        raise SpecError(f"'tool_choice' must be none, auto, required or a function; got {choice!r}", "tool_choice")
    return Tools(functions, choice, named, parallel is not False)


def tool_grammar(tools: Tools) -> str:
    """The Lark grammar of what the answer may be ("" when it may be anything: choice none)."""
    if not tools.may_call:
        return ""
    functions = [f for f in tools.functions if tools.named in (None, f["name"])]
    rules = []
    for i, f in enumerate(functions):
        rules.append(f"call_{i}: {_lark_str(CALL_OPEN + f['name'] + CALL_ARGS)} args_{i} {_lark_str(CALL_CLOSE)}")
        rules.append(f"args_{i}: %json {json.dumps(_styled(f['parameters']))}")
    call = "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))
    calls = f"calls: call ({_lark_str(CALL_SEP)} call)*" if tools.parallel and tools.named is None else "calls: call"
    # auto: free text (anything not opening with "<") or calls
    start = "start: TEXT | calls\nTEXT: /[^<][\\s\\S]*/" if tools.choice == "auto" else "start: calls"
    return llguidance.LLMatcher.grammar_from_lark("\n".join([start, calls, call, *rules]))


def check_grammar(grammar: str, vocab: llguidance.LLTokenizer | None, param: str) -> None:
    """400 for a grammar that does not compile (a schema llguidance cannot enforce)."""
    error = llguidance.LLMatcher.validate_grammar(grammar, vocab)
    if error:
        raise SpecError(f"'{param}' cannot be enforced: {error}", param)


def tools_prompt(tools: Tools) -> str:
    """The tools described for a template that does not know them (Hermes' system prompt)."""
    specs = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in tools.functions)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{specs}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def render_history(messages: list[Json], tools: Tools | None) -> list[Json]:
    """Messages as a template without tools reads them: the tools in the system message, each
    assistant call as the model writes it, each tool result in `<tool_response>` tags."""
    out: list[Json] = []
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = CALL_SEP.join(call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        elif m["role"] == "tool":
            content = f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": m["role"], "content": content})
    if tools is not None:
        prompt = tools_prompt(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def native_history(messages: list[Json]) -> list[Json]:
    """Messages for a template that knows tools: calls' arguments as objects (Hugging Face's
    convention)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                {**c, "function": {**c["function"], "arguments": _loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_history_calls(value: Any, param: str) -> list[Json]:
    """An assistant message's `tool_calls`, as the client sends them back."""
    if not isinstance(value, list):
        raise SpecError(f"'{param}' must be an array", param)
    calls = []
    for i, c in enumerate(value):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise SpecError(
                f"'{param}[{i}]' must have a function with a name and arguments (a string)", f"{param}[{i}]"
            )
        calls.append(
            {"id": c.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": fn["arguments"]}}
        )
    return calls


def call_text(name: str, arguments: str) -> str:
    return f"{CALL_OPEN}{name}{CALL_ARGS}{arguments}{CALL_CLOSE}"


def _function(tool: Any, param: str) -> Json:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise SpecError(f'\'{param}\' must be {{"type": "function", "function": {{...}}}}', param)
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise SpecError(f"'{param}.function.name' must match [A-Za-z0-9_-]{{1,64}}", f"{param}.function.name")
    if not isinstance(fn.get("description", ""), str):
        raise SpecError(f"'{param}.function.description' must be a string", f"{param}.function.description")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        raise SpecError(f"'{param}.function.parameters' must be a JSON schema object", f"{param}.function.parameters")
    return {k: v for k, v in {**fn, "parameters": params}.items() if k in ("name", "description", "parameters")}


def _styled(schema: Json) -> Json:
    """The schema in PDD's one JSON spelling (llguidance's `x-guidance` options are PDD's to set)."""
    return {**schema, "x-guidance": JSON_STYLE}


def _lark_str(text: str) -> str:
    return json.dumps(text)  # a Lark string literal is a JSON one
