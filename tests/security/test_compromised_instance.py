"""One compromised instance against the running processes of the two-site test cluster: the
attacker holds md-0's NATS credential (its user and password) and nothing else, and tries what
issue #41 lists. Each test asserts the attempt fails; docs/security.md has the table.

What stops it: NATS users per instance whose subjects name the instance (pdd/natsconf.py), the
registrar's and the schedulers' vetting of every report by the subject it came on
(services/scheduler/registrar.py `Roster`), and WAN samples taken only from the decoder a
request's KV crosses to (services/scheduler/service.py `on_wan_sample`), and token streams
under a key the gateway mints per attempt and the plan gives its stages alone (`subjects.tokens`).
"""

from __future__ import annotations

import asyncio
import threading
import uuid

import nats
import pytest
from nats.errors import Error as NatsError

from shared import subjects
from shared.bus import Bus, BusTimeout
from shared.messages import (
    ClusterStatus,
    Heartbeat,
    HeartbeatReply,
    Inspect,
    InstanceInfo,
    Leave,
    TokenChunk,
    WanSample,
)
from tests.cluster.conftest import fresh_prompt, stream_completion
from tests.cluster.test_migration import until

pytestmark = pytest.mark.slow

ME = "md-0"  # the compromised instance


async def _connect(cluster, user: str, login: dict[str, str], errors: list[str], dc: str = "B"):
    """Connect with `login` (nats.connect's credential arguments), replies on `user`'s inbox."""

    async def on_error(e: Exception) -> None:
        errors.append(str(e).lower())

    return await nats.connect(
        cluster.nats_url(dc),
        error_cb=on_error,
        allow_reconnect=False,
        max_reconnect_attempts=0,
        inbox_prefix=f"_INBOX.{user}",
        **login,
    )


def _stolen(cluster) -> dict[str, str]:
    """md-0's NATS credential: its NKEY seed."""
    return cluster.secrets.nats_login(ME)


def _status(operator) -> ClusterStatus:
    return operator.run(lambda bus: bus.request(subjects.STATUS, Inspect(""), ClusterStatus, 5))


def test_its_credential_logs_in_as_no_other_user(cluster):
    """Its seed, given as any other user's password, opens nothing (an NKEY login is the user its
    public key names: md-0's signs as md-0 alone, tests/security/test_bundles.py)."""

    async def attempts() -> dict[str, str]:
        refused = {}
        seed = _stolen(cluster)["nkeys_seed_str"]
        for user in ("md-1", "rld-0", "prefill-0", "gateway", "scheduler", "wanlink", "operator"):
            for dc in ("A", "B"):
                try:
                    nc = await _connect(cluster, user, {"user": user, "password": seed}, [], dc)
                except NatsError as e:
                    refused[f"{user}@{dc}"] = str(e)
                else:
                    await nc.close()
        return refused

    refused = asyncio.run(attempts())
    assert len(refused) == 14, f"refused only {sorted(refused)}"
    assert all("authorization" in why.lower() for why in refused.values()), refused


@pytest.mark.parametrize(
    "subject",
    [
        subjects.decode_task("md-1"),  # another decoder's tasks: prompts and transfer secrets
        subjects.decode_task("*"),
        "pdd.decode.>",
        subjects.prefill_task("prefill-0"),
        subjects.handoff_chunk("md-1"),
        "pdd.tokens.>",  # every tenant's output
        "_INBOX.scheduler.>",  # the scheduler's replies: plans
        "_INBOX.md-1.>",  # another instance's replies
        "pdd.registry.>",  # the other instances' reports
    ],
)
def test_it_reads_nothing_meant_for_another(cluster, subject):
    errors = asyncio.run(_server_errors(cluster, lambda nc: nc.subscribe(subject)))
    assert any("permissions violation" in e and "subscription" in e for e in errors), errors


@pytest.mark.parametrize("kind", [subjects.heartbeat, subjects.leave, subjects.index, subjects.wan_sample])
def test_it_reports_on_no_other_instances_subject(cluster, kind):
    errors = asyncio.run(_server_errors(cluster, lambda nc: nc.publish(kind("prefill-0"), Leave("prefill-0").encode())))
    assert any("permissions violation" in e and "publish" in e for e in errors), errors


