"""Writing a large simulation: results.json and requests.jsonl only (no per-request plots)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_plain(out_dir: Path, results: dict[str, Any], records: list[dict[str, Any]]) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "results.json", out_dir / "requests.jsonl"]
    paths[0].write_text(json.dumps(results, indent=1))
    with paths[1].open("w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    return paths
