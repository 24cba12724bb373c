"""Gateway: the OpenAI-compatible HTTP/SSE front door.

Lifecycle of a request here:
1. The API key is checked (`auth.KeyRing`: 401 without a valid one; `/health` stays open).
   The body is size-checked, read within `timeouts.client_s` (`deadlines`), parsed and
   validated off the event loop (`openai_api`): a bad request gets an OpenAI-shaped 4xx and
   nothing is created anywhere. Only admin keys may
   steer the plan (`pdd` overrides): 403 otherwise.
2. Admission: past `max_queue` requests in flight, or past the key's own limits (concurrent
   requests, tokens per minute), the answer is 429 with Retry-After.
3. `RequestFlow` submits it to the scheduler and turns the token chunks that come back into
   text deltas (in order, de-duplicated, UTF-8 safe, cut at stop strings).
4. Streamed as SSE (`data: {...}` ... `data: [DONE]`, the usage in its own last chunk when
   asked) or returned whole. The last chunk carries the `pdd` object as the key may see it.
   An error after streaming began is sent as an SSE error event. Every response carries
   `X-Request-Id` (the client's, when it sent one: letters, digits, `_`, `:` and `-`; anything
   else is 400). The stages know it in the key's namespace (`auth.scoped_request_id`): one
   key's id never names another key's request. No error body names an instance, a host, an
   address or a port (`errors.APIError.to_json`); the log has them.
5. Whatever happens — finish, error, a streaming or a waiting client gone, a streaming client
   that takes no data for `timeouts.client_s` — the flow is closed:
   an unfinished request is aborted in every stage.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from services.gateway import dashboard, responses
from services.gateway.auth import Key, scoped_request_id
from services.gateway.deadlines import DeadlineStream, read_body
from services.gateway.errors import APIError, internal_names
from services.gateway.flow import RequestFlow, StreamError
from services.gateway.gateway import Gateway
from services.gateway.openai_api import ParsedRequest, parse_chat, parse_completion
from services.gateway.tool_calls import ToolCallStream
from shared.telemetry import CONTENT_TYPE

log = logging.getLogger(__name__)
# usable in NATS subjects as is; no `.` (a moved attempt is `<id>.m1`) and no `@` (auth.scoped_request_id)
REQUEST_ID = re.compile(r"[A-Za-z0-9_:-]{1,128}")


def create_app(gw: Gateway) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await gw.start()
        yield
        await gw.stop()

    app = FastAPI(title="PDD gateway", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        if not e.counted:  # an admitted request is counted once, when it is released
            gw.metrics.count_request("error", e.status)
        if e.status == 429:
            gw.metrics.reject(e.code or "overloaded")
        headers = {"X-Request-Id": request.state.request_id} if hasattr(request.state, "request_id") else {}
        if e.retry_after is not None:
            headers["Retry-After"] = str(e.retry_after)
        return JSONResponse(e.to_json(internal_names(gw.cfg)), status_code=e.status, headers=headers)

    @app.get("/health")
    async def health() -> JSONResponse:
        missing = await gw.missing_roles()
        body = {"status": "ok" if not missing else "degraded", "missing_roles": missing}
        return JSONResponse(body, status_code=200 if not missing else 503)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        gw.keys.authenticate(request.headers.get("authorization"))
        return {"object": "list", "data": [gw.model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict:
        gw.keys.authenticate(request.headers.get("authorization"))
        if model_id != gw.served_model:
            raise APIError(
                404,
                f"the model {model_id!r} does not exist",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )
        return gw.model_card()

    @app.get("/metrics")
    async def metrics(request: Request) -> PlainTextResponse:
        if gw.cfg.gateway.metrics_need_key:
            gw.keys.authenticate(request.headers.get("authorization"))
        return PlainTextResponse(gw.metrics.render(), media_type=CONTENT_TYPE)

    dashboard.mount(app, gw)  # /dashboard: the live page of both sites and each request's waterfall

    @app.post("/v1/completions")
    async def completions(request: Request):
        key = _front_door(gw, request)
        body = await read_body(request, gw.cfg.timeouts.client_s)
        parsed = await asyncio.to_thread(  # tokenizing a long prompt must not stall every other stream
            parse_completion,
            body,
            served_model=gw.served_model,
            context_len=gw.context_len,
            count_tokens=gw.encode,
            vocab_size=gw.vocab_size,
            grammar_vocab=gw.grammar_vocab,
        )
        return await _serve(gw, request, key, parsed)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        key = _front_door(gw, request)
        body = await read_body(request, gw.cfg.timeouts.client_s)
        parsed = await asyncio.to_thread(
            parse_chat,
            body,
            served_model=gw.served_model,
            context_len=gw.context_len,
            apply_template=gw.apply_chat_template,
            grammar_vocab=gw.grammar_vocab,
        )
        return await _serve(gw, request, key, parsed)

    return app


def _front_door(gw: Gateway, request: Request) -> Key:
    """The request's key and id, before reading or tokenizing anything: a client without a key,
    with an id that is not one, or to a full gateway is answered at once."""
    key = gw.keys.authenticate(request.headers.get("authorization"))
    given = request.headers.get("x-request-id", "")
    if given and not REQUEST_ID.fullmatch(given):
        raise APIError(
            400,
            "X-Request-Id must be 1-128 letters, digits, '_', ':' or '-'",
            param="X-Request-Id",
            code="invalid_request_id",
        )
    request.state.request_id = "" if scoped_request_id(key, given) in gw.inflight else given  # in flight: a fresh one
    gw.check_capacity()
    gw.keys.check(key)  # the key's own limits, before its body costs any parsing
    return key


async def _serve(gw: Gateway, request: Request, key: Key, parsed: ParsedRequest):
    if parsed.steers and not key.admin:
        raise APIError(
            403,
            "only admin keys may steer the plan ('pdd' overrides)",
            type="permission_error",
            param="pdd",
            code="admin_only",
        )
    flow = gw.admit(parsed, key, request.state.request_id)  # 429 when the gateway or the key is full
    request.state.request_id = flow.request_id
    try:
        await flow.start()
    except BaseException:
        await gw.release(flow)
        raise
    headers = {"X-Request-Id": flow.request_id}
    if parsed.stream:
        return DeadlineStream(
            _sse(gw, flow),
            gw.cfg.timeouts.client_s,
            lambda: _stalled(flow, gw.cfg.timeouts.client_s),
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache"},
        )
    try:
        text, finish, pdd, tokens = await _until_done_or_gone(flow, request)
    except StreamError as e:
        flow.error = str(e)
        raise APIError(500, str(e), type="server_error", counted=True) from None
    finally:
        await gw.release(flow)
    logprobs = responses.LogprobsView(flow, gw.tokenizer).render(tokens)
    calls = ToolCallStream.of(flow)
    if calls is not None:
        text, _ = calls.delta(text, finished=True)
        finish = calls.finish_reason(finish)
    tool_calls = calls.calls if calls is not None else None
    body = responses.whole(flow, gw.served_model, text, finish, gw.pdd_view(flow, pdd), logprobs, tool_calls)
    return JSONResponse(body, headers=headers)


async def _until_done_or_gone(flow: RequestFlow, request: Request) -> tuple[str, str | None, dict, responses.Tokens]:
    """The whole answer (text, finish reason, `pdd`, its tokens with their logprobs); if the
    waiting client goes away first, the flow is abandoned (and its release aborts it in every
    stage), as a streaming one's would be."""

    async def collect() -> tuple[str, str | None, dict, responses.Tokens]:
        text, finish, pdd, tokens = "", None, {}, []
        async for delta in flow.deltas():
            text += delta.text
            tokens += delta.logprobs
            finish, pdd = delta.finish_reason or finish, delta.pdd or pdd
        return text, finish, pdd, tokens

    work = asyncio.create_task(collect())
    while not work.done():
        done, _ = await asyncio.wait({work}, timeout=0.5)
        if not done and await request.is_disconnected():
            work.cancel()
            raise APIError(499, "client closed the request", code="client_closed", counted=True)
    return work.result()


