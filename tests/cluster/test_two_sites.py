"""Two real datacenters on one host, against the running processes of the default topology.

- Each site has its own NATS server; site B's joins A's through the emulated line, and every
  TCP connection between two processes stays inside one site or ends at the line.
- What crosses the line is encrypted: a prompt's marker, its request id and its token ids are
  nowhere in the bytes the line carried (its capture, like tcpdump on the line).
- The doors that face the WAN refuse plaintext; NATS refuses a client without credentials, and
  main-decode's credentials cannot submit requests.
- The line's delay is paid both ways; with the line down datacenter A serves alone and nothing
  fails; when it is back, main-decode serves again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import ssl
import time
from pathlib import Path

import msgpack
import nats
import psutil
import pytest

from shared.bus import Bus
from tests.cluster.conftest import completion, fresh_prompt, stream_completion
from tests.cluster.test_migration import until

pytestmark = pytest.mark.slow


def _site_of(cluster) -> dict[int, str]:
    """pid -> site ("line" for the emulator) of every process of the cluster."""
    sites = {proc.pid: cluster.specs[name].dc or "line" for name, proc in cluster.procs.items()}
    for name, server in cluster.servers.items():
        sites[server.proc.pid] = "A" if name in ("nats-A", "redis") else name.split("-")[1]
    return sites


def test_each_site_has_its_own_nats_server_and_connections_stay_inside_a_site(cluster, operator):
    assert {"nats-A", "nats-B", "redis"} <= set(cluster.servers)
    assert operator.wan().connections.get("nats-B") == 1  # the NATS link crosses the line
    sites = _site_of(cluster)
    owner = {}  # (ip, port) -> pid, for every TCP socket of the cluster's processes
    conns = [c for c in psutil.net_connections(kind="tcp") if c.pid in sites and c.raddr]
    for c in psutil.net_connections(kind="tcp"):
        if c.pid in sites:
            owner[(c.laddr.ip, c.laddr.port)] = c.pid
    crossing = []
    for c in conns:
        peer = owner.get((c.raddr.ip, c.raddr.port))
        if peer is None:
            continue  # a client outside the cluster (this test)
        here, there = sites[c.pid], sites[peer]
        if "line" not in (here, there) and here != there:
            crossing.append((c.pid, here, c.raddr.port, there))
    assert conns and crossing == []


def test_nothing_crosses_the_line_in_the_clear(cluster, operator, model_id):
    marker = f"MARKER-{fresh_prompt(0, 'x').strip('[] ')}-zebra"
    prompt = f"{marker} " + fresh_prompt(30, "clear")
    capture = cluster.cfg.wan.capture_dir
    operator.wan(capture=True)
    try:
        out = completion(
            cluster.url,
            {
                "model": model_id,
                "prompt": prompt,
                # long enough that main-decode takes over whatever the machine: the prompt's KV
                # (~2 MB) lands in a few hundred ms, 200 relay tokens take seconds (with 8, a fast
                # machine's relay finished first and no KV was reported crossing)
                "max_tokens": 200,
                "ignore_eos": True,
                "temperature": 0,
                "pdd": {"pipeline": "p-rld-md", "handoff": "catchup"},
            },
        )
    finally:
        operator.wan(capture=False)
    carried = b"".join(p.read_bytes() for p in Path(capture).glob("*.bin"))
    ids = cluster_tokenizer(cluster).encode(prompt)
    assert len(carried) > out["pdd"]["wan_kv_bytes"] > 0  # the KV (and the control traffic) did cross
    assert out["pdd"]["tokens_by_role"]["md"] > 0  # handed over: the relay's token ids crossed too
    for secret in (
        marker.encode(),
        out["id"].encode(),
        msgpack.packb(ids[:6])[1:],
        " ".join(map(str, ids[:6])).encode(),
    ):
        assert secret not in carried, secret


def cluster_tokenizer(cluster):
    from services.gateway.tokenizer import TextTokenizer
    from shared.model_info import load_model_info

    return TextTokenizer(load_model_info(cluster.cfg.model).path)


def _refuses_plaintext(port: int) -> bool:
    """A plaintext peer gets nothing back but a closed (or reset) connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"CONNECT {}\r\nPING\r\n" + b"\x00" * 64)
        try:
            return s.recv(4096) == b""
        except (ConnectionResetError, TimeoutError, OSError):
            return True


