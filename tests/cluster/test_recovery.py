"""Lost messages, against real processes: core NATS is at-most-once, so a token chunk can vanish
(a leaf reconnect, a NATS restart, a slow consumer). A failpoint in the decoder drops exactly one
chunk (shared/failpoints.py); the gateway notices the gap, asks the decoder again by index, and
the stream ends whole, equal to the reference, in seconds rather than `timeouts.request_s`."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.cluster.conftest import fresh_prompt, stream_completion
from tests.cluster.test_faults import _body
from tests.cluster.test_migration import until

pytestmark = pytest.mark.slow
N = 24


@pytest.mark.parametrize(
    "pipeline, fault",
    [
        ("p-md", "md-0/decoder.token_chunk=drop@5"),  # mid-stream: later chunks wait behind the gap
        ("p-md", "md-0/decoder.final_chunk=drop@1"),  # the last one: nothing comes after it
        ("p-rld-md", "rld-0/decoder.token_chunk=drop@2"),  # the relay's, before the handoff
    ],
)
def test_a_lost_chunk_is_asked_again(cluster, operator, model_id, reference, smol_tokenizer, pipeline, fault):
    prompt = fresh_prompt(30, "lost-")
    body = _body(model_id, prompt, N, pipeline)
    operator.failpoints(fault)
    try:  # without the resend it waits for request_s (90 s): the 60 s read timeout fails it first
        text, pdd, _ = stream_completion(cluster.url + "/v1/completions", body, timeout=60)
    finally:
        operator.failpoints("")
    assert text == reference(smol_tokenizer(prompt)["input_ids"], N, ignore_eos=True, draft=text)
    assert pdd["resends"] >= 1, "the gap was filled by a resend, not by chance"
    assert pdd["migrations"] == 0, "nothing died: the request stayed where it was"
    assert sum(pdd["tokens_by_role"].values()) >= N
    assert not operator.idle()["md-0"].requests


class Streams:
    """Streams that run while a test watches them, each on its own thread, until `close()`:
    a fault goes in mid-stream and the test judges them after a fixed time, whatever the
    machine's speed (the streams are long enough never to end first)."""

    def __init__(self, cluster, bodies: list[dict]) -> None:
        self.events: list[list[dict]] = [[] for _ in bodies]
        self.ids: list[str] = ["" for _ in bodies]
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._read, args=(cluster.url, b, i)) for i, b in enumerate(bodies)]
        for t in self._threads:
            t.start()

    def _read(self, url: str, body: dict, i: int) -> None:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            self.ids[i] = r.headers.get("x-request-id", "")
            for line in r.iter_lines():
                if self._stop.is_set():
                    return
                if line.startswith("data: {"):
                    event = json.loads(line[len("data: ") :])
                    if "error" in event:
                        self.errors.append(event["error"]["message"])
                    self.events[i].append(event)

    def text(self, i: int) -> str:
        return "".join(e["choices"][0]["text"] for e in self.events[i] if e["choices"])

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)


LONG = 1500  # tokens: no stream ends before the test has judged it, on any machine


def _judge(streams: Streams, prompts: list[str], operator, reference, smol_tokenizer) -> None:
    """Every stream still runs where it started (md-0 holds its first attempt: no migration),
    without an error, and what it streamed so far is the reference's beginning."""
    held = set(operator.inspect("md-0").requests)
    assert set(streams.ids) <= held, f"moved or dropped: md-0 holds {held}, the streams are {streams.ids}"
    streams.close()
    assert not streams.errors, streams.errors
    for i, prompt in enumerate(prompts):
        text = streams.text(i)  # hundreds of tokens: the reference verifies them in one forward pass
        ids = smol_tokenizer(text, add_special_tokens=False)["input_ids"][:-2]  # the last may be a partial character
        head = smol_tokenizer.decode(ids)
        assert len(ids) >= 8 and text.startswith(head), (len(ids), text[:80])
        assert reference(smol_tokenizer(prompt)["input_ids"], len(ids), ignore_eos=True, draft=head) == head


def test_a_redis_restart_under_load_ends_no_request(cluster, operator, model_id, reference, smol_tokenizer):
    """Redis restarts empty (no persistence) while two streams run: the instances' keys, the
    index and every request record are gone. The heartbeats refill the registry, the records of
    the requests taken before the restart are written again (not "no longer in flight": each is
    checked once held 10 s), and both streams go on where they were, with no migration."""
    prompts = [fresh_prompt(20, f"redis{i}-") for i in range(2)]
    streams = Streams(cluster, [_body(model_id, p, LONG, pl) for p, pl in zip(prompts, ("p-md", "p-rld-md"))])
    try:
        until(lambda: all(len(ev) >= 3 for ev in streams.events), 120, "every stream's first tokens")
        redis = cluster.servers["redis"]
        redis.stop()
        redis.start()
        t0 = time.monotonic()
        until(lambda: len(operator.request_keys()) == 2, 30, "both records written again")
        seen = [len(ev) for ev in streams.events]
        until(lambda: time.monotonic() - t0 > 12, 30, "a holder's check of both requests")
        assert all(len(ev) > n for ev, n in zip(streams.events, seen)), "both still stream"
        _judge(streams, prompts, operator, reference, smol_tokenizer)
    finally:
        streams.close()
    until(lambda: not operator.request_keys(), 30, "no record left behind")


def test_a_stream_outliving_its_records_ttl_is_not_killed(cluster, operator, model_id, reference, smol_tokenizer):
    """The record is written with a TTL (`timeouts.request_s`); a stream that runs longer, while
    its tokens flow, keeps it: every heartbeat of its holder renews it. Here the record is made
    to expire 20 s after the first tokens; the holder reports the request from 10 s on (after
    it was taken, before its first tokens), and renews it then."""
    prompt = fresh_prompt(20, "ttl-")
    streams = Streams(cluster, [_body(model_id, prompt, LONG, "p-md")])
    try:
        until(lambda: len(streams.events[0]) >= 3, 120, "the first tokens")
        r = operator.redis()
        try:
            key = f"pdd:request:{streams.ids[0]}"
            assert r.expire(key, 20)
            t0 = time.monotonic()
            until(lambda: r.ttl(key) > 60, 40, "the record renewed by a heartbeat", every=0.2)
            until(lambda: time.monotonic() - t0 > 22, 40, "past the record's first TTL")
            assert r.exists(key)
        finally:
            r.close()
        _judge(streams, [prompt], operator, reference, smol_tokenizer)
    finally:
        streams.close()
