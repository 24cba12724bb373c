"""Gateway: the OpenAI-compatible HTTP/SSE front door.

Lifecycle of a request here:
1. The body is size-checked, parsed and validated (`openai_api`): a bad request gets an
   OpenAI-shaped 4xx and nothing is created anywhere.
2. Admission: past `max_queue` requests in flight the answer is 429 with Retry-After.
3. `RequestFlow` submits it to the scheduler and turns the token chunks that come back into
   text deltas (in order, de-duplicated, UTF-8 safe, cut at stop strings).
4. Streamed as SSE (`data: {...}` ... `data: [DONE]`) or returned whole. The last chunk carries
   the `pdd` object. An error after streaming began is sent as an SSE error event.
5. Whatever happens — finish, error, client disconnect — the flow is closed: an unfinished
   request is aborted in every stage.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from services.gateway.flow import RequestFlow, StreamError
from services.gateway.gateway import Gateway
from services.gateway.openai_api import APIError, ParsedRequest, check_body_size, parse_chat, parse_completion


def create_app(gw: Gateway) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gw.start()
        yield
        await gw.stop()

    app = FastAPI(title="PDD gateway", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        gw.metrics.count_request("error", e.status)
        headers = {"Retry-After": "1"} if e.status in (429, 503) else None
        return JSONResponse(e.to_json(), status_code=e.status, headers=headers)

    @app.get("/health")
    async def health() -> JSONResponse:
        missing = await gw.missing_roles()
        body = {"status": "ok" if not missing else "degraded", "missing_roles": missing}
        return JSONResponse(body, status_code=200 if not missing else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": gw.served_model, "object": "model", "owned_by": "pdd",
                                            "max_model_len": gw.context_len}]}  # fmt: skip

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(gw.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(request: Request):
        gw.check_capacity()  # before reading or tokenizing anything: a full gateway answers at once
        body = await _body(request)
        parsed = await asyncio.to_thread(  # tokenizing a long prompt must not stall every other stream
            parse_completion, body, served_model=gw.served_model, context_len=gw.context_len,
            count_tokens=gw.encode, vocab_size=gw.vocab_size)  # fmt: skip
        return await _serve(gw, parsed)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        gw.check_capacity()
        body = await _body(request)
        parsed = await asyncio.to_thread(parse_chat, body, served_model=gw.served_model,
                                         context_len=gw.context_len, apply_template=gw.apply_chat_template)  # fmt: skip
        return await _serve(gw, parsed)

    return app


async def _body(request: Request) -> bytes:
    check_body_size(request.headers.get("content-length"))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        check_body_size(None, size)
        chunks.append(chunk)
    return b"".join(chunks)


async def _serve(gw: Gateway, parsed: ParsedRequest):
    flow = gw.admit(parsed)  # raises 429 when full
    try:
        await flow.start()
    except BaseException:
        await gw.release(flow)
        raise
    if parsed.stream:
        return StreamingResponse(_sse(gw, flow), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": flow.request_id})  # fmt: skip
    try:
        text, finish, pdd = "", None, {}
        async for delta in flow.deltas():
            text += delta.text
            finish, pdd = delta.finish_reason or finish, delta.pdd or pdd
    except StreamError as e:
        raise APIError(500, str(e), type="server_error") from None
    finally:
        await gw.release(flow)
    return JSONResponse(_whole(gw, flow, text, finish, pdd))


async def _sse(gw: Gateway, flow: RequestFlow) -> AsyncIterator[bytes]:
    first = True
    try:
        async for delta in flow.deltas():
            chunk = _chunk(gw, flow, delta.text, delta.finish_reason, first)
            first = False
            if delta.pdd is not None:
                chunk["pdd"] = delta.pdd
                if flow.parsed.include_usage:
                    chunk["usage"] = _usage(flow)
            yield _event(chunk)
    except StreamError as e:
        yield _event(APIError(500, str(e), type="server_error").to_json())
    finally:
        await gw.release(flow)
    yield b"data: [DONE]\n\n"


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _chunk(gw: Gateway, flow: RequestFlow, text: str, finish: str | None, first: bool) -> dict:
    base = {"id": flow.request_id, "created": int(time.time()), "model": gw.served_model}
    if flow.parsed.kind == "chat":
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {**base, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}  # fmt: skip
    return {**base, "object": "text_completion",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}  # fmt: skip


def _usage(flow: RequestFlow) -> dict:
    p, c = len(flow.parsed.prompt_ids), flow.stats.completion_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _whole(gw: Gateway, flow: RequestFlow, text: str, finish: str | None, pdd: dict) -> dict:
    base = {"id": flow.request_id, "created": int(time.time()), "model": gw.served_model,
            "usage": _usage(flow), "pdd": pdd}  # fmt: skip
    if flow.parsed.kind == "chat":
        message = {"role": "assistant", "content": text}
        return {**base, "object": "chat.completion",
                "choices": [{"index": 0, "message": message, "finish_reason": finish}]}  # fmt: skip
    return {**base, "object": "text_completion",
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}  # fmt: skip
