"""benchmarks/gpu_check.sh, run on CPU in its quick mode: its parsing and output format only
(the figures need a GPU; this checks that the first GPU run will produce them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest


def _gpu_check(out: Path) -> tuple[list[str], dict[str, str]]:
    """Started at session start (tests/background.py), beside the unit tests."""
    env = {
        "PY": sys.executable,
        "GPU_CHECK_DEVICE": "cpu",
        "GPU_CHECK_QUICK": "1",
        "GPU_CHECK_TESTS": "tests/runtime/test_runtime_perf_pool.py",
        "GPU_CHECK_MODELS": "llama3_8b_shape",  # SmolLM2 takes the same path, ten times slower on CPU
    }
    return ["bash", "benchmarks/gpu_check.sh", str(out)], env


@pytest.mark.slow  # a real process running pytest and the figures script: ~20 s
@pytest.mark.background.with_args(_gpu_check)
def test_gpu_check_script_writes_every_figure(background_job):
    done, tmp_path = background_job
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["meta"]["device"] == "cpu" and result["meta"]["quick"] is True
    assert result["tests"]["exit_code"] == 0 and result["tests"]["passed"] == result["tests"]["tests"] > 0
    fig = result["models"]["llama3_8b_shape"]
    plan = result["meta"]["plan"]
    for mode in ("eager", "graphs"):
        assert set(fig["decode_ms"][mode]) == {"1", "8", "32"}
        for cell in fig["decode_ms"][mode].values():
            assert set(cell) == {"median", "min", "max", "n"} and cell["median"] > 0
    assert fig["transformers_decode_b1_ms"]["median"] > 0
    assert set(fig["prefill_tok_s"]) == {str(n) for n in plan["prefill_lens"]}
    assert set(fig["extend_ms"]) == {"100"}
    for key in ("kv_export_gb_s", "kv_import_gb_s", "kv_export_per_layer_gb_s"):
        assert fig[key] > 0
    assert [b for b, _ in fig["graph_buckets"]] == [1, 8, 32]
    assert (tmp_path / "tests.xml").exists() and (tmp_path / "tests.log").exists()
