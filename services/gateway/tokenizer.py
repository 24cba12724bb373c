"""The gateway's tokenizer: Hugging Face `tokenizers` and the model's Jinja chat template.

The gateway turns text into token ids and back but never runs the model, so it loads neither
torch nor transformers (seconds of start-up and hundreds of MB). It reads the same files
transformers would (`tokenizer.json`, `tokenizer_config.json`, `chat_template.jinja`) and
renders the chat template the way transformers does (a sandboxed Jinja environment with
`trim_blocks`, `lstrip_blocks`, loop controls, `tojson` and `raise_exception`);
tests/gateway/test_tokenizer.py checks both against transformers token for token.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class TemplateError(ValueError):
    """The chat template refused the messages (its `raise_exception`)."""


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json spells it: a string or an AddedToken map."""
    return value.get("content") if isinstance(value, dict) else value


class TextTokenizer:
    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        self._tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}
        self.special = {
            k: _token_text(config[k]) for k in ("bos_token", "eos_token", "unk_token", "pad_token") if config.get(k)
        }
        template_path = folder / "chat_template.jinja"
        source = template_path.read_text() if template_path.exists() else config.get("chat_template")
        self._template = _compile(source) if isinstance(source, str) else None
        self.knows_tools = isinstance(source, str) and "tools" in source  # renders `tools` itself

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        if self._template is None:
            raise TemplateError("this model has no chat template; use /v1/completions")
        return self._template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools, documents=None, **self.special
        )


def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
