"""Causal and decay masks: the lower-triangular matrices that every causal form multiplies in.

`segsum(g)[..., i, j] = g[j+1] + ... + g[i]` for j <= i and -inf above the diagonal, so
`exp(segsum(g))` is the 1-semiseparable decay mask L with L[i, j] = a[j+1] * ... * a[i],
a = exp(g). With g = 0 it is the plain causal mask of ones.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import _validate as V


def segsum(g: Tensor) -> Tensor:
    """Segment sums of `g` over its last axis: (..., T) -> (..., T, T).

    Computed by masked cumulative sums rather than as cumsum(g)[i] - cumsum(g)[j]: the
    difference of two large prefix sums loses precision when the decay is strong, while a
    cumsum that starts at j+1 adds only the terms it needs.
    """
    V.check_tensor("segsum", "g", g)
    if g.dim() < 1:
        raise ValueError(f"segsum: `g` must have at least one axis (..., T), got {V.describe(g)}")
    T = g.shape[-1]
    x = g.unsqueeze(-1).expand(*g.shape, T)  # x[..., i, j] = g[i]
    strict = torch.ones(T, T, dtype=torch.bool, device=g.device).tril(-1)
    x = x.masked_fill(~strict, 0.0)  # keep g[i] only where i > j
    out = torch.cumsum(x, dim=-2)  # out[..., i, j] = sum_{j < s <= i} g[s]
    causal = torch.ones(T, T, dtype=torch.bool, device=g.device).tril()
    return out.masked_fill(~causal, float("-inf"))


def decay_mask(log_decay: Tensor) -> Tensor:
    """The decay mask L = exp(segsum(log_decay)), shape (..., T, T); zeros above the diagonal.

    `log_decay` must be a floating tensor of finite values <= 0 (decay factors in (0, 1]).
    """
    V.check_tensor("decay_mask", "log_decay", log_decay)
    V.check_values("decay_mask", "log_decay", log_decay, high=0.0, why="a decay factor exp(log_decay) in (0, 1]")
    return torch.exp(segsum(log_decay))


def causal_mask(
    T: int, *, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Lower-triangular (T, T) matrix of ones: the causal mask with no decay."""
    V.check_positive_int("causal_mask", "T", T)
    return torch.ones(T, T, device=device, dtype=dtype).tril()
