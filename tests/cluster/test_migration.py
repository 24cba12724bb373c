"""An instance dies (SIGKILL) with requests in flight: the request moves to another instance by
resending prompt + generated token ids, the stream goes on in order with no token duplicated or
missing, and greedy output still equals the reference. The dead instance is never used again."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.cluster.conftest import Operator, fresh_prompt, stream_completion

pytestmark = pytest.mark.slow


def until(predicate, timeout: float, what: str, every: float = 0.05):
    """Poll `predicate` until it returns something truthy and return that; fail the test after
    `timeout` seconds. (The pause between polls is the polling interval, not a guess.)"""
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(every)
    return value


def restart(cluster, name: str) -> None:
    cluster.start_process(name)
    r = Operator(cluster).redis()
    try:
        until(lambda: r.exists(f"pdd:instance:{name}"), 90, f"{name} to register again", every=0.2)
    finally:
        r.close()


def _holder(fleet, operator: Operator, role: str) -> str | None:
    """The instance of `role` that holds a request now (None: none does)."""
    return next((i.id for i in fleet.cfg.instances if i.role == role and operator.inspect(i.id).requests), None)


# a JSON answer long enough to be cut in its middle (the grammar's state moves as the ids do)
JSON_ANSWER = {
    "type": "json_schema",
    "json_schema": {
        "name": "items",
        "schema": {
            "type": "object",
            "properties": {
                "items": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 6, "maxItems": 8}
            },
            "required": ["items"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize(
    "pipeline, victim, answer",
    [("p-md", "md", "text"), ("p-rld-md", "rld", "text"), ("p-md", "prefill", "text"), ("p-md", "md", "json")],
)
def test_request_survives_the_death_of_its_instance(
    fleet, fleet_operator, reference, smol_tokenizer, pipeline, victim, answer
):
    words = 400 if victim == "prefill" else 40  # a long prompt keeps prefill busy for seconds
    prompt = fresh_prompt(words, f"kill-{victim}")
    n = 48
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "pdd": {"pipeline": pipeline}}
    expected = None
    if answer == "json":  # what the same request gives when nothing dies
        body = {**body, "prompt": prompt + " List them as JSON:", "max_tokens": 128, "response_format": JSON_ANSWER}
        expected, _, _ = stream_completion(fleet.url + "/v1/completions", body, timeout=120)
    r = fleet_operator.redis()
    result: dict = {}
    events: list[dict] = []  # the stream's chunks as they arrive
    if victim == "rld":  # keep main-decode's copy on the wire so the relay still holds the request
        fleet_operator.wan(bandwidth_mbps=4.0)
    worker = threading.Thread(
        target=lambda: result.update(
            out=stream_completion(fleet.url + "/v1/completions", body, timeout=240, events=events)
        )
    )
    worker.start()
    target = None
    try:
        target = until(lambda: _holder(fleet, fleet_operator, victim), 60, f"a {victim} instance to hold it")
        if victim == "prefill":  # mid-prefill: some of the prompt's chunks computed (1500 tokens, 512 a step)
            prompt_len = len(smol_tokenizer(prompt)["input_ids"])
            until(
                lambda: 0 < fleet_operator.inspect(target).figures.engine.queued_tokens < prompt_len,
                60,
                f"{target} to be part-way through the prompt",
                every=0.01,
            )
        else:  # a few tokens into decoding on the victim
            until(
                lambda: sum(bool(e["choices"] and e["choices"][0]["text"]) for e in events) >= 4,
                60,
                f"tokens from {target}",
                every=0.01,
            )
            assert worker.is_alive() and _holder(fleet, fleet_operator, victim) == target, "it ended before the kill"
        fleet.kill(target)
        if victim == "rld":  # the slow line has done its part: the moved request need not wait on it
            fleet_operator.wan(bandwidth_mbps=fleet.cfg.wan.bandwidth_mbps)
        worker.join(240)
        text, pdd, events = result["out"]
        print(
            f"\nkilled {target} ({pipeline}): migrations {pdd['migrations']}, tokens {pdd['tokens_by_role']}, "
            f"now on {pdd['instances']}"
        )
        if answer == "json":
            assert text == expected and len(json.loads(text)["items"]) >= 6, (text, expected)
        else:
            assert text == reference(smol_tokenizer(prompt)["input_ids"], n, ignore_eos=True, draft=text)
        assert pdd["migrations"] == 1 and target not in pdd["instances"].values()
        assert not r.exists(f"pdd:instance:{target}")  # its heartbeat expired
    finally:
        fleet_operator.wan(bandwidth_mbps=fleet.cfg.wan.bandwidth_mbps)
        if target is not None and fleet.procs[target].poll() is not None:
            restart(fleet, target)
        r.close()
        worker.join(240)
    assert all(s.requests == [] for s in fleet_operator.idle().values())


def test_a_decoder_found_silent_only_after_prefill_started_ends_as_before(
    fleet, fleet_operator, reference, smol_tokenizer
):
    """The scheduler sends prefill its task beside main-decode's: by the time md-0 is found not
    to answer (dead a moment ago, its heartbeat not yet expired), prefill has computed the first
    token, sent it to the gateway and begun to push. The outcome is the one a decoder that never
    answered always had: this copy is dropped everywhere and the request planned again on md-1,
    no migration, one first token, the model's output."""
    prompt = fresh_prompt(40, "silent-md")
    n = 16
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "pdd": {"pipeline": "p-md"}}
    log = fleet.run_dir / "scheduler.log"
    before = len(log.read_text())
    fleet_operator.failpoints("md-0/decoder.task=drop@1")  # an idle fleet's fresh prompt goes to md-0 first
    try:
        text, pdd, _ = stream_completion(fleet.url + "/v1/completions", body, timeout=120)
    finally:
        fleet_operator.failpoints("")
    replanned = [line for line in log.read_text()[before:].splitlines() if "again without it" in line]
    assert any("md-0" in line for line in replanned), "md-0 was planned and found silent"
    assert pdd["instances"]["md"] == "md-1" and pdd["migrations"] == 0
    assert pdd["tokens_by_role"]["prefill"] == 1  # the dropped copy's first token was not taken as well
    assert text == reference(smol_tokenizer(prompt)["input_ids"], n, ignore_eos=True, draft=text)
    assert all(s.requests == [] for s in fleet_operator.idle().values())
