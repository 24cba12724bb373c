"""free_port: listening ports are chosen where an outgoing connection cannot take them first."""

import os
import random
import socket
import subprocess

from pdd import servers
from pdd.servers import _ephemeral_range, free_port


def test_free_ports_lie_below_the_ephemeral_range_bindable_and_never_repeated():
    lo, _ = _ephemeral_range()
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(p < lo for p in ports), (lo, ports)
    with socket.socket() as s:  # still free: nothing else holds it
        s.bind(("127.0.0.1", ports[-1]))


def test_outgoing_connections_take_ports_from_the_range_free_port_avoids():
    lo, hi = _ephemeral_range()
    with socket.socket() as server:
        server.bind(("127.0.0.1", free_port()))
        server.listen()
        with socket.create_connection(server.getsockname()) as client:
            assert lo <= client.getsockname()[1] <= hi  # why bind(0)'s ports raced the services


class _Fixed(random.Random):
    """free_port's choice: these ports, in this order."""

    def __init__(self, *ports: int) -> None:
        super().__init__()
        self.ports = list(ports)

    def randint(self, lo: int, hi: int) -> int:
        return self.ports.pop(0)


def _bindable_pair() -> tuple[int, int]:
    lo, _ = _ephemeral_range()
    found = []
    for port in range(lo - 2000, lo - 1000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in servers._handed_out:
            found.append(port)
        if len(found) == 2:
            return found[0], found[1]
    raise AssertionError("no two free ports")


def test_a_port_another_live_process_claimed_is_skipped_and_a_dead_ones_claim_taken_over(tmp_path):
    """The halves of `make test` each choose ports for their clusters: a port one of them chose
    is not handed out by the other before its service binds it (md-0 died at start on one)."""
    first, second = _bindable_pair()
    other = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / str(first)).write_text(str(other.pid))  # another live process chose it
        assert free_port(claims=tmp_path, rng=_Fixed(first, second)) == second
        assert (tmp_path / str(second)).read_text() == str(os.getpid())
    finally:
        other.kill()
        other.wait()
    # its process has ended: the claim is stale
    assert free_port(claims=tmp_path, rng=_Fixed(first)) == first
    assert (tmp_path / str(first)).read_text() == str(os.getpid())