def _refuses_tls_without_a_certificate(cluster, port: int) -> bool:
    """TLS with the cluster's CA but no client certificate: an alert, or a closed connection
    (TLS 1.3 lets the client finish its side before the server says no)."""
    ctx = ssl.create_default_context(cafile=str(cluster.secrets.ca))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            with ctx.wrap_socket(raw, server_hostname="md-0") as tls:
                tls.sendall(b"\x00\x00\x00\x05\x02junk")
                return tls.recv(10) == b""
    except (ssl.SSLError, ConnectionResetError, OSError):
        return True


def test_plaintext_and_anonymous_peers_are_refused(cluster):
    md_kv = cluster.cfg.instance("md-0").kv_port
    assert _refuses_plaintext(md_kv)  # main-decode's KV port: mutual TLS only
    assert _refuses_plaintext(cluster.cfg.wan.ports["md-0"])  # the same through the line
    assert _refuses_plaintext(cluster.cfg.datacenter("A").leaf_port)  # the NATS link port: TLS first
    assert _refuses_tls_without_a_certificate(cluster, md_kv)

    async def nats_checks() -> None:
        with pytest.raises(Exception, match="Authorization"):
            await nats.connect(cluster.nats_url("A"), allow_reconnect=False, max_reconnect_attempts=0)
        md = await Bus.connect(cluster.nats_url("B"), "pretend-md", "md-0", cluster.secrets)  # md-0's own user
        await md.nc.publish("pdd.scheduler.submit", b"forged")
        await md.nc.flush()
        for _ in range(100):  # the server answers the publish with -ERR
            if md.nc.last_error is not None:
                break
            await asyncio.sleep(0.05)
        error = str(md.nc.last_error)
        await md.close()
        assert "permissions violation" in error.lower() and "pdd.scheduler.submit" in error, error

    asyncio.run(nats_checks())


def test_the_lines_delay_is_paid_both_ways(cluster, operator, model_id, reference, smol_tokenizer):
    body = {"model": model_id, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "pdd": {"pipeline": "p-md"}}
    e2e, runs = {}, {}
    try:
        for delay in (0.0, 200.0):
            operator.wan(delay_ms=delay, jitter_ms=0.0)
            prompt = fresh_prompt(20, f"delay{delay:.0f}")
            text, pdd, _ = stream_completion(cluster.url + "/v1/completions", {**body, "prompt": prompt})
            assert text == reference(smol_tokenizer(prompt)["input_ids"], 8, ignore_eos=True, draft=text)
            e2e[delay], runs[delay] = pdd["timings_ms"]["e2e"], pdd["timings_ms"]
    finally:
        operator.wan(delay_ms=cluster.cfg.wan.delay_ms, jitter_ms=cluster.cfg.wan.jitter_ms)
    t = runs[200.0]
    print(
        f"\np-md, 8 tokens: E2E {e2e[0.0]:.0f} ms with no delay, {e2e[200.0]:.0f} ms with 200 ms one way; "
        f"there, queue {t['queue']:.0f} ms, prefill {t['prefill']:.0f} ms, TTFT {t['ttft']:.0f} ms"
    )
    # the delayed request against its own timings (a hiccup in the other would move a comparison):
    # the plan came back once main-decode's task had crossed to B and its ack back to A (prefill ran
    # meanwhile), and main-decode's tokens came after the KV crossed to B and each token came back
    assert t["queue"] >= 380, t
    assert t["e2e"] >= t["prefill"] + 380, t


