"""The client walks away at every stage of a request's life: queued behind another prompt, while
prefilling, with its KV on the WAN, while the relay streams, in the middle of a catch-up
handoff, and while main-decode streams. Each time every stage drops it within 2 s, its blocks
come back by the end of the engine step then running (free, or held by a prefix cache that can
evict them), nothing is left in Redis, and a transfer on the wire is torn down (the WAN stops
carrying its bytes). Then a stream whose KV can never arrive ends with an SSE error event and
`[DONE]`, not a hang."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.cluster.conftest import completion, fresh_prompt

pytestmark = pytest.mark.slow

DROP_S = 2.0


class Stream:
    """A streamed completion the test can walk away from at any moment."""

    def __init__(self, url: str, body: dict) -> None:
        self.client = httpx.Client(timeout=120)
        request = self.client.build_request("POST", url + "/v1/completions", json={**body, "stream": True})
        self.response = self.client.send(request, stream=True)
        assert self.response.status_code == 200, self.response.read()
        self.request_id = self.response.headers["x-request-id"]
        self.lines = self.response.iter_lines()

    def tokens(self, n: int) -> None:
        """Read until `n` chunks of text have arrived."""
        seen = 0
        while seen < n:
            seen += next(self.lines).startswith('data: {"id"')

    def disconnect(self) -> float:
        self.response.close()
        self.client.close()
        return time.monotonic()


def _holders(operator, request_id: str) -> dict[str, list[str]]:
    states = {i.id: operator.inspect(i.id) for i in operator.cluster.cfg.instances}
    return {
        iid: [r for r in s.requests if r.startswith(request_id)]
        for iid, s in states.items()
        if any(r.startswith(request_id) for r in s.requests)
    }


def _until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _assert_dropped(operator, request_id: str, left: float) -> None:
    """Every stage let go of the request within DROP_S of the disconnect, and nothing leaked: its
    blocks came back once the engine step running then ended (an abort reaches the engine between
    two steps, and a prefill chunk on a slow CPU takes seconds). That is polled, for up to three
    measured steps (a moving average) and 10 s more: a busy machine can stretch one step well past
    its average, and a request whose blocks never come back still fails."""
    while (held := _holders(operator, request_id)) and time.monotonic() - left < DROP_S:
        time.sleep(0.05)
    print(f"\n{request_id}: dropped everywhere {time.monotonic() - left:.2f}s after the disconnect")
    assert held == {}
    states = operator.idle(timeout=DROP_S + 3 * _longest_step_s(operator) + 10.0)
    for iid, s in states.items():
        assert s.requests == [] and s.free_blocks + s.figures.engine.cached_blocks == s.total_blocks, (iid, s)
    assert operator.request_keys() == []


def _longest_step_s(operator) -> float:
    """The slowest engine's measured step (moving average), in seconds."""
    return max(operator.inspect(i.id).figures.engine.step_ms for i in operator.cluster.cfg.instances) / 1000


def _body(model_id: str, prompt: str, n: int = 300, **pdd) -> dict:
    return {"model": model_id, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "pdd": pdd}


@pytest.fixture
def slow_wan(cluster, operator):
    """Set the WAN to `mbps` for one test; restored after."""

    def set_to(mbps: float) -> None:
        operator.wan(bandwidth_mbps=mbps)

    yield set_to
    operator.wan(bandwidth_mbps=cluster.cfg.wan.bandwidth_mbps)


def test_abort_while_queued_behind_another_prompt(cluster, model_id, operator):
    # ~3,400 tokens of prefill ahead of it: seconds of steps
    ahead = Stream(cluster.url, _body(model_id, fresh_prompt(900, "ahead"), 1, pipeline="p-rld"))
    _until(lambda: ahead.request_id in operator.inspect("prefill-0").requests, 30, "prefill to take the long prompt")
    s = Stream(cluster.url, _body(model_id, fresh_prompt(40, "queued")))
    assert s.request_id in operator.inspect("prefill-0").requests
    left = s.disconnect()
    while _holders(operator, s.request_id) and time.monotonic() - left < DROP_S:
        time.sleep(0.05)
    assert _holders(operator, s.request_id) == {}
    # the prompt ahead is still being computed: the one that went was queued behind it
    assert "prefill-0" in _holders(operator, ahead.request_id)
    # then the one ahead goes too, mid-prefill (waiting for its end took 20-40 s of the suite):
    # both dropped, every block back, nothing left in Redis
    _assert_dropped(operator, ahead.request_id, ahead.disconnect())


