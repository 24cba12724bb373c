"""The peer bench's engines and workloads (`pdd bench peers`, benchmarks/peers.py).

Light (no torch, no matplotlib, no httpx): `pdd --help` reads it for the options' defaults.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ENGINES = ("vllm", "pdd-up", "pd-local", "pdd")
REFERENCE = "vllm"
FLOAT32 = ("vllm", "pd-local", "pdd")  # engines whose greedy text should be vLLM's (pdd-up decodes in bf16)
WORKLOADS: dict[str, dict[str, Any]] = {
    "single": {
        "spec": "random",
        "requests": 4,
        "input": 2000,
        "output": 64,
        "rate": 1.0,
        "max_concurrency": 1,
        "ignore_eos": True,
    },
    "agentic": {"spec": "agentic", "requests": 24, "rate": 0.4, "max_concurrency": None, "ignore_eos": False},
}
DEFAULT_VENV = Path.home() / ".cache" / "pdd" / "vllm-venv"