class _Timed(list):
    """Stream events with the time each arrived."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def append(self, event: dict) -> None:
        super().append(event)
        self.times.append(time.monotonic())


def _auto(url: str, i: int) -> dict:
    """One request; `first_text_at`: when its first text reached the client (after its plan)."""
    body = {"prompt": fresh_prompt(12, f"steady{i}"), "max_tokens": 6, "temperature": 0}
    sent, events = time.monotonic(), _Timed()
    text, pdd, _ = stream_completion(url + "/v1/completions", body, timeout=120, events=events)
    first = next(t for e, t in zip(events, events.times) if e["choices"] and e["choices"][0].get("text"))
    return {"i": i, "pdd": pdd, "text": text, "sent": sent, "first_text_at": first}


def test_with_the_line_down_site_a_serves_alone_and_main_decode_returns(cluster, operator):
    """A steady stream of requests; the line goes down for 11 s and comes back. None fails;
    during the outage new requests finish in datacenter A (the relay); after it, main-decode
    serves again within two heartbeat TTLs."""
    ttl = cluster.cfg.heartbeat_ttl_s
    results, down_at, up_at = [], 0.0, 0.0
    # the probe for main-decode's return starts beside the load once the line is up: it must not
    # wait for the load's last requests to finish (seconds, on a slow machine)
    with concurrent.futures.ThreadPoolExecutor(8) as pool, concurrent.futures.ThreadPoolExecutor(1) as probe:
        futures, probed = [], None
        t0 = time.monotonic()
        while time.monotonic() - t0 < 17:
            elapsed = time.monotonic() - t0
            if not down_at and elapsed > 3:
                operator.wan(down=True)
                down_at = time.monotonic()
            if down_at and not up_at and elapsed > 14:
                operator.wan(down=False)
                up_at = time.monotonic()
                probed = probe.submit(_until_md_serves, cluster, up_at + 2 * ttl + 5)
            futures.append(pool.submit(_auto, cluster.url, len(futures)))
            time.sleep(0.5)
        results = [f.result() for f in futures]  # stream_completion raises on any failure
        # the first request sent after the line was up that main-decode served: the load's, every
        # 0.5 s for 3 s, or the probe's (one at a time, each slow under the load)
        served = [r["sent"] for r in results if r["sent"] > up_at and r["pdd"]["instances"]["md"]]
        served += [t for t in [probed.result()] if t is not None]
    assert served, "main-decode did not serve again"
    back = min(served)
    # sent once main-decode's heartbeats had expired, and planned while the line was still down: a
    # request's first text comes after its plan, so one that came before the line was up was planned
    # without main-decode (a request sent just before the line came up may be planned after it on a
    # loaded machine: its scheduler lagged 1.5 s in one full run)
    during = [r for r in results if r["sent"] > down_at + ttl + 2 and r["first_text_at"] < up_at]
    assert during and all(r["pdd"]["instances"]["md"] == "" for r in during), [r["pdd"]["plan_reason"] for r in during]
    print(
        f"\n{len(results)} requests, none failed; {len(during)} served in A alone; "
        f"main-decode back {back - up_at:.1f} s after the line"
    )
    assert back - up_at <= 2 * ttl + 2  # within two heartbeat TTLs (and a heartbeat's reach)
    assert all(s.requests == [] for s in operator.idle().values())


@pytest.mark.parametrize("direction", ["a-b", "b-a"])
def test_a_line_down_one_way_is_seen_from_both_sides(cluster, operator, direction):
    """Down towards B: main-decode's heartbeats still reach the registrar, its replies do not; it
    says so (replies missed) and is not refreshed. Down towards A: its heartbeats stop coming.
    Either way it drops out within two heartbeat TTLs, a request is served in A alone, and
    main-decode registers again once the line is back."""
    ttl = cluster.cfg.heartbeat_ttl_s
    r = operator.redis()
    try:
        until(lambda: r.exists("pdd:instance:md-0"), 2 * ttl + 10, "md-0 to be registered")
        operator.wan(down=True, direction=direction)
        cut = time.monotonic()
        until(lambda: not r.exists("pdd:instance:md-0"), 2 * ttl + 5, f"md-0 to drop out ({direction} down)")
        gone = time.monotonic() - cut
        out = completion(cluster.url, {"prompt": fresh_prompt(8, "one-way"), "max_tokens": 4, "temperature": 0})
        assert out["pdd"]["instances"]["md"] == "" and out["pdd"]["instances"]["rld"], out["pdd"]["instances"]
    finally:
        operator.wan(down=False, direction=direction)
    try:
        back = time.monotonic()
        until(lambda: r.exists("pdd:instance:md-0"), 60, "md-0 to register again")
        back = time.monotonic() - back
    finally:
        r.close()
    print(f"\n{direction} down: md-0 out after {gone:.1f} s (TTL {ttl:g} s), back {back:.1f} s after the line")
    assert gone <= 2 * ttl + 1


def _until_md_serves(cluster, deadline: float) -> float | None:
    """When a request with nothing forced was first planned onto main-decode again (None: not by
    `deadline`)."""
    while time.monotonic() < deadline:
        sent = time.monotonic()
        out = completion(cluster.url, {"prompt": fresh_prompt(8, "back"), "max_tokens": 2, "temperature": 0})
        if out["pdd"]["instances"]["md"]:
            return sent
        time.sleep(0.2)
    return None
