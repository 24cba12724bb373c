"""Real sockets around the WAN link: upstream servers that record (and echo, or greet) what
arrives, clients that dial a forward, a tap that records the bytes a line carried, and a
factory for started links. Times are the event loop's clock."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from pdd.certs import make_secrets
from pdd.natsconf import server_conf
from pdd.servers import EmbeddedServer, free_port
from services.wanlink import Forward, WanLink
from shared.bus import Bus
from shared.config import WanConfig, config_from_dict
from shared.security import Secrets
from tests.helpers import until

Side = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def now() -> float:
    return asyncio.get_running_loop().time()


@dataclass
class Arrival:
    """One connection an upstream accepted: its bytes and when they came."""

    writer: asyncio.StreamWriter
    data: bytearray = field(default_factory=bytearray)
    first_at: float = 0.0
    last_at: float = 0.0
    error: str = ""  # the exception that ended it, "" for EOF
    ended: bool = False

    async def wait(self, nbytes: int, timeout: float = 10.0) -> float:
        """Until `nbytes` have arrived; returns when the last of them came."""
        await until(lambda: len(self.data) >= nbytes, timeout, f"{nbytes} bytes (have {len(self.data)})")
        return self.last_at


class Sink:
    """A TCP server on the far side: records each connection; `echo` sends its bytes back,
    `greet` is sent to each connection as soon as it is accepted."""

    def __init__(self, echo: bool = False, greet: bytes = b"") -> None:
        self.echo, self.greet = echo, greet
        self.arrivals: list[Arrival] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> Sink:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    async def arrival(self, i: int = 0, timeout: float = 10.0) -> Arrival:
        await until(lambda: len(self.arrivals) > i, timeout, f"connection {i} to reach the sink")
        return self.arrivals[i]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        arrival = Arrival(writer)
        self.arrivals.append(arrival)
        try:
            if self.greet:
                writer.write(self.greet)
            while data := await reader.read(1 << 16):
                arrival.last_at = now()
                arrival.first_at = arrival.first_at or arrival.last_at
                arrival.data += data
                if self.echo:
                    writer.write(data)
                    await writer.drain()
        except OSError as e:
            arrival.error = type(e).__name__
        finally:
            arrival.ended = True
            writer.close()


async def read_n(reader: asyncio.StreamReader, n: int, timeout: float = 10.0) -> bytes:
    return await asyncio.wait_for(reader.readexactly(n), timeout)


async def dial(link: WanLink, forward: str) -> Side:
    return await asyncio.open_connection("127.0.0.1", link.ports[forward])


class Tap:
    """A relay between the line and an upstream that keeps every byte the line carried each way."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.to_upstream, self.from_upstream = bytearray(), bytearray()
        self.port = 0

    async def start(self) -> Tap:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, log: bytearray) -> None:
            try:
                while data := await src.read(1 << 16):
                    log += data
                    dst.write(data)
                    await dst.drain()
                dst.write_eof()
            except OSError:
                dst.transport.abort()

        await asyncio.gather(pipe(reader, up_w, self.to_upstream), pipe(up_r, writer, self.from_upstream))
        writer.close()
        up_w.close()


MakeLink = Callable[..., Awaitable[WanLink]]


@pytest.fixture
async def make_link() -> AsyncIterator[MakeLink]:
    """`await make_link({"ab": ("A", port), ...}, bus=None, **wan)`: a started link (no delay,
    no jitter unless given), stopped after the test."""
    links: list[WanLink] = []

    async def make(forwards: dict[str, tuple[str, int]], bus: Bus | None = None, **wan: Any) -> WanLink:
        cfg = WanConfig(**{"delay_ms": 0.0, "jitter_ms": 0.0, **wan})
        fwds = [Forward(name, dialer, ("127.0.0.1", port)) for name, (dialer, port) in forwards.items()]
        link = WanLink(cfg, fwds, bus)
        await link.start()
        links.append(link)
        return link

    yield make
    for link in links:
        await link.stop()


@dataclass
class Trio:
    """Three forwards: `ab` and `ab2` dialed from A (their requests go a-b), `ba` dialed from B."""

    link: WanLink
    sinks: dict[str, Sink]


@pytest.fixture
async def trio(make_link) -> AsyncIterator[Callable[..., Awaitable[Trio]]]:
    sinks: list[Sink] = []

    async def make(echo: bool = True, **wan: Any) -> Trio:
        named = {name: await Sink(echo=echo).start() for name in ("ab", "ab2", "ba")}
        sinks.extend(named.values())
        dialers = {"ab": "A", "ab2": "A", "ba": "B"}
        link = await make_link({n: (dialers[n], s.port) for n, s in named.items()}, **wan)
        return Trio(link, named)

    yield make
    for sink in sinks:
        sink.close()


def cluster(**extra: Any) -> dict[str, Any]:
    """A cluster config (as YAML data): prefill-0 in A, md-0 in B."""
    return {
        "instances": [{"id": "prefill-0", "role": "prefill", "dc": "A"}, {"id": "md-0", "role": "md", "dc": "B"}],
        **extra,
    }


@pytest.fixture(scope="session")
def secrets(tmp_path_factory) -> Secrets:
    """The cluster's CA, instance certificates and NATS credentials (pdd certs)."""
    return Secrets(make_secrets(config_from_dict(cluster()), tmp_path_factory.mktemp("wan") / "secrets"))


@pytest.fixture(scope="module")
def nats_a(secrets, tmp_path_factory) -> Iterator[tuple[str, int]]:
    """Datacenter A's nats-server, configured as the launcher does: users per role, TLS leaf port.
    Yields its client URL and its leaf port."""
    run = tmp_path_factory.mktemp("nats")
    dcs = {"A": {"nats_port": free_port(), "leaf_port": free_port()}, "B": {}}
    cfg = config_from_dict(cluster(secrets_dir=str(secrets.directory), datacenters=dcs))
    conf = run / "nats-A.conf"
    conf.write_text(server_conf(cfg, cfg.datacenter("A"), secrets))
    server = EmbeddedServer.nats("nats-A", conf, dcs["A"]["nats_port"], run).start()
    yield f"nats://127.0.0.1:{dcs['A']['nats_port']}", dcs["A"]["leaf_port"]
    server.close()
