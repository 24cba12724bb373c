"""benchmarks/chaos.py without a cluster: how a request is judged, how a fault's row is built and
printed, the run's verdict, the options, and the load's client against a fake SSE server
(an exact, a hung, a failed, a cut and a wrong stream)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from benchmarks import chaos, chaos_load
from benchmarks.chaos import faults_of, loss_failpoints, parse_faults
from benchmarks.chaos_judge import (
    CUT,
    EXACT,
    FAILED,
    HUNG,
    WRONG,
    Record,
    aggregate,
    format_header,
    format_row,
    hang_bound,
    http_error_message,
    judge,
    max_gap,
    parse_data_line,
    verdict,
)
from benchmarks.chaos_load import SPECS, Load, raw_request, request_body, requests_running, schedule
from shared import failpoints


def test_judging_a_request():
    assert judge("abc", "abc", "", True, False) == EXACT
    assert judge("abd", "abc", "", True, False) == WRONG
    assert judge("ab", "abc", "", False, False) == CUT  # no [DONE], no error: the client cannot tell
    assert judge("ab", "abc", "HTTP 503: no relay", False, False) == FAILED
    assert judge("abc", "abc", "", False, True) == HUNG  # the bound wins over what came before it
    assert judge("abc", None, "", True, False) == WRONG  # no reference: never counted exact


def test_bodies_are_greedy_streams_and_steer_only_when_a_pipeline_is_forced():
    path, body = request_body(chaos_load.Spec("chat", "p-rld", "Hi", 5))
    assert path == "/v1/chat/completions" and body["messages"] == [{"role": "user", "content": "Hi"}]
    assert body["pdd"] == {"pipeline": "p-rld"} and body["temperature"] == 0 and body["ignore_eos"] is True
    path, body = request_body(chaos_load.Spec("completion", None, "Hi", 5))
    assert path == "/v1/completions" and body["prompt"] == "Hi" and body["stream"] is True and "pdd" not in body


def test_every_fault_has_every_pipeline_in_flight():
    for phase in range(len(SPECS)):
        first_wave = [SPECS[i] for i in schedule(phase, 4, len(SPECS))]
        assert {s.pipeline for s in first_wave} == {"p-md", "p-rld-md", "p-rld", None}
        assert {s.kind for s in first_wave} == {"chat", "completion"}
    assert all(60 <= s.max_tokens <= 120 for s in SPECS)
    assert schedule(2, 3, 8) == [2, 3, 4] and schedule(7, 3, 8) == [7, 0, 1]


def test_the_loss_file_arms_the_named_points_and_an_empty_one_disarms():
    points = failpoints.parse(loss_failpoints(3))
    assert set(points) == set(chaos.LOSS_POINTS) and all(p.pct == 3 for p in points.values())
    assert failpoints.parse("") == {}


def test_parsing_sse_lines():
    assert parse_data_line(": keep-alive") is None and parse_data_line("") is None
    assert parse_data_line("data: [DONE]").done
    text = parse_data_line('data: {"choices": [{"text": "Hel", "finish_reason": null}]}')
    assert text.text == "Hel" and not text.done and text.finish_reason is None
    delta = parse_data_line('data: {"choices": [{"delta": {"content": "lo"}, "finish_reason": "length"}], "pdd": {}}')
    assert delta.text == "lo" and delta.finish_reason == "length" and delta.pdd == {}
    assert parse_data_line('data: {"choices": [], "usage": {"completion_tokens": 3}}').text == ""
    assert parse_data_line('data: {"error": {"message": "md-0 failed", "type": "server_error"}}').error == "md-0 failed"
    with pytest.raises(ValueError):
        parse_data_line("data: {not json")


def test_http_errors_name_their_message():
    assert http_error_message(503, b'{"error": {"message": "no md"}}') == "HTTP 503: no md"
    assert http_error_message(502, b"Bad Gateway\n") == "HTTP 502: Bad Gateway"


def test_the_hang_bound_follows_a_slow_host():
    assert hang_bound([10.0, 30.0], 120) == 120
    assert hang_bound([10.0, 70.0], 120) == 210
    assert hang_bound([], 120) == 120


def test_the_worst_gap():
    assert max_gap([]) == max_gap([1.0]) == 0.0
    assert max_gap([0.0, 0.1, 2.6, 2.7]) == pytest.approx(2.5)


def _rec(outcome: str, times=(0.0, 0.1), elapsed=1.0, error="", cut="", **pdd) -> Record:
    return Record(0, None, elapsed_s=elapsed, event_times_s=list(times), error=error, cut=cut, pdd=pdd, outcome=outcome)


def test_a_faults_row():
    records = [
        _rec(EXACT, (0.0, 0.2, 0.3), elapsed=2.0, resends=2),
        _rec(EXACT, (0.0, 1.5), elapsed=4.0, migrations=1),
        _rec(WRONG, (0.0, 0.4)),
        _rec(FAILED, (0.0, 9.0), error="HTTP 503: no md"),  # its gap is not a stall of a surviving stream
        _rec(FAILED, error="HTTP 503: no md"),
        _rec(CUT, cut="RemoteProtocolError: peer closed"),
        _rec(CUT),
        _rec(HUNG, (0.0, 50.0)),
    ]
    row = aggregate("kill-md", records, 30.0, ["a note"])
    assert {k: row[k] for k in ("sent", EXACT, FAILED, WRONG, CUT, HUNG)} == {
        "sent": 8,
        EXACT: 2,
        FAILED: 2,
        WRONG: 1,
        CUT: 2,
        HUNG: 1,
    }
    assert row["worst_stall_s"] == pytest.approx(1.5) and row["p50_exact_s"] == pytest.approx(3.0)
    assert (row["resends"], row["migrations"]) == (2, 1)
    assert row["errors"] == {
        "HTTP 503: no md": 2,
        "RemoteProtocolError: peer closed": 1,
        "stream ended without [DONE]": 1,
    }
    lines = format_row(row)
    assert len(lines[0]) == len(format_header())  # the columns line up
    assert lines[0].split()[:7] == ["kill-md", "8", "2", "2", "1", "2", "1"]
    assert "    2x HTTP 503: no md" in lines and "    note: a note" in lines
    assert json.loads(json.dumps(row)) == row


def test_the_verdict_fails_a_hung_wrong_or_cut_request_but_not_a_clear_error():
    ok = aggregate("nats-a", [_rec(EXACT), _rec(FAILED, error="HTTP 503: x")], 1.0)
    assert verdict([ok])[0] == 0 and "1 exact, 1 failed" in verdict([ok])[1]
    for bad in (HUNG, WRONG, CUT):
        status, line = verdict([ok, aggregate("drop", [_rec(bad)], 1.0)])
        assert status == 1 and f"1 {bad}" in line and "under drop" in line
    assert verdict([])[0] == 0


def test_parsing_faults():
    assert parse_faults(" drop, kill-md ,all") == ["drop", "kill-md", "all"]
    with pytest.raises(ValueError, match="leafnode"):
        parse_faults("drop,leafnode")
    with pytest.raises(ValueError):
        parse_faults(" , ")
    assert set(chaos.FAULT_ORDER) == {*chaos.FAULTS, "all"}


def test_all_together_is_every_fault_with_the_lines_before_the_servers():
    names = [n for n, _ in faults_of("all")]
    assert set(names) == set(chaos.FAULTS) - {"none"}
    assert max(names.index("drop"), names.index("stall")) < names.index("nats-a")  # its control goes over NATS A
    assert faults_of("stall") == [("stall", chaos.FAULTS["stall"])]


def test_the_slow_clients_request_is_well_formed():
    raw = raw_request("127.0.0.1", 8000, "/v1/completions", {"prompt": "é", "stream": True})
    head, body = raw.split(b"\r\n\r\n")
    assert head.startswith(b"POST /v1/completions HTTP/1.1\r\n")
    assert f"Content-Length: {len(body)}".encode() in head and json.loads(body) == {"prompt": "é", "stream": True}


def test_reading_the_gateways_running_requests():
    metrics = '# HELP x\npdd:num_requests_running{model="m"} 3.0\npdd:num_requests_waiting{model="m"} 1.0\n'
    assert requests_running(metrics) == 3 and requests_running("pdd:num_requests_running 0.0\n") == 0
    assert requests_running("nothing here") is None


# -- the load against a fake server: what each spec's prompt gets back -----------------------

CHUNK = 'data: {"choices": [{"text": "%s", "finish_reason": null}]}\n\n'
BEHAVIOUR = {  # spec index -> what the fake server does
    0: "exact",
    1: "hang",
    2: "503",
    3: "error-event",
    4: "cut",
    5: "wrong",
}


class _Fake(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body.get("prompt") or body["messages"][0]["content"]
        behaviour = BEHAVIOUR[next(i for i, s in enumerate(SPECS) if s.prompt == prompt)]
        if behaviour == "503":
            payload = b'{"error": {"message": "no main-decode instance"}}'
            self.send_response(503)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        try:
            for piece in ("ab", "c", "d"):
                self.wfile.write((CHUNK % piece).encode())
                self.wfile.flush()
            if behaviour == "hang":
                time.sleep(3)
            elif behaviour == "error-event":
                self.wfile.write(b'data: {"error": {"message": "md-0 failed"}}\n\n')
            elif behaviour == "wrong":
                self.wfile.write((CHUNK % "X").encode() + b"data: [DONE]\n\n")
            elif behaviour == "exact":
                self.wfile.write(b'data: {"choices": [], "usage": {}}\n\ndata: [DONE]\n\n')
            self.wfile.flush()
        except OSError:  # the client gave up on it
            pass
        self.close_connection = True


@pytest.fixture
def fake_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_the_load_judges_every_stream_and_bounds_a_hung_one(fake_url):
    refs = {i: "abcd" for i in BEHAVIOUR}
    t0 = time.monotonic()
    load = Load(fake_url, list(BEHAVIOUR), concurrency=3, hang_s=0.5, references=refs, pause_s=0.0).start()
    assert load.wait_streaming(1, 5)
    records = load.join()
    assert time.monotonic() - t0 < 2.5  # the hung stream was abandoned at its bound, not waited for
    assert [r.outcome for r in records] == [EXACT, HUNG, FAILED, FAILED, CUT, WRONG]
    assert records[2].error == "HTTP 503: no main-decode instance" and records[3].error == "md-0 failed"
    assert records[0].text == "abcd" and records[0].completed and records[1].text == "abcd"
    assert 0.5 <= records[1].elapsed_s < 1.0
    assert load.streaming == 5  # every stream that got its third text event (not the 503)
    row = aggregate("fake", records, load.wall_s)
    assert (row[EXACT], row[HUNG], row[FAILED], row[CUT], row[WRONG]) == (1, 1, 2, 1, 1)
