"""The study's figures: matplotlib with the Agg backend, one PNG per claim, grids of
model (rows) × corpus (columns) where the claim is per run."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:gray")


def grid(
    path: Path,
    rows: Sequence[str],
    cols: Sequence[str],
    draw: Callable[[Any, str, str], None],
    *,
    title: str,
    xlabel: str,
    ylabel: str,
    logx: bool = True,
    share_y: bool = True,
) -> Path:
    """A ``rows × cols`` grid of axes; ``draw(ax, row, col)`` fills each. Saves ``path``."""
    width, height = max(6.0, 4.2 * len(cols)), 3.2 * len(rows) + 0.6
    fig, axes = plt.subplots(len(rows), len(cols), figsize=(width, height), squeeze=False,
                             sharey=share_y)
    for i, row in enumerate(rows):
        for j, col in enumerate(cols):
            ax = axes[i][j]
            draw(ax, row, col)
            ax.set_title(f"{row} · {col}", fontsize=9)
            if logx:
                ax.set_xscale("log", base=2)
            if i == len(rows) - 1:
                ax.set_xlabel(xlabel)
            if j == 0:
                ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    legend_rows = 0
    if handles:
        ncol = min(len(labels), 3 if width < 8 else 5)
        legend_rows = -(-len(labels) // ncol)
        fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.25 * legend_rows / height, 1, 1))  # 0.25 inch per legend row
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
