"""Control: validation in process (a bad control names its bad value and applies nothing),
control over a real nats-server with the cluster's credentials, and the
`python -m services.wanlink` process run from a cluster config."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import ssl
import sys
from pathlib import Path

import nats
import nats.errors
import pytest
import yaml

from pdd.servers import free_port
from shared import subjects
from shared.bus import Bus
from shared.messages import WanControl, WanState
from tests.wanlink.conftest import Sink, cluster, dial, read_n, until

REPO = Path(__file__).resolve().parents[2]

BAD = [
    (WanControl(bandwidth_mbps=0), "bandwidth_mbps"),
    (WanControl(bandwidth_mbps=math.nan), "bandwidth_mbps"),
    (WanControl(bandwidth_mbps="fast"), "bandwidth_mbps"),
    (WanControl(bandwidth_mbps=5, delay_ms=-1), "delay_ms"),  # the good half is not applied either
    (WanControl(jitter_ms=math.inf), "jitter_ms"),
    (WanControl(stall_s=-2, down=True), "stall_s"),
    (WanControl(direction="up", down=True, drop=True), "direction"),
    (WanControl(forward="nope", down=True, drop=True), "nope"),
    (WanControl(forward="ab", bandwidth_mbps=5, drop=True), "not to one forward"),
    (WanControl(capture=True, down=True), "capture_dir"),  # nowhere to record to
]


@pytest.mark.parametrize("bad, named", BAD, ids=[n for _, n in BAD])
async def test_a_bad_control_names_the_bad_value_and_changes_nothing(make_link, bad, named):
    sink = await Sink(echo=True).start()
    link = await make_link({"ab": ("A", sink.port)}, delay_ms=3.0, reverse={"bandwidth_mbps": 100.0})
    reader, writer = await dial(link, "ab")
    await until(lambda: link.control(WanControl()).connections == {"ab": 1}, what="the connection")
    before = link.control(WanControl())
    after = link.control(bad)
    assert named in after.error
    assert after.lines == before.lines and after.connections == {"ab": 1}
    writer.write(b"alive")  # not down, not stalled, not dropped
    assert await read_n(reader, 5) == b"alive"
    writer.close()
    sink.close()


async def test_a_control_changes_only_its_direction(make_link):
    link = await make_link({}, bandwidth_mbps=100.0)
    lines = link.control(WanControl(direction="a-b", delay_ms=7.0, jitter_ms=1.0)).lines
    assert (lines["a-b"].delay_ms, lines["a-b"].jitter_ms) == (7.0, 1.0)
    assert (lines["b-a"].delay_ms, lines["b-a"].jitter_ms) == (0.0, 0.0)
    lines = link.control(WanControl(bandwidth_mbps=50.0)).lines
    assert lines["a-b"].bandwidth_mbps == lines["b-a"].bandwidth_mbps == 50.0


async def test_control_over_nats_with_credentials(make_link, secrets, nats_a):
    url, _ = nats_a
    with pytest.raises(nats.errors.Error, match="Authorization"):  # the server takes no one without credentials
        await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2)
    bus = await Bus.connect(url, "wanlink-test", user="wanlink", secrets=secrets)
    operator = await Bus.connect(url, "operator-test", user="operator", secrets=secrets)
    sink = await Sink(echo=True).start()
    link = await make_link({"md-0": ("A", sink.port)}, bus=bus, name="nats-test")
    subject = subjects.wan_control("nats-test")
    state = await operator.request(subject, WanControl(direction="b-a", bandwidth_mbps=3.0), WanState, 5.0)
    assert not state.error and state.forwards == link.ports
    assert (state.lines["a-b"].bandwidth_mbps, state.lines["b-a"].bandwidth_mbps) == (1000.0, 3.0)
    state = await operator.request(subject, WanControl(delay_ms=math.nan, bandwidth_mbps=9.0), WanState, 5.0)
    assert "delay_ms" in state.error and state.lines["b-a"].bandwidth_mbps == 3.0
    reader, writer = await dial(link, "md-0")
    writer.write(b"x" * 1000)
    await read_n(reader, 1000)
    state = await operator.request(subject, WanControl(), WanState, 5.0)
    assert state.lines["a-b"].bytes_by_forward == state.lines["b-a"].bytes_by_forward == {"md-0": 1000}
    assert (state.connections, state.accepted) == ({"md-0": 1}, {"md-0": 1})
    writer.close()
    await link.stop()
    await bus.close()
    await operator.close()
    sink.close()


async def test_the_process_runs_a_cluster_configs_forwards(secrets, nats_a, tmp_path):
    url, leaf_port = nats_a
    sink = await Sink(echo=True).start()
    ports = {"md-0": free_port(), "nats-B": free_port()}
    dcs = {"A": {"nats_url": url, "leaf_port": leaf_port}, "B": {"leaf_remote": f"127.0.0.1:{ports['nats-B']}"}}
    raw = cluster(secrets_dir=str(secrets.directory), datacenters=dcs, wan={"name": "proc", "ports": ports})
    raw["instances"][1]["kv_port"] = sink.port
    (tmp_path / "cluster.yaml").write_text(yaml.safe_dump(raw))
    ready = tmp_path / "ready.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDD_")}
    with open(tmp_path / "wanlink.log", "wb") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "services.wanlink",
            "--config",
            str(tmp_path / "cluster.yaml"),
            "--ready-file",
            str(ready),
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=log,
        )
    try:
        await until(lambda: ready.exists() or proc.returncode is not None, 30, "the ready file")
        assert proc.returncode is None, (tmp_path / "wanlink.log").read_text()
        assert json.loads(ready.read_text()) == ports
        reader, writer = await asyncio.open_connection("127.0.0.1", ports["md-0"])  # prefill -> md-0's KV port
        writer.write(b"kv bytes")
        assert await read_n(reader, 8) == b"kv bytes"
        # B's NATS server joining A's leaf port through the line: a TLS handshake with B's certificate
        ctx = ssl.create_default_context(cafile=str(secrets.ca))
        ctx.load_cert_chain(*map(str, secrets.cert("nats", "B")))
        _, leaf = await asyncio.wait_for(
            asyncio.open_connection("127.0.0.1", ports["nats-B"], ssl=ctx, server_hostname="127.0.0.1"), 10
        )
        operator = await Bus.connect(url, "operator-test", user="operator", secrets=secrets)
        state = await operator.request(subjects.wan_control("proc"), WanControl(), WanState, 5.0)
        await operator.close()
        assert state.forwards == ports and state.accepted == {"md-0": 1, "nats-B": 1}
        assert state.lines["a-b"].bytes_by_forward["md-0"] == state.lines["b-a"].bytes_by_forward["md-0"] == 8
        assert state.lines["b-a"].bytes_by_forward["nats-B"] > 0  # B dials: its ClientHello went b-a
        writer.close()
        leaf.close()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        sink.close()
