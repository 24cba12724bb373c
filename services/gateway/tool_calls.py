"""Tool calls out of the answer's text, as it streams: OpenAI's `delta.tool_calls`.

The answer of a request that may call tools is either text or calls in the Hermes format
(services/gateway/structured.py; the grammar guarantees one or the other, decided by the first
character). `ToolCallStream.feed` takes each text delta and returns what the client gets now:
content, or tool-call deltas (the first of each call with its index, id, type and name, then
fragments of its arguments as they are generated). Text that may still turn out to be part of
a call's frame (a prefix of `<tool_call>`, or of the closing `}` + `</tool_call>`) is held until
the next delta decides it. `end()` releases what is held when the answer stops (a call cut by
`max_tokens` ends with the arguments it has, as OpenAI's do).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from services.gateway.structured import CALL_ARGS, CALL_CLOSE, CALL_OPEN, CALL_SEP

Json = dict[str, Any]


class ToolCallStream:
    def __init__(self) -> None:
        self.calls: list[Json] = []  # whole calls so far, OpenAI's `message.tool_calls`
        self._buf = ""
        self._mode = "undecided"  # -> "text" | "open" | "name" | "args" | "between"

    @classmethod
    def of(cls, flow) -> ToolCallStream | None:
        """A parser for a request that may call tools, else None."""
        tools = flow.parsed.tools
        return cls() if tools is not None and tools.may_call else None

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: `tool_calls` for an answer that stopped after calling."""
        return "tool_calls" if reason == "stop" and self.calls else reason

    def delta(self, text: str, finished: bool) -> tuple[str, list[Json]]:
        """`feed`, and `end` too on the answer's last delta."""
        content, deltas = self.feed(text)
        if finished:
            rest, more = self.end()
            content, deltas = content + rest, deltas + more
        return content, deltas

    def feed(self, text: str) -> tuple[str, list[Json]]:
        """This delta's content and tool-call deltas."""
        self._buf += text
        content, deltas = "", []
        while True:
            step = self._step(deltas)
            if step is None:
                return content, deltas
            content += step

    def end(self) -> tuple[str, list[Json]]:
        """What was held when the answer stopped."""
        rest, self._buf = self._buf, ""
        if self._mode in ("undecided", "text"):
            return rest, []
        if self._mode == "args" and rest and not self._frame_began(rest):
            return "", [self._arguments(rest)]
        return "", []

    def _frame_began(self, held: str) -> bool:
        """Whether text held at the end is the closing frame's start rather than arguments: a
        newline is never in compact JSON; a lone `}` is the frame's if the arguments are whole."""
        if "\n" in held:
            return True
        try:
            json.loads(self.calls[-1]["function"]["arguments"])
            return True
        except ValueError:
            return False

    def _step(self, deltas: list[Json]) -> str | None:
        """Consume what the buffer decides: content returned, deltas appended; None: wait."""
        buf, mode = self._buf, self._mode
        if mode == "text":
            self._buf = ""
            return buf or None
        if mode in ("undecided", "open", "between"):
            if mode == "between":
                if not buf:
                    return None
                if not buf.startswith(CALL_SEP):
                    self._mode = "text"
                    return ""
                buf = self._buf = buf[len(CALL_SEP) :]
                self._mode = "open"
            if buf.startswith(CALL_OPEN):
                self._buf, self._mode = buf[len(CALL_OPEN) :], "name"
                return ""
            if CALL_OPEN.startswith(buf):
                return None
            self._mode = "text"  # not a call: the answer is text (or, after calls, text the grammar forbids)
            return ""
        if mode == "name":
            end = buf.find(CALL_ARGS)
            if end < 0:
                return None
            name = buf[:end]
            call = {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
            self.calls.append(call)
            deltas.append({"index": len(self.calls) - 1, **call, "function": {"name": name, "arguments": ""}})
            self._buf, self._mode = buf[end + len(CALL_ARGS) :], "args"
            return ""
        # args: up to the closing frame; hold a tail that may be its beginning
        end = buf.find(CALL_CLOSE)
        if end >= 0:
            if end:
                deltas.append(self._arguments(buf[:end]))
            self._buf, self._mode = buf[end + len(CALL_CLOSE) :], "between"
            return ""
        keep = _held(buf, CALL_CLOSE)
        if len(buf) == keep:
            return None
        deltas.append(self._arguments(buf[: len(buf) - keep]))
        self._buf = buf[len(buf) - keep :]
        return None

    def _arguments(self, fragment: str) -> Json:
        call = self.calls[-1]
        call["function"]["arguments"] += fragment
        return {"index": len(self.calls) - 1, "function": {"arguments": fragment}}


def _held(text: str, frame: str) -> int:
    """The length of the longest end of `text` that begins `frame`."""
    for n in range(min(len(text), len(frame) - 1), 0, -1):
        if frame.startswith(text[-n:]):
            return n
    return 0
