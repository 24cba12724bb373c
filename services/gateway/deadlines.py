"""Deadlines on the client's side of the gateway: the request body must arrive, and each SSE
write must be taken, within `timeouts.client_s`.

Without them a client that sends half a body, or stops reading its stream, holds its admission
slot (one of `max_queue`) and its request's place in every stage for as long as it hangs: 64 of
them lock every tenant out. A body that does not arrive is answered 408. A stream whose client
stops reading fills the socket's buffers, then its next write waits; past the deadline the
stream ends there, its request is released (aborted in every stage) and the slot is free. The
connection itself closes once the client reads or goes (the server's transport flushes before
it closes; ASGI gives no way to reset it).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Message, Send

from services.gateway.errors import APIError, invalid

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024


def check_body_size(content_length: str | None, received: int | None = None, limit: int = MAX_BODY_BYTES) -> None:
    """413 when the declared Content-Length (check before reading) or the body read is too big."""
    if content_length is not None:
        if not re.fullmatch(r"\s*[0-9]+\s*", content_length):
            raise invalid(f"Content-Length {content_length!r} is not a non-negative integer", code="bad_content_length")
        received = max(int(content_length), received or 0)
    if received is not None and received > limit:
        raise APIError(413, f"request body is {received} bytes; the limit is {limit}", code="request_too_large")


async def read_body(request: Request, deadline_s: float) -> bytes:
    """The whole body, size-checked as it comes; 408 when it has not all come within the deadline."""
    check_body_size(request.headers.get("content-length"))
    chunks, size = [], 0
    try:
        async with asyncio.timeout(deadline_s):
            async for chunk in request.stream():
                size += len(chunk)
                check_body_size(None, size)
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(408, f"the request body did not arrive within {deadline_s:g} s", code="body_timeout") from None
    return b"".join(chunks)


class ClientStalled(Exception):
    """A write to the client was not taken within the deadline."""


class DeadlineStream(StreamingResponse):
    """An SSE stream each of whose writes the client must take within `send_s`. When one is not
    taken, `on_stall` is told and the stream's generator is closed (its `finally` releases the
    request) instead of waiting on a client that does not read."""

    def __init__(self, content: AsyncIterator[bytes], send_s: float, on_stall: Callable[[], None], **kw) -> None:
        super().__init__(content, **kw)
        self.send_s = send_s
        self.on_stall = on_stall

    async def stream_response(self, send: Send) -> None:
        async def timed(message: Message) -> None:
            try:
                async with asyncio.timeout(self.send_s):
                    await send(message)
            except TimeoutError:
                raise ClientStalled from None

        try:
            await super().stream_response(timed)
        except ClientStalled:
            self.on_stall()
        finally:
            await self.body_iterator.aclose()
