"""The client-side deadlines (services/gateway/deadlines.py) on a real uvicorn server and real
sockets: a stream whose client stops reading is ended and its generator closed (which releases
a request), and a body that does not arrive is answered 408. The cluster test
(tests/cluster/test_front_door.py) does the same through the whole gateway."""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.gateway.__main__ import listening_socket
from services.gateway.deadlines import DeadlineStream, read_body
from services.gateway.errors import APIError
from shared.config import ConfigError, GatewayConfig, load_config
from tests.cluster.test_migration import until

DEADLINE_S = 0.5


class Server:
    """The app on a real uvicorn in a thread, on the gateway's own listening socket."""

    def __init__(self, app: FastAPI) -> None:
        cfg = load_config(None)
        cfg = dataclasses.replace(cfg, port=0, gateway=dataclasses.replace(cfg.gateway, send_buffer_kib=8))
        self.sock = listening_socket(cfg, cfg.port)
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> Server:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def dial(self, request: bytes) -> socket.socket:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", self.port))
        sock.sendall(request)
        return sock


def _app(events: dict) -> FastAPI:
    app = FastAPI()

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.to_json(), status_code=e.status)

    @app.get("/stream")
    async def stream():
        async def sse():
            try:
                while True:  # a stream that never ends: only its client's stall can
                    events["sent"] = events.get("sent", 0) + 1
                    yield b"data: " + b"x" * 200 + b"\n\n"
            finally:
                events["closed"] = True  # where the gateway releases the request

        return DeadlineStream(sse(), DEADLINE_S, lambda: events.setdefault("stalled", True))

    @app.post("/body")
    async def body(request: Request):
        return {"bytes": len(await read_body(request, DEADLINE_S))}

    return app


def test_a_stream_whose_client_stops_reading_is_ended_and_its_generator_closed():
    events: dict = {}
    with Server(_app(events)) as server:
        sock = server.dial(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")  # and never read
        try:
            until(lambda: events.get("closed"), 30, "the stream to end")
            assert events.get("stalled") and events["sent"] < 5000, events  # cut after ~100 KB, not MBs
        finally:
            sock.close()


def _answer(sock: socket.socket, end: bytes) -> bytes:
    """The response, read until it ends with `end` (or the server closes)."""
    sock.settimeout(30)
    answer = b""
    while not answer.endswith(end) and (chunk := sock.recv(4096)):
        answer += chunk
    return answer


def test_a_body_that_does_not_arrive_is_answered_408_and_a_whole_one_is_read():
    with Server(_app({})) as server:
        with server.dial(b"POST /body HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n0123456789") as sock:
            answer = _answer(sock, b"}}")
        assert answer.startswith(b"HTTP/1.1 408") and b"body_timeout" in answer, answer
        with server.dial(b"POST /body HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n0123456789") as sock:
            answer = _answer(sock, b"}")
        assert answer.startswith(b"HTTP/1.1 200") and answer.endswith(b'{"bytes":10}'), answer


def test_a_negative_send_buffer_is_refused():
    with pytest.raises(ConfigError, match="send_buffer_kib"):
        GatewayConfig(send_buffer_kib=-1)
