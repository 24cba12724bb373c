"""The live dashboard: both datacenters, the line between them, and each request's waterfall.

Routes, mounted on the gateway's app by `mount`:
- `GET /dashboard`: the page (static HTML; its CSS and JS under `/dashboard/static/`, shipped in
  the package: no build step and nothing fetched from elsewhere, so it works in a closed site).
- `GET /dashboard/api/state`: the fleet (`shared.status.status_view`) and the recent requests.
- `GET /dashboard/api/requests/{id}`: one request's waterfall.

The page polls `api/state` about once a second. Polling rather than server-sent events: a
response that never ends would hold the gateway's graceful shutdown open for as long as a page
is open somewhere, and a poll costs one small request.

Access: with API keys on, the page and its data need a key, whatever `gateway.metrics_need_key`
says (that opens `/metrics` alone: counters, no instance and no request): `Authorization: Bearer
K`, or `?key=K` on the page's address (a browser cannot send a header when it opens a page). The
page's answer stores the key in an HttpOnly, SameSite=Strict cookie scoped to `/dashboard`, which
the page's own polls then carry; the page drops `?key=` from its address bar.

What a key sees: an admin key, the fleet (instances, processes, the line) and every request, by
the id the stages know it by (`auth.scoped_request_id`: two keys may send one id). A user key,
as the API redacts its `pdd` object: its own requests only, by its own ids, with no instance, no
fleet and no process; the fleet's place says the view is an admin key's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse

from services.gateway.auth import OPEN, Key
from services.gateway.errors import APIError
from services.gateway.pdd_object import build_pdd
from shared import subjects
from shared.messages import ClusterStatus, Inspect, LineState, WanControl, WanState
from shared.status import status_view
from shared.waterfall import ROWS as ROWS  # re-exported: the page's rows, top to bottom
from shared.waterfall import layout

STATIC = Path(__file__).parent / "static"
COOKIE = "pdd_dashboard_key"
# no other origin, ever: the browser itself refuses anything the static files might try
CSP = "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"


USER_FLEET = {"error": "the fleet is shown to admin keys only"}


def shown_id(key: Key, flow) -> str:
    """A request's id as `key` knows it: a user key's own id; for an admin, the scoped one (two
    keys may send the same id)."""
    return flow.scoped_id if key.admin else flow.request_id


def request_row(flow, running: bool, now: float | None = None, key: Key = OPEN) -> dict[str, Any]:
    """One line of the requests table, as `key` sees it."""
    s, plan, d = flow.stats, flow.plan, flow.stats.decoder_stats
    return {
        "id": shown_id(key, flow),
        "created": flow.created,
        "pipeline": plan.pipeline if plan else "",
        "handoff": plan.handoff if plan else "",
        "outcome": "running" if running else flow.outcome,
        "ttft_ms": (s.first_token_at - s.arrived) * 1000 if s.first_token_at else None,
        "e2e_ms": _end_ms(flow, running, now),
        "tokens_by_role": dict(s.tokens_by_role),
        "wan_kv_bytes": d.wan_kv_bytes,
        "local_kv_bytes": d.local_kv_bytes,
        "handoff_chunks": d.handoff_chunks,
        "handoff_gap_ms": s.handoff_gap_s * 1000,
        "migrations": s.migrations,
    }


def _end_ms(flow, running: bool, now: float | None) -> float:
    """A running request's age; a finished one's last token (its last sign of life if none came)."""
    s = flow.stats
    end = (now or time.perf_counter()) if running else (s.last_token_at or s.last_progress)
    return (end - s.arrived) * 1000


def waterfall(flow, running: bool, now: float | None = None, key: Key = OPEN) -> dict[str, Any]:
    """A request's row, its timings exactly as its `pdd` object reports them, and their layout;
    its instances for an admin key only."""
    s, d = flow.stats, flow.stats.decoder_stats
    timings = build_pdd(flow.request_id, flow.plan, s)["timings_ms"]
    timings["e2e"] = _end_ms(flow, running, now)  # the pdd object's e2e is taken at its last chunk
    marks = [(at * 1000, role) for at, role in s.token_marks]
    plan = flow.plan
    instances = plan.instances() if plan and key.admin else {}
    return {
        "request": request_row(flow, running, now, key),
        "timings_ms": timings,
        "instances": instances,
        **layout(timings, marks, d.handoff_chunks, s.handoff_gap_s * 1000, timings["e2e"]),
    }


def line_rates(lines: dict[str, LineState], prev: tuple[float, dict[str, int]] | None, now: float) -> dict[str, dict]:
    """Each direction's state and its bytes/s since the previous poll (None on the first, or
    when the counter went back: the line restarted)."""
    out = {}
    for direction, ls in lines.items():
        before = prev[1].get(direction) if prev is not None else None
        rate = None
        if before is not None and now > prev[0] and ls.bytes >= before:
            rate = (ls.bytes - before) / (now - prev[0])
        out[direction] = {**dataclasses.asdict(ls), "bytes_per_s": rate}
    return out


class FleetSampler:
    """The scheduler's registry view and the line's counters, sampled at most every
    `min_interval_s` however many pages poll; the line's rate comes from successive samples
    (`pdd status` sleeps between two, a page must not)."""

    def __init__(self, gw, min_interval_s: float = 0.5) -> None:
        self.gw, self.min_interval_s = gw, min_interval_s
        self._cached: tuple[float, dict] | None = None
        self._prev_line: tuple[float, dict[str, int]] | None = None
        self._lock = asyncio.Lock()

    async def view(self) -> dict[str, Any]:
        async with self._lock:
            now = time.monotonic()
            if self._cached is None or now - self._cached[0] >= self.min_interval_s:
                self._cached = (now, await self._sample(now))
            return self._cached[1]

    async def _sample(self, now: float) -> dict[str, Any]:
        cfg, bus = self.gw.cfg, self.gw.bus
        try:
            status = await bus.request(subjects.STATUS, Inspect(), ClusterStatus, 2.0)
        except Exception as e:  # no answer, or NATS reconnecting: the page says why instead of failing its poll
            return {"error": f"the scheduler did not answer: {e}"}
        lines, error = None, ""
        if cfg.wan.enabled:  # the emulated line (pdd up); a real deployment has no counters to show
            try:
                state = await bus.request(subjects.wan_control(cfg.wan.name), WanControl(), WanState, 2.0)
                lines = line_rates(state.lines, self._prev_line, now)
                self._prev_line = (now, {d: ls.bytes for d, ls in state.lines.items()})
            except Exception as e:
                error = f"the line emulator did not answer: {e}"
        return {**status_view(cfg, status, lines), "error": error}


def recent_requests(gw, key: Key, limit: int = 50) -> list[dict[str, Any]]:
    """Requests in flight, then finished ones, newest first; a user key sees only its own."""
    now = time.perf_counter()
    running = sorted((f for f in gw.inflight.values() if _may_see(key, f)), key=lambda f: -f.stats.arrived)
    done = [f for f in reversed(gw.recent) if _may_see(key, f)]  # gw.recent is oldest first
    shown = [(f, True) for f in running] + [(f, False) for f in done]
    return [request_row(f, live, now, key) for f, live in shown[:limit]]


def find_flow(gw, key: Key, request_id: str):
    """(flow, running) for a request `key` may see, by the id it knows it by, in flight or recently
    finished; (None, False) otherwise."""
    running = [(f, True) for f in gw.inflight.values()]
    done = [(f, False) for f in reversed(gw.recent)]
    return next(
        ((f, live) for f, live in running + done if _may_see(key, f) and shown_id(key, f) == request_id), (None, False)
    )


def _may_see(key: Key, flow) -> bool:
    return key.admin or flow.key.sha256 == key.sha256


def authorize(gw, request: Request) -> tuple[Key, str]:
    """The key that may see the dashboard (401 when none: with keys on there is no anonymous
    view), and the key as presented by query or cookie ("" when it came in a header or none was
    needed)."""
    if gw.keys.open:
        return OPEN, ""
    header = request.headers.get("authorization")
    if header:
        return gw.keys.authenticate(header), ""
    given = request.query_params.get("key") or request.cookies.get(COOKIE) or ""
    try:
        return gw.keys.authenticate(f"Bearer {given}" if given else None), given
    except APIError:  # a browser cannot send the header the usual message asks for
        raise _not_an_api_request(
            401,
            "Incorrect or missing API key: open /dashboard?key=<key>, or send `Authorization: Bearer <key>`",
            "invalid_api_key",
        ) from None


def _not_an_api_request(status: int, message: str, code: str | None = None) -> APIError:
    """An error for the page; `counted` keeps the dashboard's polls out of the API's request metrics."""
    return APIError(
        status, message, type="not_found_error" if status == 404 else "invalid_request_error", code=code, counted=True
    )


def mount(app: FastAPI, gw) -> None:
    sampler = FleetSampler(gw)
    assets = {p.name: p for p in STATIC.iterdir() if p.is_file()}  # served by name only: no paths from the URL

    @app.get("/dashboard")
    async def page(request: Request) -> FileResponse:
        _, given = authorize(gw, request)
        response = FileResponse(
            STATIC / "index.html", headers={"Content-Security-Policy": CSP, "Cache-Control": "no-store"}
        )
        if given:  # not Secure: a closed site may serve plain http; HttpOnly keeps it from scripts
            response.set_cookie(COOKIE, given, httponly=True, samesite="strict", path="/dashboard")
        return response

    @app.get("/dashboard/static/{name}")
    async def asset(name: str) -> FileResponse:
        if name not in assets:  # code only, no data: served without a key
            raise _not_an_api_request(404, f"no dashboard file {name!r}")
        return FileResponse(assets[name], headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/api/state")
    async def state(request: Request) -> JSONResponse:
        key, _ = authorize(gw, request)
        fleet = await sampler.view() if key.admin else USER_FLEET
        return JSONResponse(
            {"fleet": fleet, "requests": recent_requests(gw, key), "model": gw.served_model},
            headers={"Cache-Control": "no-store"},
        )

    @app.get("/dashboard/api/requests/{request_id}")
    async def one(request_id: str, request: Request) -> JSONResponse:
        key, _ = authorize(gw, request)
        flow, running = find_flow(gw, key, request_id)
        if flow is None:
            raise _not_an_api_request(404, f"no recent request {request_id!r}")
        return JSONResponse(waterfall(flow, running, key=key), headers={"Cache-Control": "no-store"})
