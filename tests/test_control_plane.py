"""The replicated control plane's parts, each alone: the `control_plane` settings, the ports and
URLs the launcher resolves for configs/ha.yaml, each clustered NATS server's config, `pdd up`'s
supervisor, `pdd status`'s process rows, and a real Redis failing over to its replica under
Sentinel with the registry's client following it (tests/cluster/test_ha.py runs them together)."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path

import pytest

from pdd.launcher import supervise
from pdd.natsconf import server_conf
from pdd.servers import EmbeddedServer, free_port
from pdd.topology import plan_processes, resolve
from shared.config import ConfigError, load_config
from shared.messages import ClusterStatus, ControlProcess, InstanceInfo
from shared.registry import Registry, connect
from shared.security import Secrets
from shared.status import status_view

HA = Path(__file__).resolve().parents[1] / "configs" / "ha.yaml"


@pytest.fixture(scope="module")
def ha(tmp_path_factory):
    return resolve(load_config(HA), tmp_path_factory.mktemp("ha"))


@pytest.mark.parametrize(
    "bad, says",
    [
        ({"gateways": 0}, "control_plane.gateways must be >= 1"),
        ({"redis_replicas": 1}, "need sentinels"),
        ({"nats_servers": 0}, "control_plane.nats_servers"),
    ],
)
def test_a_control_plane_that_cannot_work_is_refused(bad, says):
    with pytest.raises(ConfigError, match=says):
        load_config(None, control_plane=bad)


def test_the_launcher_plans_each_gateway_and_scheduler_by_name(ha):
    specs = {s.name: s for s in plan_processes(ha, "c.yaml")}
    assert {"gateway-0", "gateway-1", "scheduler-0", "scheduler-1"} <= set(specs)
    assert specs["gateway-1"].argv[-2:] == ("--instance", "gateway-1")
    single = {s.name for s in plan_processes(load_config(None), "c.yaml")}
    assert {"gateway", "scheduler"} <= single, "one of each keeps its plain name"


def test_every_member_gets_its_own_port_and_clients_every_server_of_their_site(ha):
    servers = [s for dc in ha.datacenters for s in ha.nats_servers(dc.name)]
    named = {"gateway-0": ha.port, "redis": ha.redis_port, **ha.control_plane.ports}
    named |= {s.name: s.port for s in servers} | {f"{s.name}-route": s.route_port for s in servers}
    named |= {f"{s.name}-leaf": s.leaf_port for s in servers if s.leaf_port}
    assert len(named) == 2 + 2 + 3 * 2 * 2 + 3 + 1 + 3, sorted(named)  # gateways, schedulers' metrics...
    assert len(set(named.values())) == len(named) and all(named.values())
    assert len(ha.datacenter("A").nats_url.split(",")) == 3
    assert len(ha.redis_sentinels.split(",")) == 3
    assert ha.gateway_port("gateway-1") not in (0, ha.port)


def test_b_joins_any_of_as_servers_through_the_line(ha):
    forwards = {name: end for name, dialer, end in ha.wan_forwards() if dialer == "B"}
    leaf_ports = [s.leaf_port for s in ha.nats_servers("A")]
    assert {name: port for name, (_, port) in forwards.items()} == dict(
        zip(["nats-B", "nats-B-1", "nats-B-2"], leaf_ports)
    )
    remotes = ha.datacenter("B").leaf_remote.split(",")
    assert [int(r.rsplit(":", 1)[1]) for r in remotes] == [ha.wan.ports[n] for n in ("nats-B", "nats-B-1", "nats-B-2")]


def test_each_nats_server_routes_to_the_others_of_its_site(ha):
    secrets = Secrets.of(ha)
    servers = ha.nats_servers("A")
    confs = [json.loads(server_conf(ha, ha.datacenter("A"), secrets, server=s)) for s in servers]
    for me, conf in zip(servers, confs):
        routes = {int(r.rsplit(":", 1)[1]) for r in conf["cluster"]["routes"]}
        assert routes == {s.route_port for s in servers} - {me.route_port}
        assert conf["cluster"]["tls"]["verify"] and conf["cluster"]["authorization"]["user"] == "route"
        assert conf["leafnodes"]["listen"].endswith(f":{me.leaf_port}")
    b = json.loads(server_conf(ha, ha.datacenter("B"), secrets, server=ha.nats_servers("B")[1]))
    assert len(b["leafnodes"]["remotes"][0]["urls"]) == 3 and "leafnodes" in b and "listen" not in b["leafnodes"]


def test_status_lists_every_process_with_its_state():
    cfg = load_config(None, control_plane={"gateways": 2, "schedulers": 2, "ports": {"gateway-1": 8001}})
    status = ClusterStatus(
        instances=[InstanceInfo("prefill-0", "prefill", "A", pid=41)],
        control=[
            ControlProcess("gateway", "gateway-1", "A", 7, url="http://x:8001"),
            ControlProcess("scheduler", "scheduler-0", "A", 9, planned=3, last_request="cmpl-1"),
        ],
        scheduler="scheduler-0",
    )
    rows = {r["id"]: r for r in status_view(cfg, status, None, [{"role": "nats", "id": "nats-A"}])["processes"]}
    assert rows["prefill-0"] == {"role": "prefill", "id": "prefill-0", "dc": "A", "pid": 41, "state": "up"}
    assert rows["md-0"]["state"] == "missing"
    assert rows["gateway-0"]["state"] == "missing" and rows["gateway-0"]["url"].endswith(":8000")
    assert rows["gateway-1"]["url"] == "http://x:8001" and rows["gateway-1"]["pid"] == 7
    assert rows["scheduler-0"]["planned"] == 3 and rows["scheduler-0"]["last_request"] == "cmpl-1"
    assert rows["scheduler-1"]["state"] == "missing" and "nats-A" in rows


class _Exited:
    def __init__(self, code: int | None) -> None:
        self.returncode = code

    def poll(self) -> int | None:
        return self.returncode


class _Cluster:
    """What `supervise` uses of a Cluster: processes that may have exited, and a way to start one."""

    def __init__(self, exits: int) -> None:
        self.procs = {"scheduler-0": _Exited(None)}
        self.servers: dict = {}
        self.exits, self.started = exits, []

    def start_process(self, name: str) -> None:
        self.started.append(name)
        self.procs[name] = _Exited(-9 if len(self.started) < self.exits else None)


def test_pdd_up_restarts_what_exits_and_stops_on_a_crash_loop():
    import threading

    stop = threading.Event()
    calm = _Cluster(exits=2)
    calm.procs["scheduler-0"] = _Exited(-9)
    restarts = []
    runner = threading.Thread(target=supervise, args=(calm, stop, lambda: restarts.append(1)))
    runner.start()
    deadline = time.monotonic() + 10
    while len(calm.started) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    runner.join(5)
    assert calm.started == ["scheduler-0", "scheduler-0"] and len(restarts) == 2
    looping = _Cluster(exits=100)
    looping.procs["scheduler-0"] = _Exited(1)
    stop = threading.Event()
    supervise(looping, stop, lambda: None, most=3, per_s=60)  # returns by itself
    assert stop.is_set() and len(looping.started) == 3


@pytest.mark.slow
async def test_the_registry_follows_a_redis_failover_and_keeps_a_recorded_request(tmp_path):
    """A real primary, a replica and a Sentinel: the primary dies after a request was recorded
    (which waits for the replica's copy), the Sentinel promotes the replica, and the registry's
    client, which asks the Sentinel where the primary is, reads the record and writes again."""
    primary_port, replica_port, sentinel_port = free_port(), free_port(), free_port()
    primary = EmbeddedServer.redis(primary_port, "pw", tmp_path).start()
    replica = EmbeddedServer.redis(replica_port, "pw", tmp_path, "redis-1", replica_of=primary_port).start()
    sentinel = EmbeddedServer.sentinel("sentinel-0", sentinel_port, "pdd", primary_port, 1, 500, "pw", tmp_path)
    sentinel.start()
    registry = Registry(connect("", "pw", f"127.0.0.1:{sentinel_port}", "pdd"), ttl_s=60, replicas=1)
    try:
        await _until(lambda: registry.r.execute_command("WAIT", 1, 100), "the replica to catch up")
        await registry.set_request("cmpl-1", {"pipeline": "p-md"}, ttl_s=60)
        primary.proc.send_signal(signal.SIGKILL)
        primary.proc.wait(5)
        await registry.heartbeat(InstanceInfo("md-0", "md", "B"))  # retried until the replica is promoted
        assert await registry.request_ids() == ["cmpl-1"], "the record survived the failover"
        assert [i.id for i in await registry.alive()] == ["md-0"]
    finally:
        await registry.r.aclose()
        for server in (sentinel, replica, primary):
            server.close()


async def _until(ask, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await ask():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)
