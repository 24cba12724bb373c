"""An instance dies (SIGKILL) with requests in flight: the request moves to another instance by
resending prompt + generated token ids, the stream goes on in order with no token duplicated or
missing, and greedy output still equals the reference. The dead instance is never used again."""

from __future__ import annotations

import threading
import time

import pytest

from tests.cluster.conftest import Operator, fresh_prompt, stream_completion

pytestmark = pytest.mark.slow


def _restart(cluster, name: str) -> None:
    cluster.start_process(name)
    r = Operator(cluster).redis()
    deadline = time.monotonic() + 90
    while not r.exists(f"pdd:instance:{name}") and time.monotonic() < deadline:
        time.sleep(0.2)
    r.close()


@pytest.mark.parametrize("pipeline, victim", [("p-md", "md"), ("p-rld-md", "rld"), ("p-md", "prefill")])
def test_request_survives_the_death_of_its_instance(fleet, fleet_operator, reference, smol_tokenizer,
                                                    pipeline, victim):  # fmt: skip
    words = 400 if victim == "prefill" else 40  # a long prompt keeps prefill busy for seconds
    prompt = fresh_prompt(words, f"kill-{victim}")
    n = 48
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "pdd": {"pipeline": pipeline}}
    r = fleet_operator.redis()
    result: dict = {}
    if victim == "rld":  # keep main-decode's copy on the wire so the relay still holds the request
        fleet_operator.wan(bandwidth_mbps=4.0)
    worker = threading.Thread(target=lambda: result.update(
        out=stream_completion(fleet.url + "/v1/completions", body, timeout=240)))  # fmt: skip
    worker.start()
    deadline, target = time.monotonic() + 60, None
    while target is None and time.monotonic() < deadline:  # find the instance of that role holding it
        for inst in (i for i in fleet.cfg.instances if i.role == victim):
            if fleet_operator.inspect(inst.id).requests:
                target = inst.id
        time.sleep(0.05)
    assert target is not None
    time.sleep(1.0 if victim == "prefill" else 2.0)  # mid-prefill / a few tokens into decoding
    fleet.kill(target)
    worker.join(240)
    try:
        text, pdd, events = result["out"]
        print(f"\nkilled {target} ({pipeline}): migrations {pdd['migrations']}, tokens {pdd['tokens_by_role']}, "
              f"now on {pdd['instances']}")  # fmt: skip
        assert text == reference(smol_tokenizer(prompt)["input_ids"], n)
        assert pdd["migrations"] == 1 and target not in pdd["instances"].values()
        assert not r.exists(f"pdd:instance:{target}")  # its heartbeat expired
    finally:
        fleet_operator.wan(bandwidth_mbps=fleet.cfg.wan.bandwidth_mbps)
        _restart(fleet, target)
        r.close()
    assert all(s.requests == [] for s in fleet_operator.idle(timeout=5).values())