def _stalled(flow: RequestFlow, deadline_s: float) -> None:
    flow.error = f"the client took no data for {deadline_s:g} s: stream ended, slot released"
    log.warning("%s: %s", flow.request_id, flow.error)


async def _sse(gw: Gateway, flow: RequestFlow) -> AsyncIterator[bytes]:
    first, logprobs, calls = True, responses.LogprobsView(flow, gw.tokenizer), ToolCallStream.of(flow)
    try:
        async for delta in flow.deltas():
            lp = logprobs.render(delta.logprobs)
            text, finish, tool_calls = delta.text, delta.finish_reason, None
            if calls is not None:  # the answer's text as content or as tool-call deltas
                text, tool_calls = calls.delta(text, finished=finish is not None)
                finish = calls.finish_reason(finish)
            chunk = responses.chunk(flow, gw.served_model, text, finish, first, lp, tool_calls)
            first = False
            if delta.pdd is not None and (pdd := gw.pdd_view(flow, delta.pdd)) is not None:
                chunk["pdd"] = pdd
            yield responses.event(chunk)
        if flow.parsed.include_usage:
            yield responses.event(responses.usage_chunk(flow, gw.served_model))
    except StreamError as e:
        flow.error = str(e)
        yield responses.event(APIError(500, str(e), type="server_error").to_json(internal_names(gw.cfg)))
    finally:
        await gw.release(flow)
    yield b"data: [DONE]\n\n"
