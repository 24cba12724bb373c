"""The dashboard's data, built from fake flows and a fake control plane (no cluster): the
waterfall's layout from the `pdd` timings, the requests list, the line's rate from successive
polls, who may see what, and static files that never reach beyond the gateway."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections import deque
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from services.gateway import dashboard
from services.gateway.auth import OPEN, KeyRing, scoped_request_id
from services.gateway.errors import APIError
from services.gateway.flow import RequestFlow
from services.gateway.openai_api import ParsedRequest
from services.gateway.pdd_object import build_pdd
from shared import subjects
from shared.bus import BusTimeout
from shared.config import load_config
from shared.messages import ClusterStatus, InstanceInfo, LineState, Plan, RequestStats, Sampling, WanState

FIRST = [0.20]  # seconds after arrival: prefill streams the first token
RELAY = [0.25, 0.30, 0.35]
MAIN = [0.70, 0.75]


def make_flow(rid: str, key=OPEN, reason: str | None = "length", marks=None) -> RequestFlow:
    """A p-rld-md catch-up request: prefill's first token, 3 relay tokens, a 350 ms handoff gap, 2
    main-decode tokens."""
    f = RequestFlow(SimpleNamespace(), ParsedRequest("completion", "smol", [1, 2, 3], Sampling()), key, rid)
    f.plan = Plan(
        rid, pipeline="p-rld-md", handoff="catchup", prefill="prefill-0", rld="rld-0", md="md-0", queue_ms=5.0
    )
    t0 = f.stats.arrived
    default = [(t, "prefill") for t in FIRST] + [(t, "rld") for t in RELAY] + [(t, "md") for t in MAIN]
    for at, role in marks if marks is not None else default:
        f._record_tokens(1, role, now=t0 + at)
    f.stats.handoff_gap_s = MAIN[0] - RELAY[-1]
    f.stats.decoder_stats = RequestStats(
        prefill_ms=120.0,
        kv_local_ms=30.0,
        kv_wan_ms=400.0,
        extend_ms=25.0,
        handoff_chunks=3,
        wan_kv_bytes=5000,
        local_kv_bytes=7000,
    )
    f.finish_reason, f.finished = reason, reason is not None
    return f


class FakeBus:
    def __init__(self) -> None:
        self.line_bytes = {"a-b": 1000, "b-a": 10}
        self.asked: list[str] = []
        self.scheduler_down = False

    async def request(self, subject, msg, reply_type, timeout):
        self.asked.append(subject)
        if subject == subjects.STATUS:
            if self.scheduler_down:
                raise BusTimeout("no reply")
            info = InstanceInfo(
                "md-0",
                "md",
                "B",
                running=2,
                waiting=1,
                free_blocks=10,
                total_blocks=16,
                cached_blocks=2,
                updated_at=99.0,
            )
            return ClusterStatus([info], wan_estimate_mbps=180.0, plans={"p-rld-md": 3}, now=100.0)
        lines = {d: LineState(200.0, 20.0, 5.0, bytes=b) for d, b in self.line_bytes.items()}
        return WanState("a-b", lines=lines)


def fake_gateway(env: dict[str, str] | None = None, need_key: bool = True) -> SimpleNamespace:
    cfg = load_config(None)
    cfg = dataclasses.replace(cfg, gateway=dataclasses.replace(cfg.gateway, metrics_need_key=need_key))
    return SimpleNamespace(
        cfg=cfg,
        bus=FakeBus(),
        keys=KeyRing.from_settings("", env or {}),
        inflight={},
        recent=deque(maxlen=100),
        served_model="smol",
    )


def make_app(gw) -> TestClient:
    """The dashboard's routes on a bare app, with the gateway's answer to an APIError."""
    app = FastAPI()
    app.exception_handler(APIError)(lambda request, e: JSONResponse(e.to_json(), status_code=e.status))
    dashboard.mount(app, gw)
    return TestClient(app)


def test_the_waterfall_is_laid_out_from_the_pdd_timings():
    f = make_flow("r1")
    w = dashboard.waterfall(f, running=False)
    bars = {b["row"]: (b["start_ms"], b["dur_ms"]) for b in w["bars"]}
    assert bars["queue"] == (0.0, 5.0) and bars["prefill"] == (5.0, 120.0)
    assert bars["kv_local"] == (125.0, 30.0) and bars["kv_wan"] == (125.0, 400.0)  # both start when prefill ends
    assert bars["extend"] == pytest.approx((700.0 - 25.0, 25.0))  # ends at main-decode's first token
    assert w["ticks"]["prefill"] == pytest.approx([t * 1000 for t in FIRST])
    assert w["ticks"]["relay"] == pytest.approx([t * 1000 for t in RELAY])
    assert w["ticks"]["main"] == pytest.approx([t * 1000 for t in MAIN])
    assert len(w["ticks"]["handoff"]) == 3 and all(525.0 < t < 700.0 for t in w["ticks"]["handoff"])
    assert w["gap"]["start_ms"] == pytest.approx(350.0) and w["gap"]["dur_ms"] == pytest.approx(350.0)
    assert w["ttft_ms"] == pytest.approx(200.0) and w["end_ms"] == pytest.approx(750.0)
    pdd = build_pdd("r1", f.plan, f.stats)["timings_ms"]
    assert {k: v for k, v in w["timings_ms"].items() if k != "e2e"} == {k: v for k, v in pdd.items() if k != "e2e"}
    assert w["instances"] == {"prefill": "prefill-0", "rld": "rld-0", "md": "md-0"}
    assert w["rows"] == list(dashboard.ROWS)


def test_a_request_never_handed_over_has_no_handoff_marks():
    f = make_flow("relay-only", marks=[(0.2, "rld"), (0.3, "rld")])
    w = dashboard.waterfall(f, running=False)
    assert w["gap"] is None and w["ticks"]["handoff"] == [] and "extend" not in {b["row"] for b in w["bars"]}
    assert w["ticks"]["main"] == [] and len(w["ticks"]["relay"]) == 2


def test_requests_running_first_then_finished_newest_first_with_their_figures():
    gw = fake_gateway()
    old, new, live = make_flow("old"), make_flow("new", reason=None), make_flow("live", reason=None)
    new.error = "prefill failed"
    gw.recent.extend([old, new])
    gw.inflight["live"] = live
    rows = dashboard.recent_requests(gw, OPEN)
    assert [(r["id"], r["outcome"]) for r in rows] == [("live", "running"), ("new", "error"), ("old", "finished")]
    row = rows[2]
    assert (row["pipeline"], row["handoff"]) == ("p-rld-md", "catchup")
    assert row["tokens_by_role"] == {"prefill": 1, "rld": 3, "md": 2}
    assert row["ttft_ms"] == pytest.approx(200.0) and row["e2e_ms"] == pytest.approx(750.0)
    assert row["wan_kv_bytes"] == 5000 and row["handoff_chunks"] == 3
    assert len(dashboard.recent_requests(gw, OPEN, limit=2)) == 2
    assert dashboard.find_flow(gw, OPEN, "live") == (live, True)
    assert dashboard.find_flow(gw, OPEN, "old") == (old, False)
    assert dashboard.find_flow(gw, OPEN, "gone") == (None, False)


def test_the_lines_rate_comes_from_successive_polls():
    lines = {"a-b": LineState(100.0, 20.0, 0.0, bytes=3000)}
    assert dashboard.line_rates(lines, None, 10.0)["a-b"]["bytes_per_s"] is None  # first poll: nothing to compare
    assert dashboard.line_rates(lines, (9.5, {"a-b": 1000}), 10.0)["a-b"]["bytes_per_s"] == pytest.approx(4000.0)
    assert dashboard.line_rates(lines, (9.5, {"a-b": 9000}), 10.0)["a-b"]["bytes_per_s"] is None  # line restarted
    assert dashboard.line_rates(lines, (9.5, {}), 10.0)["a-b"]["bandwidth_mbps"] == 100.0


def test_the_fleet_is_sampled_once_per_interval_whatever_the_number_of_pages():
    gw = fake_gateway()

    async def main():
        sampler = dashboard.FleetSampler(gw, min_interval_s=60)
        first = await sampler.view()
        assert await sampler.view() is first and gw.bus.asked.count(subjects.STATUS) == 1
        sampler.min_interval_s = 0
        gw.bus.line_bytes["a-b"] += 5000
        second = await sampler.view()
        gw.bus.scheduler_down = True
        return first, second, await sampler.view()

    first, second, down = asyncio.run(main())
    assert first["datacenters"]["B"][0]["kv_blocks"] == {"used": 4, "cached": 2, "free": 10}
    assert first["wan"]["estimate_mbps"] == 180.0 and first["wan"]["configured"]["bandwidth_mbps"] > 0
    assert first["wan"]["lines"]["a-b"]["bytes_per_s"] is None and second["wan"]["lines"]["a-b"]["bytes_per_s"] > 0
    assert first["error"] == "" and "scheduler" in down["error"] and "datacenters" not in down


def test_an_open_gateway_serves_the_page_and_its_data():
    gw = fake_gateway()
    gw.recent.append(make_flow("r1"))
    c = make_app(gw)
    page = c.get("/dashboard")
    assert page.status_code == 200 and "dashboard.js" in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]  # the browser fetches from nowhere else
    assert c.get("/dashboard/static/dashboard.js").status_code == 200
    assert c.get("/dashboard/static/nope.js").status_code == 404
    assert c.get("/dashboard/static/..%2Fdashboard.py").status_code == 404
    state = c.get("/dashboard/api/state").json()
    assert state["model"] == "smol" and [r["id"] for r in state["requests"]] == ["r1"]
    assert state["fleet"]["datacenters"]["B"][0]["id"] == "md-0"
    w = c.get("/dashboard/api/requests/r1").json()
    assert w["request"]["id"] == "r1" and len(w["ticks"]["relay"]) == 3
    assert c.get("/dashboard/api/requests/unknown").status_code == 404


def test_with_keys_on_the_dashboard_needs_one_by_header_query_or_cookie():
    gw = fake_gateway({"PDD_API_KEYS": "user-k", "PDD_ADMIN_KEYS": "admin-k"})
    user = next(k for k in gw.keys.keys if not k.admin)
    gw.recent.extend([make_flow("mine", key=user), make_flow("theirs")])
    c = make_app(gw)
    assert c.get("/dashboard").status_code == 401 and c.get("/dashboard/api/state").status_code == 401
    assert "/dashboard?key=" in c.get("/dashboard").json()["error"]["message"]  # how a browser gives one
    assert c.get("/dashboard?key=wrong").status_code == 401
    assert c.get("/dashboard/static/dashboard.js").status_code == 200  # code, no data
    page = c.get("/dashboard?key=user-k")
    cookie = page.headers["set-cookie"].lower()
    assert page.status_code == 200 and all(a in cookie for a in ("httponly", "samesite=strict", "path=/dashboard"))
    state = c.get("/dashboard/api/state")  # the page's own poll: the cookie carries the key
    assert state.status_code == 200 and [r["id"] for r in state.json()["requests"]] == ["mine"]  # a user key: its own
    assert c.get("/dashboard/api/requests/theirs").status_code == 404
    admin = make_app(gw).get("/dashboard/api/state", headers={"Authorization": "Bearer admin-k"})
    # an admin sees every key's requests, by the ids the stages know (two keys may send one id)
    assert [r["id"] for r in admin.json()["requests"]] == ["theirs", scoped_request_id(user, "mine")]
    assert make_app(gw).get("/dashboard/api/state?key=admin-k").status_code == 200


def test_with_keys_on_no_anonymous_visitor_sees_the_dashboard_even_with_open_metrics():
    """`gateway.metrics_need_key: false` opens /metrics; the dashboard, which names instances and
    requests, still needs a key (it gave anonymous visitors the admin view)."""
    gw = fake_gateway({"PDD_API_KEYS": "user-k"}, need_key=False)
    gw.recent.append(make_flow("r1", key=gw.keys.keys[0]))
    c = make_app(gw)
    for path in ("/dashboard", "/dashboard/api/state", "/dashboard/api/requests/r1"):
        assert c.get(path).status_code == 401, path
    assert c.get("/dashboard/api/state", headers={"Authorization": "Bearer user-k"}).status_code == 200


def test_a_user_key_sees_its_own_requests_and_no_instance_or_process():
    gw = fake_gateway({"PDD_API_KEYS": "user-k", "PDD_ADMIN_KEYS": "admin-k"})
    user, admin = gw.keys.keys
    gw.recent.append(make_flow("mine", key=user))
    c = make_app(gw)
    state = c.get("/dashboard/api/state", headers={"Authorization": "Bearer user-k"})
    mine = c.get("/dashboard/api/requests/mine", headers={"Authorization": "Bearer user-k"})
    assert state.status_code == mine.status_code == 200
    assert [r["id"] for r in state.json()["requests"]] == ["mine"] and mine.json()["request"]["id"] == "mine"
    assert state.json()["fleet"] == dashboard.USER_FLEET and mine.json()["instances"] == {}
    names = [i.id for i in gw.cfg.instances] + ["scheduler", "pid", "url"]
    for body in (state.text, mine.text):
        assert not any(n in body for n in names), body
    assert gw.bus.asked == []  # the fleet was not even sampled for it
    as_admin = {"Authorization": "Bearer admin-k"}
    scoped = scoped_request_id(user, "mine")
    assert c.get("/dashboard/api/state", headers=as_admin).json()["fleet"]["datacenters"]["B"][0]["id"] == "md-0"
    assert c.get(f"/dashboard/api/requests/{scoped}", headers=as_admin).json()["instances"]["md"] == "md-0"
    assert c.get(f"/dashboard/api/requests/{scoped}", headers={"Authorization": "Bearer user-k"}).status_code == 404


def test_the_static_files_reach_nothing_but_the_gateway():
    files = {p.name: p.read_text() for p in dashboard.STATIC.iterdir()}
    assert set(files) == {"index.html", "dashboard.css", "dashboard.js"}
    for name, text in files.items():
        # the only absolute URL is SVG's XML namespace name, which a browser never fetches
        urls = set(re.findall(r"[a-z][a-z0-9+.-]*://[^\s'\"`)]+", text, re.I)) - {"http://www.w3.org/2000/svg"}
        assert not urls, (name, urls)
        assert not re.search(r"""(src|href|url)\s*[=(]\s*['"]?//""", text), name  # protocol-relative
        assert "@import" not in text and "WebSocket" not in text and "EventSource" not in text, name
    refs = re.findall(r"""(?:src|href)="([^"]+)\"""", files["index.html"])
    assert refs and all(r.startswith("/dashboard/static/") or r == "data:," for r in refs), refs
    fetched = re.findall(r"getJSON\(\s*[`'\"]([^`'\"]+)", files["dashboard.js"])
    assert fetched and all(p.startswith("/dashboard/api/") for p in fetched), fetched


def bench_record(rid: str, ttft_s: float, relay: int = 3, main: int = 2) -> dict:
    """A requests.jsonl record as `pdd bench` writes it: client chunk times and the pdd object
    (prefill's first token, then `relay` - 1 relay tokens, then `main`)."""
    times = [1.0 + ttft_s + 0.05 * i for i in range(relay)] + [
        1.0 + ttft_s + 0.05 * relay + 0.2 + 0.05 * i for i in range(main)
    ]
    pdd = {
        "pipeline": "p-rld-md",
        "handoff": "catchup",
        "tokens_by_role": {"prefill": 1, "rld": relay - 1, "md": main},
        "handoff_chunks": 2,
        "handoff_gap_ms": 250.0,
        "timings_ms": {
            "queue": 4.0,
            "prefill": ttft_s * 900,
            "kv_local": 10.0,
            "kv_wan": 300.0,
            "extend": 30.0,
            "ttft": ttft_s * 1000,
            "e2e": (times[-1] - 1.0) * 1000,
        },
    }
    return {
        "request_id": rid,
        "mode": "pdd",
        "sent_s": 1.0,
        "token_times_s": times,
        "ok": True,
        "pdd": pdd,
        "output_tokens": relay + main,
    }


def test_the_bench_draws_the_same_waterfall_for_its_slowest_and_median_request(tmp_path):
    from benchmarks.waterfall import pick, plot_waterfalls, record_layout

    records = [bench_record("fast", 0.1), bench_record("mid", 0.3), bench_record("slow", 0.9), {"ok": False}]
    assert pick(records, "slowest")["request_id"] == "slow" and pick(records, "median")["request_id"] == "mid"
    assert pick([{"ok": False}], "median") is None
    w = record_layout(records[2])
    bars = {b["row"]: (b["start_ms"], b["dur_ms"]) for b in w["bars"]}
    assert bars["prefill"] == (4.0, 810.0) and bars["kv_wan"] == (814.0, 300.0)  # as the dashboard places them
    assert [len(w["ticks"][row]) for row in ("prefill", "relay", "main", "handoff")] == [1, 2, 2, 2]
    assert w["gap"]["dur_ms"] == 250.0 and w["ttft_ms"] == pytest.approx(900.0)
    paths = plot_waterfalls(tmp_path, records, "pdd")
    assert [p.name for p in paths] == ["waterfall_slowest.png", "waterfall_median.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000 for p in paths)
    (tmp_path / "none").mkdir()
    assert all(p.exists() for p in plot_waterfalls(tmp_path / "none", [], "pdd"))  # no data: a note, not a crash
