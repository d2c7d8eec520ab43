"""Rotary position embedding (RoPE) and RoFormer's linear attention with it.

RoPE (Su et al., "RoFormer: Enhanced Transformer with Rotary Position Embedding", arXiv
2104.09864, 2021; Neurocomputing 2024) gives position to a vector by *rotating* it: the
features are read as D/2 pairs (x_{2i}, x_{2i+1}), and the pair i of the token at position t
is turned by the angle t * theta_i, theta_i = base^(-2i/D) (i = 0..D/2-1; the paper's
eq. (15) writes the same with 1-based i). Rotations preserve lengths, and R_m^T R_n = R_{n-m},
so a rotated query and a rotated key meet in a score that depends on their offset only:

    (R_m q) . (R_n k) = q . (R_{n-m} k).

Because the rotation acts on each token's vector on its own, it fits inside linear attention,
whose scores are dot products of per-token features: rotate phi(q_i) and phi(k_j) and the
products still factorise, so the O(T) forms of `linear_attention` apply unchanged. The paper's
eq. (19) (section 3.3, "Properties of RoPE", paragraph "RoPE with linear attention") does
exactly that for the numerator, and keeps the *unrotated* sum in the denominator:

    o_i = sum_j (R_i phi(q_i)) . (R_j phi(k_j)) v_j / (sum_j phi(q_i) . phi(k_j) + eps)

A rotated denominator could reach zero or turn negative (rotation can make the dot product of
two non-negative vectors negative), while the unrotated one is a sum of non-negative terms. The
price: the weights of a row do not sum to one, and some are negative.

Conventions: positions are **0-based** by default (t = 0..T-1, as in common implementations;
the paper's sums run over n = 1..N, and `positional.py` is 1-based too). Scores depend on
offsets only, so the start matters for the rotated features, never for the attention output.
Pairs are interleaved, (x_0, x_1), (x_2, x_3), ..., as in the paper (not the "half split"
(x_i, x_{i+D/2}) of GPT-NeoX style code, which is the same map up to a fixed permutation of
the feature axis). Inputs q, k of the attention functions are features phi(q), phi(k), as for
`linear_attention`.
"""
from __future__ import annotations

import numbers

import torch
from torch import Tensor

from .. import _validate as V
from .linear import linear_attention
from .reference import FORMS
from .state import DEFAULT_EPS, compute_dtype

DEFAULT_BASE = 10000.0  # Vaswani et al.'s sinusoid base, which RoFormer keeps


# --------------------------------------------------------------------------------------
# checks
# --------------------------------------------------------------------------------------


def _check_even(fn: str, name: str, x: Tensor) -> int:
    """The last axis of `x` has an even, positive size D (RoPE turns pairs); returns D."""
    D = x.shape[-1]
    if D == 0 or D % 2:
        raise ValueError(
            f"{fn}: `{name}` has last dimension D={D} ({V.describe(x)}); RoPE rotates pairs "
            f"(x_2i, x_2i+1), so expected an even D >= 2"
        )
    return D


def _check_positions(fn: str, positions: Tensor | None, T: int | None, device: torch.device) -> Tensor:
    """None (0..T-1) or a 1-d tensor of T finite real numbers on `device` (any length when T is
    None); returns them in float64."""
    if positions is None:
        return torch.arange(T, dtype=torch.float64, device=device)
    if not isinstance(positions, Tensor):
        raise TypeError(f"{fn}: `positions` must be None or a 1-d torch.Tensor, got {type(positions).__name__}")
    if positions.dtype == torch.bool or positions.is_complex():
        raise TypeError(f"{fn}: `positions` must hold real numbers (an int or float dtype), got {V.describe(positions)}")
    if positions.dim() != 1 or (T is not None and positions.shape[0] != T):
        expected = "a 1-d tensor (T,)" if T is None else f"(T,) = ({T},), one position per token"
        raise ValueError(f"{fn}: `positions` has shape {tuple(positions.shape)}; expected {expected}")
    if positions.device != device:
        raise ValueError(f"{fn}: `positions` is on {positions.device} but the features are on {device}")
    pos = positions.to(torch.float64)
    V.check_values(fn, "positions", pos)
    return pos


def _check_features(fn: str, q: Tensor, k: Tensor, v: Tensor | None = None) -> None:
    """q, k (and v) pass `check_qkv`, are finite, and q, k are non-negative features of even size."""
    V.check_qkv(fn, q, k, k if v is None else v)  # v = k: only q and k can fail
    named = (("q", q), ("k", k)) + ((("v", v),) if v is not None else ())
    V.check_all_finite(fn, named)
    _check_even(fn, "q", q)
    if not V.values_checked():
        return
    for name, x in (("q", q), ("k", k)):
        if bool((x < 0).any()):
            raise ValueError(
                f"{fn}: `{name}` must hold non-negative features phi({name}) ({V.describe(x)}): RoFormer's "
                f"unrotated denominator sum_j phi(q_i).phi(k_j) is only safe for non-negative features (apply "
                f"the feature map first, e.g. elu({name}) + 1); got a minimum of {float(x.min()):.4g}"
            )


