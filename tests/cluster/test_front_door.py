"""The front door with API keys on, against a live cluster (tests/cluster/conftest.py `keyed`):
who may call, what they may force and see, per-key limits that spare other keys, and tenants
that do not share cached KV."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import socket
import statistics
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

from tests.cluster.conftest import KEYS, Operator, fresh_prompt, in_flight, stream_completion
from tests.cluster.test_migration import until

pytestmark = pytest.mark.slow


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def post(url: str, body: dict, key: str | None = None) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, headers=auth(key) if key else {}, timeout=120)


def test_keys_scopes_and_what_each_key_sees(keyed):
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    r = post(keyed.url, body)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert post(keyed.url, body, "calm").status_code == 200
    assert httpx.get(keyed.url + "/health").status_code == 200  # stays open
    assert httpx.get(keyed.url + "/metrics").status_code == 401
    assert httpx.get(keyed.url + "/metrics", headers=auth("tenant-a")).status_code == 200
    forced = {**body, "pdd": {"pipeline": "p-md"}}
    denied = post(keyed.url, forced, "calm")
    assert denied.status_code == 403 and denied.json()["error"]["param"] == "pdd"
    admin = post(keyed.url, forced, "tenant-a")
    assert admin.status_code == 200 and admin.json()["pdd"]["instances"]["md"] == "md-0"
    user_view = post(keyed.url, body, "calm").json()["pdd"]
    assert "instances" not in user_view and "prefix_hit_tokens" not in user_view and "plan_estimates" not in user_view
    assert user_view["timings_ms"]["ttft"] > 0  # but the user's own timings are there
    for bad in ('{"prompt": "x", "max_tokens": 1' + "0" * 5000 + "}", '{"prompt": [' + "9" * 5000 + "]}"):
        r = httpx.post(keyed.url + "/v1/completions", content=bad, headers=auth("calm"), timeout=30)
        assert r.status_code == 400 and "127.0.0.1" not in r.text, r.text


def _ttft_ms(url: str, key: str, i: int) -> float:
    body = {"prompt": fresh_prompt(16, f"calm{i}"), "max_tokens": 4, "temperature": 0}
    with httpx.stream(
        "POST", url + "/v1/completions", json={**body, "stream": True}, headers=auth(key), timeout=120
    ) as r:
        assert r.status_code == 200
        t0 = time.perf_counter()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return (time.perf_counter() - t0) * 1000
    raise AssertionError("no token")


def test_one_key_flooding_gets_429_while_another_key_is_served(keyed):
    quiet = [_ttft_ms(keyed.url, "calm", i) for i in range(5)]
    flood_body = {"prompt": fresh_prompt(16, "flood"), "temperature": 0, "ignore_eos": True, "stream": True}

    def flood(_: int) -> tuple[int, str | None]:
        r = httpx.post(keyed.url + "/v1/completions", json=flood_body, headers=auth("flooder"), timeout=120)
        return r.status_code, r.headers.get("retry-after")

    # The key's two slots are taken by streams held open (they would run for minutes) before the
    # flood: the rest must all be refused, however fast the machine finishes a request.
    readers = []
    with httpx.Client(timeout=120) as client, contextlib.ExitStack() as held:
        for _ in range(2):  # 2,000 tokens: minutes of decoding, within the relay's 4,096-token pool
            body = {**flood_body, "max_tokens": 2000}
            r = held.enter_context(
                client.stream("POST", keyed.url + "/v1/completions", json=body, headers=auth("flooder"))
            )
            lines = r.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: "))[len("data: ") :])
            assert r.status_code == 200 and first["choices"][0]["text"], first
            reader = threading.Thread(target=_read_until_closed, args=(lines,), daemon=True)
            reader.start()  # read as a client does: one that stops reading is cut (the next test)
            readers.append(reader)
        with concurrent.futures.ThreadPoolExecutor(98) as pool:
            flooding = [pool.submit(flood, i) for i in range(98)]
            during = [_ttft_ms(keyed.url, "calm", 100 + i) for i in range(5)]
            results = [f.result() for f in flooding]
    for reader in readers:  # their streams are closed now (joined inside, each waited out its 30 s)
        reader.join(30)
        assert not reader.is_alive()
    limited = [r for r in results if r[0] == 429]
    print(
        f"\nflood of 100 streams on a key limited to 2: {len(limited)} told 429; the other key's TTFT P50 "
        f"{statistics.median(quiet):.0f} ms quiet, {statistics.median(during):.0f} ms during the flood"
    )
    assert len(limited) == 98 and all(r[1] for r in limited), results  # Retry-After on each
    states = Operator(keyed).idle()  # the two held streams, left, were aborted and freed
    assert all(s.requests == [] for s in states.values()), {i: s.requests for i, s in states.items()}


def _read_until_closed(lines) -> None:
    with contextlib.suppress(httpx.HTTPError):  # the stream closed under it: the test is done with it
        for _ in lines:
            pass


def _raw_request(
    url: str, key: str, body: bytes, path: str = "/v1/completions", length: int | None = None
) -> socket.socket:
    """A POST to `path` on a socket of its own that reads as little as the kernel lets it (a 4 KiB
    receive buffer), declaring `length` bytes of body (default: all of `body`)."""
    where = urlparse(url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((where.hostname, where.port))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {where.hostname}\r\nAuthorization: Bearer {KEYS[key]}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body) if length is None else length}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def _read(sock: socket.socket, timeout: float, stop: bytes = b"") -> bytes:
    """What the socket gets until it closes, `stop` arrives, or `timeout` seconds pass quietly."""
    sock.settimeout(timeout)
    data = b""
    with contextlib.suppress(OSError):
        while (chunk := sock.recv(1 << 16)) and not (stop and stop in data + chunk):
            data += chunk
        data += chunk
    return data


DEAF = 64  # clients that never read: the shipped config's max_queue


def test_clients_that_stop_reading_or_sending_free_their_slots(keyed):
    """The deaf key has 64 slots, as many as the shipped gateway has in all (`max_queue`). 64
    streams whose clients never read fill their sockets, then wait on them: past
    `timeouts.client_s` (10 s here) each is ended, aborted in every stage and its slot freed, so a
    65th request is served. Each event carries 20 top logprobs (~2 KB), so a stream fills the
    gateway's buffers within ~50 tokens, not ~500. A body that never arrives gets 408 as well."""
    body = {
        "messages": [{"role": "user", "content": fresh_prompt(16, "deaf")}],
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 20,
        "stream": True,
    }
    deaf = [_raw_request(keyed.url, "deaf", json.dumps(body).encode(), "/v1/chat/completions") for _ in range(DEAF)]
    try:
        admin = auth("tenant-a")
        until(lambda: in_flight(keyed.url, admin) >= DEAF, 120, f"the {DEAF} streams admitted", every=0.2)
        small = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}
        assert post(keyed.url, small, "deaf").status_code == 429  # every slot of the key is held
        with _raw_request(keyed.url, "calm", b'{"prompt": "x", ', length=200) as half:  # never the rest
            answer = _read(half, 60, stop=b"body_timeout")
        assert answer.startswith(b"HTTP/1.1 408") and b"body_timeout" in answer, answer[:300]
        # without the write deadline they would hold them until their clients went: never, here
        until(lambda: post(keyed.url, small, "deaf").status_code == 200, 300, "the 65th served", every=1)
        until(lambda: in_flight(keyed.url, admin) == 0, 120, "every deaf stream cut", every=1)
        for sock in deaf:  # what each got: a stream cut short, no end of it
            got = _read(sock, 5)
            assert got.startswith(b"HTTP/1.1 200") and b"data: {" in got, got[:300]
            assert b"[DONE]" not in got and b'"finish_reason": "length"' not in got
    finally:
        for sock in deaf:
            sock.close()
    states = Operator(keyed).idle(30)
    assert all(s.requests == [] for s in states.values()), {i: s.requests for i, s in states.items()}


