"""Faults and plumbing on real sockets: stall and down/up per direction and per forward, drop
all or one forward, no open relay, a reset for an unreachable upstream, exact byte counts."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from pdd.servers import free_port
from shared.messages import WanControl
from tests.wanlink.conftest import Sink, dial, now, read_n, until

# (control target, the forwards whose dialer -> upstream bytes it holds)
TARGETS = [({"direction": "a-b"}, {"ab", "ab2"}), ({"direction": "b-a"}, {"ba"}), ({"forward": "ab"}, {"ab"})]
IDS = ["a-b", "b-a", "forward"]


async def open_all(t) -> dict:
    """A connection on every forward, each of which has carried b"1" to its upstream."""
    conns = {}
    for name in t.sinks:
        reader, writer = await dial(t.link, name)
        writer.write(b"1")
        conns[name] = (reader, writer, await t.sinks[name].arrival())
    for _, _, arrival in conns.values():
        await arrival.wait(1)
    return conns


def close_all(conns: dict) -> None:
    for _, writer, _ in conns.values():
        writer.close()


def check_line_flags(state, target: dict, flag: str) -> None:
    for direction, line in state.lines.items():
        assert getattr(line, flag) == (target.get("direction") == direction), (direction, line)


@pytest.mark.parametrize("target, held", TARGETS, ids=IDS)
async def test_stall_holds_its_target_for_the_time_given(trio, target, held):
    t = await trio(echo=False)
    conns = await open_all(t)
    stall_s = 0.5
    state = t.link.control(WanControl(stall_s=stall_s, **target))
    start = now()
    assert not state.error
    check_line_flags(state, target, "stalled")
    for _, writer, _ in conns.values():
        writer.write(b"2")
    for name in sorted(conns.keys() - held):  # the rest of the line carries on meanwhile
        assert await conns[name][2].wait(2) - start < stall_s
    for name in held:
        assert await conns[name][2].wait(2) - start >= 0.9 * stall_s
    assert all(arrival.data == b"12" for _, _, arrival in conns.values())
    assert not any(line.stalled for line in t.link.control(WanControl()).lines.values())
    close_all(conns)


@pytest.mark.parametrize("target, held", TARGETS, ids=IDS)
async def test_down_holds_its_target_until_up(trio, target, held):
    t = await trio(echo=False)
    conns = await open_all(t)
    state = t.link.control(WanControl(down=True, **target))
    check_line_flags(state, target, "down")
    for _, writer, _ in conns.values():
        writer.write(b"2")
    for name in conns.keys() - held:
        await conns[name][2].wait(2)
    await asyncio.sleep(0.3)  # an absence check, not a synchronisation: nothing may arrive while down
    assert all(conns[name][2].data == b"1" for name in held)
    state = t.link.control(WanControl(down=False, **target))
    assert not any(line.down for line in state.lines.values())
    for name in held:
        await conns[name][2].wait(2)
    assert all(arrival.data == b"12" for _, _, arrival in conns.values())
    close_all(conns)


@pytest.mark.parametrize(
    "target, dropped", [({}, {"ab", "ab2", "ba"}), ({"forward": "ab"}, {"ab"})], ids=["all", "one-forward"]
)
async def test_drop_resets_its_connections_and_spares_the_rest(trio, target, dropped):
    t = await trio(echo=True)
    conns = await open_all(t)
    for reader, _, _ in conns.values():
        assert await read_n(reader, 1) == b"1"
    assert t.link.control(WanControl()).connections == {"ab": 1, "ab2": 1, "ba": 1}
    assert not t.link.control(WanControl(drop=True, **target)).error
    for name in dropped:  # both ends are reset, not closed cleanly
        reader, _, arrival = conns[name]
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(reader.read(100), 5)
        await until(lambda a=arrival: a.ended, what=f"the upstream of {name} to see the reset")
        assert arrival.error == "ConnectionResetError"
    for name in conns.keys() - dropped:  # the other forwards' connections carry on
        reader, writer, _ = conns[name]
        writer.write(b"still here")
        assert await read_n(reader, 10) == b"still here"
    survivors = {name: 1 for name in conns.keys() - dropped}
    await until(lambda: t.link.control(WanControl()).connections == survivors, what="the dropped to be gone")
    reader, writer = await dial(t.link, "ab")  # a drop is not an outage: new connections go through
    writer.write(b"new")
    assert await read_n(reader, 3) == b"new"
    assert t.link.control(WanControl()).accepted == {"ab": 2, "ab2": 1, "ba": 1}


async def test_a_forward_reaches_only_its_upstream(make_link):
    mine, other = await Sink().start(), await Sink().start()
    link = await make_link({"mine": ("A", mine.port)})
    assert link.control(WanControl()).forwards == {"mine": link.ports["mine"]}
    # whatever the dialer asks for, in any protocol, is only bytes for the forward's own upstream
    ask = (
        f"CONNECT 127.0.0.1:{other.port} HTTP/1.1\r\nHost: 127.0.0.1:{other.port}\r\n\r\n".encode()
        + b'\x00\x00\x00\x20\x01{"host": "127.0.0.1", "port": %d}' % other.port
    )
    _, writer = await dial(link, "mine")
    writer.write(ask)
    writer.write_eof()
    arrival = await mine.arrival()
    await until(lambda: arrival.ended, what="the upstream to see the EOF")
    assert arrival.data == ask
    assert other.arrivals == []
    writer.close()
    mine.close()
    other.close()


async def test_an_unreachable_upstream_resets_the_dialer(make_link):
    link = await make_link({"dead": ("A", free_port())})
    reader, writer = await dial(link, "dead")
    writer.write(b"hello")
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(reader.read(100), 10)
    state = link.control(WanControl())
    assert state.accepted == {"dead": 1}
    assert not state.connections.get("dead")
    assert all(line.bytes == 0 for line in state.lines.values())


async def test_a_receiver_that_takes_nothing_has_its_connection_reset(make_link):
    """Its writes wait on a full socket: past `write_stall_s` both ends are reset, and the sender
    learns it, instead of the connection hanging for as long as the receiver does."""
    taken = asyncio.Event()

    async def never_read(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        taken.set()
        await asyncio.sleep(60)  # holds the socket open, reads nothing

    server = await asyncio.start_server(never_read, "127.0.0.1", 0)
    sock = server.sockets[0]
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # accepted sockets inherit it
    link = await make_link({"ab": ("A", sock.getsockname()[1])}, write_stall_s=0.5)
    reader, writer = await dial(link, "ab")
    await asyncio.wait_for(taken.wait(), 10)

    async def push() -> None:
        while True:  # far more than every buffer on the way holds
            writer.write(b"x" * 65536)
            await writer.drain()

    with pytest.raises(ConnectionError):
        await asyncio.wait_for(asyncio.gather(push(), reader.read()), 30)
    assert not link.control(WanControl()).connections.get("ab")
    writer.transport.abort()
    server.close()


async def test_bytes_are_counted_exactly_per_forward_and_direction(trio):
    t = await trio(echo=False)
    t.sinks["ab"].echo = True  # ab: its bytes come back b-a
    t.sinks["ab2"].greet = os.urandom(3000)  # the upstream speaks first (b-a)
    t.sinks["ba"].greet = os.urandom(5000)  # ba's upstream is in A: its bytes go a-b
    sizes = {"ab": 100_000, "ab2": 7_777, "ba": 12_345}
    back = {"ab": 100_000, "ab2": 3000, "ba": 5000}
    for name, n in sizes.items():
        reader, writer = await dial(t.link, name)
        writer.write(os.urandom(n))
        writer.write_eof()
        await read_n(reader, back[name])
        assert await reader.read() == b""  # a clean close travels through as EOF
        writer.close()
    expected = {"a-b": {"ab": 100_000, "ab2": 7_777, "ba": 5000}, "b-a": {"ab": 100_000, "ab2": 3000, "ba": 12_345}}
    state = t.link.control(WanControl())
    for direction, by_forward in expected.items():
        assert state.lines[direction].bytes_by_forward == by_forward
        assert state.lines[direction].bytes == sum(by_forward.values())
    assert state.accepted == {"ab": 1, "ab2": 1, "ba": 1}
    await until(lambda: not any(t.link.control(WanControl()).connections.values()), what="connections to close")