def test_abort_while_prefilling(cluster, model_id, operator):
    s = Stream(cluster.url, _body(model_id, fresh_prompt(900, "prefilling")))
    _until(lambda: operator.inspect("prefill-0").figures.engine.running, 30, "prefill to start computing")
    assert "prefill-0" in _holders(operator, s.request_id)  # still computing its prompt when the client goes
    _assert_dropped(operator, s.request_id, s.disconnect())


def test_abort_with_the_kv_on_the_wan_tears_the_transfer_down(
    cluster, model_id, operator, slow_wan, reference, smol_tokenizer
):
    slow_wan(3.0)  # ~10 MB of KV: half a minute on the wire
    before = operator.line_bytes("md-0")
    s = Stream(cluster.url, _body(model_id, fresh_prompt(200, "kv-in-flight"), pipeline="p-md"))
    _until(lambda: operator.line_bytes("md-0") - before > 256 * 1024, 30, "the KV to be on the WAN")
    during = operator.wan().connections.get("md-0", 0)  # the transfer's, and any standing idle ones
    left = s.disconnect()
    _assert_dropped(operator, s.request_id, left)
    _until(lambda: operator.wan().connections.get("md-0", 0) < during, 5, "the line to drop the transfer's connection")
    carried = operator.line_bytes("md-0") - before
    time.sleep(1.5)  # long enough for a 3 Mbps line to carry another 500 KB if it still were
    assert operator.line_bytes("md-0") - before == carried  # the line no longer carries it
    print(f"WAN carried {carried / 1e6:.1f} MB of the request's KV before the abort")
    slow_wan(cluster.cfg.wan.bandwidth_mbps)
    prompt = fresh_prompt(30, "after-teardown")
    out = completion(cluster.url, _body(model_id, prompt, 12, pipeline="p-md"))
    text = out["choices"][0]["text"]
    assert text == reference(smol_tokenizer(prompt)["input_ids"], 12, draft=text)


def test_abort_while_the_relay_streams(cluster, model_id, operator, slow_wan):
    slow_wan(3.0)  # main-decode's copy is still crossing: only the relay decodes
    s = Stream(cluster.url, _body(model_id, fresh_prompt(120, "relay"), pipeline="p-rld-md"))
    s.tokens(4)
    assert "rld-0" in _holders(operator, s.request_id)
    _assert_dropped(operator, s.request_id, s.disconnect())


def test_abort_in_the_middle_of_a_catch_up_handoff(cluster, model_id, operator, slow_wan):
    slow_wan(8.0)  # ~3 s on the wire: the relay builds a backlog of dozens of tokens, handed in chunks
    # the stream is cut as the handoff begins; 2000 tokens leave the relay busy for a minute here,
    # so a machine many times faster still reaches the handoff before the request ends
    body = _body(model_id, fresh_prompt(60, "handoff"), 2000, pipeline="p-rld-md", handoff="catchup")
    s = Stream(cluster.url, body)
    handing = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + 60
        while not handing.is_set() and time.monotonic() < deadline:
            if operator.inspect("rld-0").figures.handing:
                handing.set()
            time.sleep(0.03)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    for line in s.lines:
        if handing.is_set() or line == "data: [DONE]":
            break
    left = s.disconnect()
    handing.set()
    watcher.join(5)
    assert line != "data: [DONE]", "the request ended before its handoff began"
    _assert_dropped(operator, s.request_id, left)


def test_abort_while_main_decode_streams(cluster, model_id, operator):
    s = Stream(cluster.url, _body(model_id, fresh_prompt(40, "main"), pipeline="p-md"))
    s.tokens(5)
    assert set(_holders(operator, s.request_id)) == {"md-0"}
    _assert_dropped(operator, s.request_id, s.disconnect())


def test_a_stream_that_fails_ends_with_an_error_event(fleet, fleet_operator):
    """Main-decode cannot ever hold this request (its budget is more KV than either md pool of
    the fleet has) and the client forced p-md: the response has started (200, SSE), so the
    failure comes as an error event, then [DONE], and nothing is left anywhere."""
    operator = fleet_operator
    body = {
        "prompt": fresh_prompt(20, "doomed"),
        "max_tokens": 2040,
        "temperature": 0,
        "ignore_eos": True,
        "pdd": {"pipeline": "p-md"},
        "stream": True,
    }
    with httpx.stream("POST", fleet.url + "/v1/completions", timeout=120, json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2][len("data: ") :])["error"]
    print(f"\nerror event: {error}")
    assert error["type"] == "server_error" and error["message"]
    assert all("error" not in json.loads(x[6:]) for x in lines[:-2])
    states = operator.idle()
    assert all(s.requests == [] for s in states.values()), states
    assert operator.request_keys() == []
