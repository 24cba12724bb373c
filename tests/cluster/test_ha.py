"""The control plane survives its own deaths, on configs/ha.yaml as shipped (2 gateways, 2
schedulers, a 3-server NATS cluster per site, Redis with a replica and 3 Sentinels).

Under a steady stream of requests through both gateways, the test kills (SIGKILL) one scheduler,
then one NATS server of each site, then the Redis primary, then one gateway, whose clients retry
on the other with the same request id. No request may be lost (every one answered 200), none
duplicated (one plan per request id: a retried request is picked up, or moved as a migration),
none hang, and every answer equals the fleet's own unfaulted answer for its prompt. Each fault's
pause is printed. Then every dead member is restarted alone and must rejoin: `pdd status`
shows it up, and both gateways serve again.
"""

from __future__ import annotations

import asyncio
import base64
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from pdd.control import gather_status
from pdd.launcher import Cluster
from shared.messages import Plan
from shared.registry import PLAN, Registry

HA_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "ha.yaml"
PROMPTS = [
    "The three primary colors are",
    "A haiku about the sea:",
    "To boil an egg, first",
    "The capital of Japan is",
    "Photosynthesis turns sunlight into",
    "My favourite programming language is",
]
MAX_TOKENS = 20


@dataclass
class Outcome:
    request_id: str
    prompt: int
    started: float
    ended: float = 0.0
    status: int = 0
    text: str = ""
    pdd: dict = field(default_factory=dict)
    gateways: list[str] = field(default_factory=list)  # the gateways it was sent to, in order


class Clients:
    """Two clients, each sending one request after another, alternating between the gateways;
    a client whose gateway vanished mid-request retries it on the other with the same id."""

    def __init__(self, urls: dict[str, str]) -> None:
        self.urls = urls
        self.outcomes: list[Outcome] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(w,), daemon=True) for w in range(2)]
        self.t0 = time.monotonic()

    def start(self) -> Clients:
        for t in self.threads:
            t.start()
        return self

    def done_since(self, t: float) -> int:
        with self.lock:
            return sum(1 for o in self.outcomes if o.started > t and o.ended)

    def planners(self) -> set[str]:
        """The schedulers that planned the requests answered so far."""
        with self.lock:
            return {o.pdd["scheduler"] for o in self.outcomes if o.ended and o.pdd and "scheduler" in o.pdd}

    def _run(self, worker: int) -> None:
        names = sorted(self.urls)
        with httpx.Client(timeout=120) as http:
            for n in range(10_000):
                if self.stop.is_set():
                    return
                o = Outcome(f"ha-{worker}-{n}", (worker + n) % len(PROMPTS), time.monotonic())
                with self.lock:
                    self.outcomes.append(o)
                first = names[(worker + n) % len(names)]
                for gateway in [first, *(g for g in names if g != first)]:
                    o.gateways.append(gateway)
                    try:
                        r = http.post(
                            self.urls[gateway] + "/v1/completions",
                            json={"prompt": PROMPTS[o.prompt], "max_tokens": MAX_TOKENS, "temperature": 0},
                            headers={"X-Request-Id": o.request_id},
                        )
                    except httpx.TransportError:  # the gateway died: the same request, on the other
                        continue
                    o.status = r.status_code
                    if r.status_code == 200:
                        o.text, o.pdd = r.json()["choices"][0]["text"], r.json()["pdd"]
                    else:
                        o.text = r.text
                    break
                o.ended = time.monotonic()


@pytest.fixture(scope="module")
def ha():
    with Cluster(str(HA_CONFIG), port=0, log=lambda m: None, failpoints=True) as cluster:
        yield cluster


def status(cluster: Cluster) -> dict[str, dict]:
    view = asyncio.run(gather_status(cluster.cfg))
    return {row["id"]: row for row in view["processes"]}


async def dispatch_of(cluster: Cluster, request_id: str) -> str:
    """The dispatch the schedulers made of a request id: one plan per id, shared in Redis."""
    registry = Registry.of(cluster.cfg)
    try:
        held = await registry.r.get(PLAN + request_id)
    finally:
        await registry.r.aclose()
    return Plan.decode(base64.b64decode(held)).dispatch_id


def until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


@pytest.mark.slow
def test_a_submission_whose_scheduler_died_holding_it_is_planned_by_the_other(ha):
    """scheduler-0 claims a submission and dies before it answers (a failpoint holds the answer
    back; then SIGKILL): the gateway asks again after a control round, scheduler-1 finds the
    claim of a scheduler whose presence expired, takes it over and plans the request."""
    body = {"prompt": PROMPTS[3], "max_tokens": MAX_TOKENS, "temperature": 0}
    with httpx.Client(timeout=120) as http:
        reference = http.post(ha.url + "/v1/completions", json=body).json()["choices"][0]["text"]
        ha.failpoints.write_text("scheduler-0/scheduler.submit=drop@1")
        for n in range(40):  # the queue group gives each submission to either scheduler
            held = {}
            sending = threading.Thread(
                target=lambda n=n, held=held: held.update(r=http.post(ha.url + "/v1/completions", json=body))
            )
            started = time.monotonic()
            sending.start()
            sending.join(2.0)  # an answer takes well under a second here, unless it is held
            if sending.is_alive():
                break
        else:
            pytest.fail("scheduler-0 never got a submission")
        ha.kill("scheduler-0")
        sending.join(60)
    r = held["r"]
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference
    assert r.json()["pdd"]["scheduler"] == "scheduler-1"
    print(f"\nheld by a scheduler that died: answered after {time.monotonic() - started:.2f} s")
    ha.failpoints.write_text("")
    ha.start_process("scheduler-0")
    until(lambda: status(ha)["scheduler-0"]["state"] == "up", 60, "scheduler-0 back")


