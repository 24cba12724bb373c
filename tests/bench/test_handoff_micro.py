"""`pdd bench handoff` end to end at a small size: every path (KV in plaintext, under mutual TLS
dialed at the push and dialed early, token ids over NATS + extend, and both over loopback) runs
through the real line, TLS and NATS server, and the JSON and the printed table carry each."""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks import handoff_micro


def test_every_path_runs_and_is_reported(tmp_path, capsys):
    threads = torch.get_num_threads()
    try:
        args = argparse.Namespace(prompt_tokens=32, tokens=8, reps=2, out=str(tmp_path))
        assert handoff_micro.main(args) == 0
    finally:
        torch.set_num_threads(threads)  # the bench sets its own
    result = json.loads((tmp_path / "handoff.json").read_text())
    for path in ("kv", "kv_tls", "kv_tls_early", "token_ids"):
        assert 0 < result[path]["p50"] <= result[path]["max"], path
    assert result["kv"]["payload_bytes"] == result["kv_tls_early"]["payload_bytes"] > 0
    assert set(result["loopback"]) == {"plain", "tls"}
    out = capsys.readouterr().out
    assert "KV, TLS, dialed early" in out and "the early dial saves" in out
