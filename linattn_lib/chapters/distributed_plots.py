"""The picture of chapter 9: how the states cross the ranks, by a chain of sends or one all-gather.

A book helper (matplotlib), kept out of `linattn_lib.distributed`, which never plots.
"""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import FancyArrowPatch, Rectangle

__all__ = ["draw_rank_scan"]


def draw_rank_scan(world_size: int = 4, *, ax: Axes | None = None, mode: str = "all_gather") -> Axes:
    """Draw how the states cross the ranks: mode "ring" (a chain of sends, W-1 sequential steps)
    or "all_gather" (one collective, then a local combination on every rank). Returns the axes."""
    if mode not in ("ring", "all_gather"):
        raise ValueError(f"draw_rank_scan: `mode` must be 'ring' or 'all_gather', got {mode!r}")
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.2))
    W = world_size
    # ranks are told apart by place and label; neutral greys, because the book's hues are methods
    for r in range(W):
        x0 = r * 1.5
        ax.add_patch(Rectangle((x0, 2.0), 1.2, 0.45, facecolor="0.93", edgecolor="0.45", lw=0.8))
        ax.text(x0 + 0.6, 2.22, f"rank {r}: tokens", ha="center", va="center", fontsize=10)
        ax.add_patch(Rectangle((x0 + 0.35, 1.0), 0.5, 0.5, facecolor="0.35", edgecolor="0.2", lw=0.8))
        ax.text(x0 + 0.6, 1.25, f"$S_{r}$", ha="center", va="center", fontsize=11, color="white")
        ax.add_patch(FancyArrowPatch((x0 + 0.6, 2.0), (x0 + 0.6, 1.5), arrowstyle="->", mutation_scale=8))
        ax.text(x0 + 0.6, 0.28, f"$S^{{in}}_{r}$", ha="center", va="center", fontsize=11)
    if mode == "ring":
        for r in range(W - 1):
            x0 = r * 1.5
            ax.add_patch(FancyArrowPatch((x0 + 0.85, 0.28), (x0 + 1.5 + 0.35, 0.28), arrowstyle="->",
                                         mutation_scale=10, color="k"))
            ax.add_patch(FancyArrowPatch((x0 + 0.75, 1.0), (x0 + 1.3, 0.3), arrowstyle="->", mutation_scale=8,
                                         color="0.4", linestyle="--"))
            ax.text(x0 + 1.32, 0.12, f"step {r + 1}", ha="center", fontsize=10)
        title = rf"chain: {W - 1} sequential sends; rank $r$ sends $e^{{G_r}} S^{{in}}_r + S_r$ to rank $r+1$"
    else:
        # a band tall enough for its label: the arrows end at its edges, clear of the text
        ax.add_patch(Rectangle((-0.1, 0.5), 1.5 * W - 0.1, 0.32, color="0.6", alpha=0.35))
        ax.text(0.75 * W - 0.15, 0.66, "all_gather: every rank receives every $(S_s, z_s, G_s)$",
                ha="center", va="center", fontsize=10)
        for r in range(W):
            ax.add_patch(FancyArrowPatch((r * 1.5 + 0.6, 1.0), (r * 1.5 + 0.6, 0.82), arrowstyle="->", mutation_scale=8))
            ax.add_patch(FancyArrowPatch((r * 1.5 + 0.6, 0.5), (r * 1.5 + 0.6, 0.4), arrowstyle="->", mutation_scale=8))
        # no nested exponent (its sub-subscripts were ~7 px on the page): §9.2 has the formula
        title = r"all-gather: one collective; rank $r$ sums the decayed $S_s$ of ranks $s<r$"
    ax.set_xlim(-0.2, 1.5 * W)
    ax.set_ylim(0.0, 2.6)
    ax.set_title(title, fontsize=11)
    ax.axis("off")
    return ax