@pytest.mark.slow
def test_the_control_plane_survives_the_death_of_each_member(ha):
    urls = ha.urls
    with httpx.Client(timeout=120) as http:
        reference = [
            http.post(
                urls["gateway-0"] + "/v1/completions",
                json={"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0},
            ).json()["choices"][0]["text"]
            for p in PROMPTS
        ]
    rows = status(ha)
    assert {r["role"] for r in rows.values()} >= {"gateway", "scheduler", "nats", "redis", "prefill", "md"}
    assert [r["id"] for r in rows.values() if r.get("primary")] == ["redis"]

    def kill_server(name: str) -> None:
        ha.servers[name].proc.send_signal(signal.SIGKILL)
        ha.servers[name].proc.wait(10)

    faults = [
        ("scheduler-0", lambda: ha.kill("scheduler-0")),
        ("nats-A-0 + nats-B-0", lambda: (kill_server("nats-A-0"), kill_server("nats-B-0"))),
        ("redis primary", lambda: kill_server("redis")),
        ("gateway-1", lambda: ha.kill("gateway-1")),
    ]
    clients = Clients(urls).start()
    pauses = []
    try:
        # both schedulers have planned before the first of them dies (the queue group picks one
        # at random per submission: the first 4-6 answers all came from one of them in a full run)
        until(lambda: clients.done_since(0) >= 4 and len(clients.planners()) == 2, 120, "answers planned by both")
        for name, fault in faults:
            at = time.monotonic()
            print(f"  {name} killed at {at - clients.t0:.2f}s")
            fault()
            until(lambda at=at: clients.done_since(at) >= 4, 120, f"answers after killing {name}")
            with clients.lock:
                caught = [o for o in clients.outcomes if o.started <= at < (o.ended or time.monotonic())]
                normal = [o.ended - o.started for o in clients.outcomes if o.ended and o.ended < at]
            pauses.append((name, max((o.ended - o.started for o in caught), default=0.0), min(normal, default=0.0)))
            for o in caught:
                d = o.pdd
                print(
                    f"  {name}: {o.request_id} via {o.gateways} {o.ended - o.started:.2f}s status {o.status} "
                    f"moved {d.get('migrations')} resent {d.get('resends')} by {d.get('scheduler')}"
                )
    finally:
        clients.stop.set()
        for t in clients.threads:
            t.join(180)
    print("\nfault                 longest request caught by it   (quickest before it)")
    for name, longest, quickest in pauses:
        print(f"{name:<22}{longest:>10.2f} s {quickest:>26.2f} s")
    answered = [o for o in clients.outcomes if o.ended]
    for o in answered:
        if o.status != 200:
            print(f"  failed: {o.request_id} via {o.gateways} {o.status} at {o.started - clients.t0:.2f}s: {o.text}")
    assert all(not t.is_alive() for t in clients.threads), "a request hung"
    assert [o.request_id for o in answered if o.status != 200] == [], "lost requests"
    assert [o.request_id for o in answered if o.text != reference[o.prompt]] == [], "answers that differ"
    moved = [o for o in answered if len(o.gateways) > 1]
    assert moved, "no request was caught by the gateway's death"
    for o in moved:  # picked up where it was (the one dispatch the schedulers made of it), or moved cleanly
        assert o.gateways == ["gateway-1", "gateway-0"] and o.pdd["request_id"] == o.request_id
        planned = asyncio.run(dispatch_of(ha, o.request_id))
        assert o.pdd["migrations"] > 0 or o.pdd["dispatch_id"] == planned, (o.request_id, o.pdd, planned)
    schedulers = {o.pdd["scheduler"] for o in answered}
    assert schedulers == {"scheduler-0", "scheduler-1"}, schedulers

    # every dead member is restarted alone, and rejoins
    ha.start_process("scheduler-0")
    ha.start_process("gateway-1")
    for name in ("nats-A-0", "nats-B-0", "redis"):
        ha.servers[name].start()

    def all_up() -> bool:
        rows = status(ha)
        return (
            all(r["state"] == "up" for r in rows.values()) and sum(bool(r.get("primary")) for r in rows.values()) == 1
        )

    until(all_up, 60, "every process and server up again, one Redis primary")
    rows = status(ha)
    assert rows["redis"]["primary"] is False and rows["redis-1"]["primary"] is True, "the old primary is a replica"
    with httpx.Client(timeout=120) as http:
        for url in urls.values():
            r = http.post(
                url + "/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0}
            )
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference[0]