# --------------------------------------------------------------------------------------
# the rotation
# --------------------------------------------------------------------------------------


def _angles(pos: Tensor, D: int, base: float) -> Tensor:
    """(T, D/2) float64 angles pos_t * base^(-2i/D)."""
    two_i = torch.arange(0, D, 2, dtype=torch.float64, device=pos.device)
    theta = torch.pow(torch.tensor(base, dtype=torch.float64, device=pos.device), -two_i / D)
    return pos[:, None] * theta[None, :]


def rotary_angles(
    positions: int | Tensor, dim: int, *, base: float = DEFAULT_BASE,
    device: torch.device | str | None = None,
) -> Tensor:
    """The (T, dim/2) float64 table of RoPE angles: angle[t, i] = positions_t * base^(-2i/dim).

    `positions` is a length T (then positions 0..T-1, on `device`) or a 1-d tensor of T
    numbers, ints or floats (its own device is used; `device` must then be None). Column i is
    the angle of the feature pair (2i, 2i+1). Column 0 always turns at one radian per position,
    whatever the base: theta_0 = base^0 = 1; a larger base only slows the other pairs down.
    """
    fn = "rotary_angles"
    V.check_positive_int(fn, "dim", dim)
    if dim % 2:
        raise ValueError(f"{fn}: `dim` must be even (RoPE rotates pairs of features), got {dim!r}")
    base = V.check_finite_number(fn, "base", base, positive=True)
    if isinstance(positions, Tensor):
        if device is not None:
            raise ValueError(f"{fn}: pass `device` only with an int `positions`; a tensor brings its own device")
        pos = _check_positions(fn, positions, None, positions.device)
    else:
        if isinstance(positions, bool) or not isinstance(positions, numbers.Integral) or positions < 0:
            raise ValueError(f"{fn}: `positions` must be a length T >= 0 or a 1-d tensor, got {positions!r}")
        pos = torch.arange(int(positions), dtype=torch.float64, device=device)
    return _angles(pos, dim, base)


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Turn each pair (x_2i, x_2i+1) by the angle whose cosine and sine are cos[t, i], sin[t, i].

    (a, b) -> (a cos - b sin, a sin + b cos): the paper's eq. (34), counter-clockwise.
    x: (..., T, D); cos, sin: (T, D/2) in x's dtype.
    """
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


def _rotated(x: Tensor, pos: Tensor, base: float, dtype: torch.dtype) -> Tensor:
    """x rotated at positions `pos` (float64), computed and returned in `dtype`.

    The angles and their cosines and sines are formed in float64 and cast afterwards, so that
    a large position is not rounded before the cosine is taken.
    """
    angle = _angles(pos, x.shape[-1], base)
    return _rotate(x.to(dtype), torch.cos(angle).to(dtype), torch.sin(angle).to(dtype))


def rotary_embedding(x: Tensor, *, positions: Tensor | None = None, base: float = DEFAULT_BASE) -> Tensor:
    """Rotary position embedding (RoPE) of x: (B, H, T, D), D even.

    The pair (x_{2i}, x_{2i+1}) of the token at position p_t is turned counter-clockwise by the
    angle p_t * theta_i, theta_i = base^(-2i/D), i = 0..D/2-1. Every token keeps its length,
    and the dot product of a token rotated at p with one rotated at p' depends on p - p' only
    (shifting every position by one constant changes no score).

    Args:
        x: (B, H, T, D) floating tensor, typically queries or keys (or their features).
        positions: None for 0..T-1, or a 1-d tensor of T real numbers (ints or floats, any
            order, repeats allowed) on x's device: the position of each token.
        base: the frequency base, a finite number > 0 (10000 as in RoFormer).

    Returns:
        The rotated tensor, same shape and dtype as x. It is computed in float64 for float64
        input and in float32 otherwise (the angles themselves always in float64). The map is
        local: a NaN or inf in x spreads only to the other entry of its pair, so x's values are
        not checked (the attention functions below do check theirs).
    """
    fn = "rotary_embedding"
    V.check_tensor(fn, "x", x, ndim=4)
    _check_even(fn, "x", x)
    base = V.check_finite_number(fn, "base", base, positive=True)
    pos = _check_positions(fn, positions, x.shape[2], x.device)
    return _rotated(x, pos, base, compute_dtype(x)).to(x.dtype)


# --------------------------------------------------------------------------------------
# RoFormer's linear attention with RoPE (the paper's eq. 19)
# --------------------------------------------------------------------------------------


def _unrotated_denominator(q: Tensor, k: Tensor, causal: bool) -> Tensor:
    """sum_j phi(q_i) . phi(k_j) over j <= i (causal) or all j, shape (B, H, T).

    Causal: q_i . (k_0 + ... + k_i), a prefix sum of the keys; non-causal: q_i . (sum_j k_j).
    """
    keys = torch.cumsum(k, dim=2) if causal else k.sum(dim=2, keepdim=True)
    return (q * keys).sum(-1)


def rotary_linear_attention_matrix(
    q: Tensor,
    k: Tensor,
    *,
    causal: bool = True,
    eps: float = DEFAULT_EPS,
    positions: Tensor | None = None,
    base: float = DEFAULT_BASE,
) -> Tensor:
    """The (B, H, T, T) weights of RoFormer's linear attention with RoPE, as an explicit matrix.

    A_ij = (R_i phi(q_i)) . (R_j phi(k_j)) / (sum_{j'} phi(q_i) . phi(k_j') + eps), with j, j'
    over j <= i when causal (A_ij = 0 above the diagonal) or over all tokens; R_t is the RoPE
    rotation at position t. So `A @ v` is `rotary_linear_attention(q, k, v, ...)`, built the
    quadratic way for teaching and figures.

    The numerator is rotated and the denominator is not (the paper's eq. 19), so unlike the
    weights of softmax or plain linear attention, **the rows of A do not sum to one and entries
    may be negative**: the rotated score of two non-negative features can be negative, while
    the denominator, a sum of non-negative products, cannot. Nor are the weights bounded by one:
    abs((R_i a) . (R_j b)) <= ‖a‖ ‖b‖ can exceed a . b, most of all for nearly orthogonal features.

    q, k: (B, H, T, Dk) non-negative features, Dk even. Computed in float64 for float64 input,
    float32 otherwise; returned in q's dtype.
    """
    fn = "rotary_linear_attention_matrix"
    _check_features(fn, q, k)
    causal = V.check_flag(fn, "causal", causal)
    eps = V.check_eps(fn, eps)
    base = V.check_finite_number(fn, "base", base, positive=True)
    pos = _check_positions(fn, positions, q.shape[2], q.device)
    dtype = compute_dtype(q)
    rq, rk = _rotated(q, pos, base, dtype), _rotated(k, pos, base, dtype)
    scores = rq @ rk.transpose(-1, -2)  # rotated: may be negative
    plain = q.to(dtype) @ k.to(dtype).transpose(-1, -2)  # unrotated: >= 0
    if causal:
        keep = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool, device=q.device).tril()
        scores, plain = torch.where(keep, scores, 0.0), torch.where(keep, plain, 0.0)
    return (scores / (plain.sum(-1, keepdim=True) + eps)).to(q.dtype)


def rotary_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    eps: float = DEFAULT_EPS,
    positions: Tensor | None = None,
    base: float = DEFAULT_BASE,
    form: str = "chunked",
) -> Tensor:
    """Linear attention with rotary position embedding, as RoFormer defines it (eq. 19).

    o_i = sum_j (R_i phi(q_i)) . (R_j phi(k_j)) v_j / (sum_j phi(q_i) . phi(k_j) + eps)

    with the sums over j <= i (causal) or over all j, and R_t the RoPE rotation at position t
    (`rotary_embedding`). The numerator is plain unnormalised linear attention of the rotated
    features, so it runs in O(T) in any form of `linear_attention`, and the score of i and j
    depends on their offset only. The denominator keeps the *unrotated* features: it is a sum
    of non-negative products, so it never vanishes or changes sign because of the rotation
    (a rotated one could: see `rotary_linear_attention_matrix`), at the price of rows whose
    weights neither sum to one nor stay non-negative. The paper argues the weights still rank
    the values; this library only reproduces the definition.

    Args:
        q, k: (B, H, T, Dk) non-negative features phi(q), phi(k) (e.g. elu(x) + 1, as in the
            paper's experiments with Katharopoulos et al.'s map), Dk even. Negative entries
            are refused: the unrotated denominator is only safe for non-negative features.
        v: (B, H, T, Dv).
        causal: sum over j <= i (True) or over all j.
        eps: added to the denominator.
        positions: None for 0..T-1, or a 1-d tensor of T numbers (see `rotary_embedding`).
        base: the RoPE frequency base, finite and > 0.
        form: "quadratic", "recurrent" or "chunked": the form of `linear_attention` used for
            the numerator (all agree). The denominator is a prefix sum of the keys in every form.

    Returns:
        o of shape (B, H, T, Dv) in v's dtype. Computed in float64 for float64 input and in
        float32 otherwise: the unnormalised numerator grows with T and could overflow in half
        precision before it is divided.
    """
    fn = "rotary_linear_attention"
    _check_features(fn, q, k, v)
    causal = V.check_flag(fn, "causal", causal)
    V.check_choice(fn, "form", form, FORMS)
    eps = V.check_eps(fn, eps)
    base = V.check_finite_number(fn, "base", base, positive=True)
    pos = _check_positions(fn, positions, q.shape[2], q.device)
    dtype = compute_dtype(q)
    rq, rk = _rotated(q, pos, base, dtype), _rotated(k, pos, base, dtype)
    num = linear_attention(rq, rk, v.to(dtype), causal=causal, normalize=False, form=form)
    den = _unrotated_denominator(q.to(dtype), k.to(dtype), causal)
    return (num / (den.unsqueeze(-1) + eps)).to(v.dtype)
