"""Softmax attention: the exact quadratic baseline every linear method is measured against.

Layout (B, H, T, D), as in `torch.nn.functional.scaled_dot_product_attention`.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import _validate as V


def softmax_attention_weights(q: Tensor, k: Tensor, *, causal: bool = False, scale: float | None = None) -> Tensor:
    """The (B, H, Tq, Tk) matrix softmax(q k^T * scale), Tq = Tk when causal (rows sum to one;
    causal masks j > i)."""
    fn = "softmax_attention_weights"
    causal = V.check_flag(fn, "causal", causal)
    if scale is not None:
        scale = V.check_finite_number(fn, "scale", scale)
    V.check_tensor(fn, "q", q, ndim=4)
    V.check_tensor(fn, "k", k, ndim=4)
    V.check_same(fn, [("q", q), ("k", k)])
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{fn}: `q` ({V.describe(q)}) and `k` ({V.describe(k)}) must share B, H and D")
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"{fn}: causal=True needs as many queries as keys, got {q.shape[2]} and {k.shape[2]}")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        T = q.shape[2]
        mask = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    # torch.softmax subtracts the row maximum first ("safe" softmax): exp never overflows.
    return torch.softmax(scores, dim=-1)


def softmax_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None) -> Tensor:
    """Exact softmax attention softmax(q k^T * scale) v, materialising the T x T matrix.

    scale defaults to 1/sqrt(D). Memory and time are O(T^2) per head: this is the baseline
    every linear method is measured against.
    """
    fn = "softmax_attention"
    V.check_qkv(fn, q, k, v)
    causal = V.check_flag(fn, "causal", causal)
    if scale is not None:
        scale = V.check_finite_number(fn, "scale", scale)
    return softmax_attention_weights(q, k, causal=causal, scale=scale) @ v
