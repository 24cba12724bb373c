"""matplotlib for the experiments' figures (Agg backend: files only, no display)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  after use("Agg")

__all__ = ["plt", "save"]


def save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
