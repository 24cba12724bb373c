"""Factories for the WAN link tests: an upstream server in "datacenter B" that records what
arrives, a client in "A" that opens a connection through the link, and a link factory."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from redis.asyncio import Redis

from services.wanlink import WanLink
from shared.bus import Bus
from shared.config import WanConfig
from shared.kv_transport import Frame, packed


@dataclass
class Arrival:
    """What one upstream connection received."""

    data: bytearray = field(default_factory=bytearray)
    first_at: float = 0.0
    eof: asyncio.Event = field(default_factory=asyncio.Event)


class Upstream:
    """A TCP server in B that records each connection's bytes; with `echo` it sends them back."""

    def __init__(self, echo: bool = False) -> None:
        self.echo = echo
        self.arrivals: list[Arrival] = []
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()

    @property
    def received(self) -> int:
        return sum(len(a.data) for a in self.arrivals)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        arrival = Arrival()
        self.arrivals.append(arrival)
        try:
            while data := await reader.read(65536):
                if not arrival.data:
                    arrival.first_at = asyncio.get_running_loop().time()
                arrival.data += data
                if self.echo:
                    writer.write(data)
                    await writer.drain()
        except ConnectionError:
            pass
        finally:
            arrival.eof.set()
            writer.close()

    async def wait_received(self, nbytes: int, timeout: float) -> None:
        async def poll() -> None:
            while self.received < nbytes:
                await asyncio.sleep(0.005)

        await asyncio.wait_for(poll(), timeout)


Client = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def open_via(link: WanLink, upstream: Upstream, request_id: str) -> Client:
    """A client in A: connect to the link and send the ROUTE frame to `upstream`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", link.port)
    writer.write(packed(Frame.ROUTE, {"host": "127.0.0.1", "port": upstream.port, "request_id": request_id}))
    return reader, writer


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream()
    await up.start()
    yield up
    await up.stop()


MakeLink = Callable[..., Awaitable[WanLink]]


@pytest.fixture
async def make_link() -> AsyncIterator[MakeLink]:
    """`await make_link(bandwidth_mbps=..., bus=..., redis=...)`: a started link, stopped after the test."""
    links: list[WanLink] = []

    async def make(bus: Bus | None = None, redis: Redis | None = None, **cfg: Any) -> WanLink:
        link = WanLink(WanConfig(**{"delay_ms": 0.0, **cfg}), bus, redis)
        await link.start()
        links.append(link)
        return link

    yield make
    for link in links:
        await link.stop()