def test_tenants_do_not_share_cached_kv(keyed):
    prompt = fresh_prompt(120, "tenant")  # several KV blocks, never seen before
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    first = post(keyed.url, body, "tenant-a").json()["pdd"]
    again = post(keyed.url, body, "tenant-a").json()["pdd"]
    other = post(keyed.url, body, "tenant-b").json()["pdd"]
    assert first["prefix_hit_tokens"] == {"prefill": 0, "md": 0}
    assert again["prefix_hit_tokens"]["prefill"] > 0  # the same tenant hits its own prefix
    assert other["prefix_hit_tokens"] == {"prefill": 0, "md": 0}, json.dumps(other)


def test_the_streams_of_an_admitted_key_finish_exactly(keyed, mixed_reference, smol_tokenizer):
    prompt = "Water boils at"
    text, pdd, _ = stream_completion(
        keyed.url + "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0}, headers=auth("calm")
    )
    # A user key cannot choose the plan: the policy does, from live load and link estimates. A short
    # prompt on a quiet fleet goes p-md; a moment's stale queue figures can put p-md's estimate over
    # the SLO and send it through the relay. Either way the text is the fleet's one answer: the
    # batch-invariant kernels make every route say the same.
    ids = smol_tokenizer(prompt)["input_ids"]
    assert text == mixed_reference(ids, 8), pdd
    assert "instances" not in pdd
