"""`python -m services.gateway --config FILE [--instance NAME]`: the HTTP front door on cfg.host
and its port (`cfg.gateway_port(NAME)`; NAME when several run, as control_plane.gateways says)."""

import socket

import uvicorn

from services.gateway.app import create_app
from services.gateway.gateway import Gateway
from shared import heap
from shared.config import ClusterConfig, service_args


def listening_socket(cfg: ClusterConfig, port: int) -> socket.socket:
    """The front door's socket. Connections accepted on it inherit its send buffer
    (`gateway.send_buffer_kib`), so a client that stops reading is sent that much, not the few
    MB the kernel would grow the buffer to, before the stream's next write waits on it."""
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    sock = socket.create_server((cfg.host, port), family=family)
    if cfg.gateway.send_buffer_kib:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, cfg.gateway.send_buffer_kib * 1024)
    return sock


if __name__ == "__main__":
    cfg, name = service_args("gateway")
    name = name or cfg.control_plane.gateway_names[0]
    gateway = Gateway(cfg, name)
    app = create_app(gateway)
    heap.settle(gateway.metrics.metrics)  # the tokenizer's and the app's objects out of the collector's reach
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    server.run(sockets=[listening_socket(cfg, cfg.gateway_port(name))])
