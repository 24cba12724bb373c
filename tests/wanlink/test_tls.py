"""TLS runs end to end through the line: a real mutual-TLS KV push (shared.kv_transport with
the cluster's certificates) arrives intact, the line carries only ciphertext and counts it,
and a TLS receiver refuses what is not its prefill peer."""

from __future__ import annotations

import pytest

from shared.kv_push import KVPush
from shared.kv_receive import KVReceiver
from shared.kv_send import send_kv
from shared.kv_transport import FirstToken, KVTransferError, Part, Transfer, TransferHead
from shared.messages import RequestStats, WanControl
from shared.runtime.kv_payload import KVHeader
from tests.wanlink.conftest import Tap, until

MARKER = b"PLAINTEXT-KV-MARKER-0123456789"
KV = KVHeader(start=0, end=64, num_layers=4, kv_heads=4, head_dim=64, dtype="float32")
LAYER = 2 * 64 * 4 * 64 * 4  # K and V of one layer, float32


LAYERS = [(b"layer %d " % i + MARKER * (LAYER // len(MARKER) + 1))[:LAYER] for i in range(KV.num_layers)]


def push() -> KVPush:
    head = TransferHead(request_id="req-1", sender="prefill-0", secret="secret-1", kv=KV, wan=True)
    return KVPush(head, LAYERS, FirstToken(7, RequestStats(prefill_ms=3.5, wan_kv_bytes=KV.num_layers * LAYER)))


async def receiver(secrets, stall_s: float = 10.0) -> tuple[KVReceiver, list[Transfer]]:
    """md-0's KV listener: mutual TLS with its instance certificate."""
    got: list[Transfer] = []

    async def handler(transfer: Transfer) -> str:
        got.append(transfer)
        return ""

    rx = KVReceiver(handler, stall_s=stall_s, tls=secrets.kv_server_context("md-0"))
    await rx.start()
    return rx, got


async def test_a_mutual_tls_kv_push_crosses_intact_and_opaque(make_link, secrets, tmp_path):
    rx, got = await receiver(secrets)
    tap = await Tap(rx.port).start()  # between the line and md-0: sees what the line carried
    link = await make_link({"md-0": ("A", tap.port)}, bandwidth_mbps=200.0, delay_ms=5.0, capture_dir=str(tmp_path))
    assert not link.control(WanControl(capture=True)).error  # the line's own record of what crosses
    sent_push = push()
    sent = await send_kv(
        "127.0.0.1", link.ports["md-0"], sent_push, 10.0, tls=secrets.kv_client_context("prefill-0"), server_name="md-0"
    )
    [transfer] = got
    assert transfer.head == sent_push.head and (transfer.request_id, transfer.via_wan) == ("req-1", True)
    assert transfer.parts == [Part(0, KV.end, LAYERS)] and transfer.first == sent_push.first
    await until(lambda: not link.control(WanControl()).connections.get("md-0"), what="the connection to close")
    lines = link.control(WanControl()).lines
    ab, ba = lines["a-b"].bytes_by_forward["md-0"], lines["b-a"].bytes_by_forward["md-0"]
    assert MARKER not in tap.to_upstream and b"layer 0" not in tap.to_upstream
    assert b"secret-1" not in tap.to_upstream  # nor the HEADER's transfer secret
    captured = {d: (tmp_path / f"md-0.{d}.bin").read_bytes() for d in ("a-b", "b-a")}
    assert captured == {"a-b": tap.to_upstream, "b-a": tap.from_upstream}
    # the counts are the bytes that crossed; TLS adds a handshake and ~0.2% framing to the payload
    assert (ab, ba) == (len(tap.to_upstream), len(tap.from_upstream))
    assert sent < ab < sent * 1.01 + 16 * 1024
    assert 0 < ba < 16 * 1024  # handshake and the ACK
    await rx.stop()


async def test_a_tls_receiver_refuses_what_is_not_its_prefill_peer(make_link, secrets):
    rx, got = await receiver(secrets)
    link = await make_link({"md-0": ("A", rx.port)})
    with pytest.raises(KVTransferError):  # plaintext through the line
        await send_kv("127.0.0.1", link.ports["md-0"], push(), 5.0)
    with pytest.raises(KVTransferError):  # a decoder's certificate, not a prefill instance's
        await send_kv(
            "127.0.0.1", link.ports["md-0"], push(), 5.0, tls=secrets.kv_client_context("md-0"), server_name="md-0"
        )
    with pytest.raises(KVTransferError, match="cannot connect"):  # the line reaches md-0, not the decoder asked for
        await send_kv(
            "127.0.0.1", link.ports["md-0"], push(), 5.0, tls=secrets.kv_client_context("prefill-0"), server_name="md-9"
        )
    assert got == [] and rx.refused == 1  # the decoder's certificate got through TLS, then was refused
    assert link.control(WanControl()).accepted == {"md-0": 3}
    await rx.stop()
