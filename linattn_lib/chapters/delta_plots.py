"""Chapter 10's associative-memory experiment: how well a delta-rule state recalls its pairs.

Write `n_pairs` random key-value pairs (unit keys in R^dk, values of norm about 1) into one
state, then read every key back from the final state and compare with its value:

    error_j = ||S_T^T k_j - v_j|| / ||v_j||,    indexed by the pair's age T - 1 - j

(age 0 is the pair written last). An error of 1 is what a state that forgot the pair (and
answers 0) gets; plain additive linear attention, S_T = sum_j k_j v_j^T, has an error of
about sqrt((n_pairs - 1) / dk) at every age, its cross-talk. `recall_by_age` averages over
`trials` independent memories, drawn from one seeded generator, so a curve is deterministic.

`draw_recall_by_age(beta)` draws one panel per gate alpha, the figure behind the chapter's
live slider (`widgets.live_slider`) and its static twin (`widgets.static_slider`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch import Tensor

from ..core.delta import delta_rule_attention
from .plots import method_color

BETAS = (0.1, 0.3, 0.5, 1.0, 1.5, 2.0)
ALPHAS = (1.0, 0.95, 0.8)
N_PAIRS, DK, DV, TRIALS = 64, 16, 16, 64


def random_pairs(
    n_pairs: int = N_PAIRS, dk: int = DK, dv: int = DV, trials: int = TRIALS, *, seed: int = 0,
) -> tuple[Tensor, Tensor]:
    """(k, v) in float64: k (trials, 1, n_pairs, dk) unit keys, v (trials, 1, n_pairs, dv)
    with entries N(0, 1/dv), so that ||v|| is about 1."""
    g = torch.Generator().manual_seed(seed)
    k = F.normalize(torch.randn(trials, 1, n_pairs, dk, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(trials, 1, n_pairs, dv, generator=g, dtype=torch.float64) / math.sqrt(dv)
    return k, v


def _errors_by_age(k: Tensor, v: Tensor, S: Tensor) -> Tensor:
    """Mean relative read-out error of every pair from the final state S, newest pair first."""
    err = (k @ S - v).norm(dim=-1) / v.norm(dim=-1)  # (trials, 1, n_pairs)
    return err.mean(dim=(0, 1)).flip(0)


def recall_by_age(
    beta: float, alpha: float = 1.0, *, n_pairs: int = N_PAIRS, dk: int = DK, dv: int = DV,
    trials: int = TRIALS, seed: int = 0,
) -> Tensor:
    """(n_pairs,) mean recall error of the delta rule (write strength beta, gate alpha), by age.

    alpha = 1 is DeltaNet, alpha < 1 Gated DeltaNet with the same gate at every token.
    """
    if not 0 < alpha <= 1:
        raise ValueError(f"recall_by_age: the gate alpha must be in (0, 1], got {alpha}")
    k, v = random_pairs(n_pairs, dk, dv, trials, seed=seed)
    b = torch.full(k.shape[:-1], float(beta), dtype=torch.float64)
    log_decay = None if alpha == 1 else torch.tensor([math.log(alpha)], dtype=torch.float64)
    _, state = delta_rule_attention(k, k, v, b, log_decay=log_decay, return_state=True)
    return _errors_by_age(k, v, state.S)


def additive_recall_by_age(
    *, n_pairs: int = N_PAIRS, dk: int = DK, dv: int = DV, trials: int = TRIALS, seed: int = 0,
) -> Tensor:
    """The same for plain additive linear attention, S = sum_j k_j v_j^T (no normaliser)."""
    k, v = random_pairs(n_pairs, dk, dv, trials, seed=seed)
    return _errors_by_age(k, v, k.transpose(-1, -2) @ v)


def draw_recall_by_age(
    beta: float, alphas: Sequence[float] = ALPHAS, *, ymax: float = 4.6, size: float = 2.9,
) -> Figure:
    """One panel per gate alpha: recall error against age for write strength `beta`, with
    additive linear attention (grey) and the error of a forgotten pair (1, dotted).

    Every call draws the same axes (ages 0..n_pairs - 1, errors 0..ymax, shared by the
    panels), so the frames of a slider differ only in their curves; the legend sits below
    the panels, off the data.
    """
    additive = additive_recall_by_age()
    ages = torch.arange(len(additive))
    fig, axes = plt.subplots(1, len(alphas), figsize=(size * len(alphas) + 0.4, size * 0.95),
                             sharey=True, squeeze=False)
    for ax, alpha in zip(axes[0], alphas):
        err = recall_by_age(beta, alpha)
        ax.plot(ages, additive, color=method_color("linear"), lw=2, label="additive (linear attn.)")
        ax.axhline(1.0, color="k", ls=":", lw=1, label="forgotten (answers 0)")
        ax.plot(ages, err, color=method_color("deltanet" if alpha == 1 else "gated_deltanet"), lw=2,
                label=f"delta rule, β = {beta:g}" + ("" if alpha == 1 else ", gated"))
        ax.axvline(DK, color="0.4", ls="--", lw=0.8, label=f"age = $d_k$ = {DK}")
        name = "DeltaNet" if alpha == 1 else "Gated DeltaNet"
        ax.set_title(f"{name}, α = {alpha:g}")
        ax.set_xlabel("age of the pair (writes since)")
        ax.set_xlim(-1, len(additive))
        ax.set_ylim(0, ymax)
        ax.grid(True, alpha=0.3)
    axes[0, 0].set_ylabel("recall error ‖Sᵀk − v‖ / ‖v‖")
    fig.suptitle(f"{N_PAIRS} pairs in a {DK} × {DV} state, β = {beta:g}")
    fig.tight_layout()
    handles, labels = axes[0, 0].get_legend_handles_labels()
    for ax in axes[0]:  # the gated panels' colour too, once
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2,
               frameon=False)
    return fig
