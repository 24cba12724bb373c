"""free_port: listening ports are chosen where an outgoing connection cannot take them first."""

import socket

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