async def _server_errors(cluster, act) -> list[str]:
    """What the server answered `act(connection)` under md-0's credential with (its -ERR comes
    asynchronously: waited for, up to 10 s)."""
    errors: list[str] = []
    nc = await _connect(cluster, ME, _stolen(cluster), errors)
    try:
        await act(nc)
        await nc.flush()
        for _ in range(200):
            if errors:
                break
            await asyncio.sleep(0.05)
    finally:
        await nc.close()
    return errors


def test_it_can_neither_register_remove_nor_readdress_another_instance(cluster, operator):
    """On its own subjects (which it may use), reports about others are refused by the registrar:
    a forged heartbeat gets no reply and registers nothing, a forged leave removes nothing."""
    log = cluster.run_dir / "scheduler.log"
    refusals = log.read_text().count("refused")
    rld = next(i for i in _status(operator).instances if i.id == "rld-0")

    async def attack() -> None:
        bus = await Bus.connect(cluster.nats_url("B"), "attacker", ME, cluster.secrets)
        try:
            fake = InstanceInfo("prefill-9", "prefill", "A", kv_host="203.0.113.9", kv_port=9)
            readdressed = InstanceInfo("rld-0", "rld", "A", kv_host="203.0.113.9", kv_port=9)
            for info in (fake, readdressed):
                with pytest.raises(BusTimeout):
                    await bus.request(subjects.heartbeat(ME), Heartbeat(info), HeartbeatReply, 2.0)
            await bus.publish(subjects.leave(ME), Leave("rld-0"))
        finally:
            await bus.close()

    asyncio.run(attack())
    until(lambda: log.read_text().count("refused") >= refusals + 3, 30, "the registrar's three refusals")
    status = _status(operator)
    ids = {i.id for i in status.instances}
    assert "prefill-9" not in ids and "rld-0" in ids, ids
    after = next(i for i in status.instances if i.id == "rld-0")
    assert (after.kv_host, after.kv_port) == (rld.kv_host, rld.kv_port)


def test_it_cannot_move_the_bandwidth_estimate(cluster, operator):
    """Samples for requests whose KV does not cross to md-0 (none here: nothing is in flight)
    are refused; the estimate every plan reads stays where it was."""
    log = cluster.run_dir / "scheduler.log"
    refusals = log.read_text().count("WAN sample from md-0")
    before = _status(operator).wan_estimate_mbps

    async def attack() -> None:
        bus = await Bus.connect(cluster.nats_url("B"), "attacker", ME, cluster.secrets)
        try:
            for k in range(20):  # more than the estimator's window
                await bus.publish(subjects.wan_sample(ME), WanSample(1, 10.0, f"made-up-{k}"))
            await bus.nc.flush()
        finally:
            await bus.close()

    asyncio.run(attack())
    until(lambda: log.read_text().count("WAN sample from md-0") >= refusals + 20, 30, "20 refused samples")
    assert _status(operator).wan_estimate_mbps == before


def test_it_cannot_publish_into_a_stream_it_was_not_given(cluster, model_id, reference, smol_tokenizer):
    """While a request streams, md-0's credential floods its stream's subject (and the subject
    under guessed keys) with chunks that claim to be md-0's and rld-0's, every index, the last one
    final: the client still gets the model's answer. The gateway listens only under the key it
    minted for the attempt, which only the planned stages got with their tasks."""
    rid = f"victim-{uuid.uuid4().hex[:12]}"
    prompt = fresh_prompt(40, "forged")
    body = {"model": model_id, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    stop = threading.Event()

    async def flood() -> None:
        bus = await Bus.connect(cluster.nats_url("B"), "attacker", ME, cluster.secrets)
        try:
            while not stop.is_set():
                for who, role in (("md-0", "md"), ("rld-0", "rld"), ("prefill-0", "prefill")):
                    for index in range(24):
                        forged = TokenChunk(rid, index, [42], role=role, instance_id=who, finish_reason="length")
                        for key in ("", "guess", "0" * 22):
                            await bus.publish(subjects.tokens(rid, key), forged)
                await bus.nc.flush()
                await asyncio.sleep(0.01)
        finally:
            await bus.close()

    flooder = threading.Thread(target=lambda: asyncio.run(flood()))
    flooder.start()
    try:
        text, _, _ = stream_completion(cluster.url + "/v1/completions", body, headers={"X-Request-Id": rid})
    finally:
        stop.set()
        flooder.join()
    assert text == reference(smol_tokenizer(prompt)["input_ids"], 24, ignore_eos=True, draft=text)
