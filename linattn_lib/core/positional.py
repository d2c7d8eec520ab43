"""Position information for linear attention: sinusoidal PE, cosFormer, key normalisation, band bias.

Linear attention without positions is permutation-equivariant when non-causal (only the
causal mask leaks order). The texts' chapter 5 lists four ways to add position; each one is
here as a *quadratic definition* (the T x T matrix, for teaching and figures) beside a
*linear-time form* built on `linear_attention`, and the tests check that the two agree.

Conventions used throughout this module:

* Inputs q, k are **features** phi(q), phi(k), as for `linear_attention`: the caller applies
  the feature map (cosFormer uses phi = ReLU: pass `torch.relu(q)`). One convention for the
  whole library keeps every mechanism composable with every feature map.
* Positions are **1-based**, i = 1..T, as in the cosFormer code (`get_index` uses
  `arange(1, T + 1)`) and in text A's normaliser sum_{j<=i} c_ij = (1 - lam/2) i + ...
  Re-weightings that depend only on i - j do not care; the per-position features
  q_i cos(theta_i) do, so every function here uses the same i.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _validate as V
from .linear import linear_attention
from .state import DEFAULT_EPS, suffix_sum

COSFORMER_VARIANTS = ("original", "lambda")
COSFORMER_NORMALIZERS = ("similarity", "text")
POSITIONAL_FORMS = ("linear", "quadratic")


# --------------------------------------------------------------------------------------
# sinusoidal positions (Vaswani et al. 2017, section 3.5)
# --------------------------------------------------------------------------------------


def sinusoidal_positions(
    T: int, d: int, *, base: float = 10000.0, dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> Tensor:
    """The (T, d) table PE[pos, 2i] = sin(pos / base^(2i/d)), PE[pos, 2i+1] = cos(pos / base^(2i/d)).

    pos = 0..T-1 as in the original Transformer code. Each pair of columns is a rotation at its
    own frequency, so PE[pos + k] is a fixed linear map of PE[pos]: relative offsets are linear
    in the encoding. An odd d ends with a sine column.
    """
    fn = "sinusoidal_positions"
    V.check_positive_int(fn, "T", T)
    V.check_positive_int(fn, "d", d)
    V.check_finite_number(fn, "base", base)
    V.check_number(fn, "base", base, low=1.0, strict_low=True)
    V.check_dtype(fn, "dtype", dtype)
    pos = torch.arange(T, dtype=torch.float64, device=device).unsqueeze(1)
    two_i = torch.arange(0, d, 2, dtype=torch.float64, device=device)
    angle = pos / base ** (two_i / d)  # (T, ceil(d/2))
    pe = torch.zeros(T, d, dtype=torch.float64, device=device)
    pe[:, 0::2] = torch.sin(angle)
    pe[:, 1::2] = torch.cos(angle[:, : d // 2])
    return pe.to(dtype)


# --------------------------------------------------------------------------------------
# shared helpers
# --------------------------------------------------------------------------------------


def _positions(T: int, device) -> Tensor:
    """1-based positions 1..T in float64: angles are formed in float64 and cast afterwards, so
    that half-precision inputs do not round the positions themselves (fp16 is exact only to 2048)."""
    return torch.arange(1, T + 1, dtype=torch.float64, device=device)


def _num_and_den(q: Tensor, k: Tensor, v: Tensor, *, causal: bool) -> tuple[Tensor, Tensor]:
    """Unnormalised linear attention of v and of a column of ones: (sum_j s_ij v_j, sum_j s_ij).

    Appending a ones column to v is the classic way to get the normaliser from the same pass:
    whatever weights multiply v_j also multiply 1.
    """
    ones = torch.ones(*v.shape[:-1], 1, dtype=v.dtype, device=v.device)
    out = linear_attention(q, k, torch.cat([v, ones], dim=-1), causal=causal, normalize=False)
    return out[..., :-1], out[..., -1]


def _check_features(fn: str, q: Tensor, k: Tensor, v: Tensor | None = None) -> None:
    """q, k (and v when given) pass `check_qkv`, and q, k are non-negative features."""
    V.check_qkv(fn, q, k, k if v is None else v)  # v = k: only q and k can fail
    for name, x in (("q", q), ("k", k)):
        if bool((x < 0).any()):
            raise ValueError(
                f"{fn}: `{name}` must hold non-negative features phi({name}) (apply the feature map "
                f"first, e.g. torch.relu({name})); got a minimum of {float(x.min()):.4g}"
            )


def _masked(scores: Tensor, causal: bool) -> Tensor:
    """Zero the entries above the diagonal (j > i) when causal."""
    return scores.tril() if causal else scores


# --------------------------------------------------------------------------------------
# cosFormer
# --------------------------------------------------------------------------------------


def _cosformer_coefficients(variant: str, lam: float, M: float) -> tuple[float, float, float]:
    """(alpha, beta, omega) with c_ij = alpha + beta * cos(omega * (i - j)).

    original (Qin et al. 2022):  c_ij = cos(pi/2 * (i - j) / M)          -> (0, 1, pi / (2M))
    text A's lambda variant:     c_ij = 1 - lam + lam (1 + cos(pi (i - j)/L)) / 2
                                      = (1 - lam/2) + (lam/2) cos(pi (i - j) / L)
                                                                         -> (1 - lam/2, lam/2, pi / L)
    Writing both the same way gives one linear-time algorithm for the two.
    """
    if variant == "original":
        return 0.0, 1.0, math.pi / (2.0 * M)
    return 1.0 - lam / 2.0, lam / 2.0, math.pi / M


def _check_cosformer_args(fn: str, T: int, variant: str, lam, M) -> tuple[float, float]:
    V.check_choice(fn, "variant", variant, COSFORMER_VARIANTS)
    lam = V.check_number(fn, "lam", lam, low=0.0, high=1.0)
    M = float(T) if M is None else V.check_finite_number(fn, "M", M, positive=True)
    if M < T:
        raise ValueError(
            f"{fn}: `M` must be >= the sequence length T={T}, got M={M:g}; with M < T the weight stops "
            "decreasing with |i-j| (the original's cos(pi/2 (i-j)/M) even turns negative); fix M in "
            "advance to the longest sequence you will process"
        )
    return lam, M


def cosformer_weights(
    T: int,
    M: float | None = None,
    *,
    causal: bool = True,
    variant: str = "original",
    lam: float = 0.5,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str | None = None,
) -> Tensor:
    """The (T, T) positional re-weighting c_ij of cosFormer (zeros above the diagonal when causal).

    * variant="original": c_ij = cos(pi/2 * (i - j) / M), in (0, 1] for M >= T.
    * variant="lambda": text A's c_ij = 1 - lam + lam (1 + cos(pi (i - j) / M)) / 2, in
      [1 - lam, 1] (the texts call M "L"). It never decays below 1 - lam.

    M defaults to T and must be >= T.
    """
    fn = "cosformer_weights"
    V.check_positive_int(fn, "T", T)
    causal = V.check_flag(fn, "causal", causal)
    V.check_dtype(fn, "dtype", dtype)
    lam, M = _check_cosformer_args(fn, T, variant, lam, M)
    return _reweighting(T, causal=causal, variant=variant, lam=lam, M=M, device=device).to(dtype)


def _reweighting(T: int, *, causal: bool, variant: str, lam: float, M: float, device) -> Tensor:
    """c_ij = alpha + beta cos(omega (i - j)), (T, T) in float64."""
    alpha, beta, omega = _cosformer_coefficients(variant, lam, M)
    i = _positions(T, device)
    return _masked(alpha + beta * torch.cos(omega * (i[:, None] - i[None, :])), causal)


def _default_normalizer(variant: str, normalizer: str | None) -> str:
    """The original normalises by the re-weighted similarities, the texts by sum_j c_ij alone."""
    if normalizer is None:
        return "similarity" if variant == "original" else "text"
    return normalizer


def cosformer_attention_matrix(
    q: Tensor,
    k: Tensor,
    *,
    causal: bool = True,
    variant: str = "original",
    lam: float = 0.5,
    M: float | None = None,
    normalizer: str | None = None,
    eps: float = DEFAULT_EPS,
) -> Tensor:
    """The (B, H, T, T) matrix A with cosFormer's output o = A v (the quadratic definition).

    With s_ij = c_ij q_i . k_j:

    * normalizer="similarity": A_ij = s_ij / (sum_j s_ij + eps); rows sum to one (the original).
    * normalizer="text": A_ij = s_ij / sum_j c_ij, text A's formula, which omits q_i . k_j
      from the normaliser, so rows do *not* sum to one and the output scale follows the
      feature norms (errata A27).

    Defaults: "similarity" for variant="original", "text" for variant="lambda".
    """
    fn = "cosformer_attention_matrix"
    _check_features(fn, q, k)
    causal = V.check_flag(fn, "causal", causal)
    normalizer = _default_normalizer(variant, normalizer)
    V.check_choice(fn, "normalizer", normalizer, COSFORMER_NORMALIZERS)
    lam, M = _check_cosformer_args(fn, q.shape[2], variant, lam, M)
    eps = V.check_eps(fn, eps)
    return _cosformer_matrix(q, k, causal=causal, variant=variant, lam=lam, M=M, normalizer=normalizer, eps=eps)


def _cosformer_matrix(q, k, *, causal, variant, lam, M, normalizer, eps) -> Tensor:
    c = _reweighting(q.shape[2], causal=causal, variant=variant, lam=lam, M=M, device=q.device).to(q.dtype)
    s = (q @ k.transpose(-1, -2)) * c
    if normalizer == "similarity":
        return s / (s.sum(-1, keepdim=True) + eps)
    return s / c.sum(-1, keepdim=True)


def _cosformer_linear(q, k, v, *, causal, variant, lam, M, normalizer, eps) -> Tensor:
    """O(T) cosFormer via cos(a - b) = cos a cos b + sin a sin b.

    c_ij q_i.k_j = alpha q_i.k_j + beta [(cos_i q_i).(cos_j k_j) + (sin_i q_i).(sin_j k_j)],
    so the numerator is (at most) three linear attentions: two for the original (alpha = 0),
    three for the lambda variant. The similarity normaliser comes out of the same passes (ones
    column); text A's normaliser sum_j c_ij needs only prefix sums of cos_j and sin_j.
    """
    alpha, beta, omega = _cosformer_coefficients(variant, lam, M)
    T = q.shape[2]
    theta = omega * _positions(T, q.device)
    cos, sin = torch.cos(theta), torch.sin(theta)  # (T,) float64
    text_den = _text_normaliser(cos, sin, alpha, beta, causal).to(q.dtype)
    cos, sin = cos.to(q.dtype)[:, None], sin.to(q.dtype)[:, None]  # (T, 1): scales each position
    num_c, den_c = _num_and_den(q * cos, k * cos, v, causal=causal)
    num_s, den_s = _num_and_den(q * sin, k * sin, v, causal=causal)
    num, den = beta * (num_c + num_s), beta * (den_c + den_s)
    if alpha != 0.0:
        num_1, den_1 = _num_and_den(q, k, v, causal=causal)
        num, den = num + alpha * num_1, den + alpha * den_1
    if normalizer == "similarity":
        return num / (den.unsqueeze(-1) + eps)
    return num / text_den.unsqueeze(-1)


def _text_normaliser(cos: Tensor, sin: Tensor, alpha: float, beta: float, causal: bool) -> Tensor:
    """sum_j c_ij = alpha * (number of j) + beta (cos_i sum_j cos_j + sin_i sum_j sin_j), shape (T,).

    Causal: prefix sums over j <= i, so O(1) per step; non-causal: totals over all j.
    """
    T = cos.shape[0]
    if causal:
        count, sum_cos, sum_sin = _positions(T, cos.device), torch.cumsum(cos, 0), torch.cumsum(sin, 0)
    else:
        count, sum_cos, sum_sin = torch.full_like(cos, T), cos.sum().expand(T), sin.sum().expand(T)
    return alpha * count + beta * (cos * sum_cos + sin * sum_sin)


def cosformer_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    variant: str = "original",
    lam: float = 0.5,
    M: float | None = None,
    form: str = "linear",
    normalizer: str | None = None,
    eps: float = DEFAULT_EPS,
) -> Tensor:
    """cosFormer attention (Qin et al., ICLR 2022) and text A's lambda variant.

    Args:
        q, k: (B, H, T, Dk) non-negative features; cosFormer uses phi = ReLU, so pass
            torch.relu(q), torch.relu(k).
        v: (B, H, T, Dv).
        causal: sum over j <= i (True) or all j.
        variant: "original" -- s_ij = phi(q_i).phi(k_j) cos(pi/2 (i - j)/M);
            "lambda" -- text A's c_ij = 1 - lam + lam (1 + cos(pi (i - j)/M)) / 2.
        lam: the lambda variant's strength in [0, 1] (ignored by "original").
        M: length scale, >= T; defaults to T (the original code uses max(src_len, tgt_len)).
            For streaming / decoding M must be fixed in advance to at least the longest sequence:
            the features q_i cos(pi i / 2M) of past tokens depend on it, so it cannot grow later.
        form: "linear" (O(T) through `linear_attention`) or "quadratic" (the T x T definition).
        normalizer: "similarity" (sum_j s_ij, weights sum to one) or "text" (sum_j c_ij, the
            texts' formula, weights do not sum to one). Default: "similarity" for the original,
            "text" for the lambda variant.
        eps: added to the "similarity" normaliser, as in `linear_attention`.

    Positions are 1-based (i = 1..T). Returns o of shape (B, H, T, Dv).
    """
    fn = "cosformer_attention"
    _check_features(fn, q, k, v)
    causal = V.check_flag(fn, "causal", causal)
    V.check_choice(fn, "form", form, POSITIONAL_FORMS)
    normalizer = _default_normalizer(variant, normalizer)
    V.check_choice(fn, "normalizer", normalizer, COSFORMER_NORMALIZERS)
    lam, M = _check_cosformer_args(fn, q.shape[2], variant, lam, M)
    eps = V.check_eps(fn, eps)
    if form == "quadratic":
        A = _cosformer_matrix(q, k, causal=causal, variant=variant, lam=lam, M=M, normalizer=normalizer, eps=eps)
        return A @ v
    return _cosformer_linear(q, k, v, causal=causal, variant=variant, lam=lam, M=M, normalizer=normalizer, eps=eps)


# --------------------------------------------------------------------------------------
# key-normalised attention (text A's "RFA-KN", section 5.3)
# --------------------------------------------------------------------------------------


def _check_key_normalized(fn: str, causal: bool) -> None:
    if V.check_flag(fn, "causal", causal):
        raise ValueError(
            f"{fn}: causal=True is impossible: the key normaliser z_j = sum_{{i>=j}} phi(q_i).phi(k_j) "
            "sums over *future* queries, which an autoregressive model does not have yet "
            "(errata A29); use causal=False"
        )


def key_normalized_attention_matrix(q: Tensor, k: Tensor, *, causal: bool = False, eps: float = DEFAULT_EPS) -> Tensor:
    """The (B, H, T, T) matrix A_ij = s_ij / (z_j + eps), s_ij = phi(q_i).phi(k_j), z_j = sum_{i>=j} s_ij.

    Each key is divided by the sum of its column *at and below the diagonal* (the queries at or
    after it). Neither the rows nor the columns of A sum to one.
    """
    fn = "key_normalized_attention_matrix"
    _check_features(fn, q, k)
    _check_key_normalized(fn, causal)
    eps = V.check_eps(fn, eps)
    s = q @ k.transpose(-1, -2)
    z = s.tril().sum(-2, keepdim=True)  # z_j: column sums over i >= j
    return s / (z + eps)


def key_normalized_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, form: str = "linear", eps: float = DEFAULT_EPS
) -> Tensor:
    """Key-normalised linear attention as text A's section 5.3 describes it ("RFA-KN").

    o_i = sum_j phi(q_i).phi(k_j) v_j / z_j with z_j = sum_{i>=j} phi(q_i).phi(k_j), the sum over
    all keys j. The name "RFA-KN" matches no paper we could find (RFA is Random Feature
    Attention, Peng et al. 2021, whose recency mechanism is a gate); we keep the mechanism only
    to show its flaws: z_j needs the future queries, so it is non-causal only (causal=True
    raises), and the weights of a query do not sum to one.

    O(T) form: z_j = phi(k_j) . (sum_{i>=j} phi(q_i)) is a reverse cumulative sum, and then
    o = linear_attention(phi(q), phi(k), v / z, non-causal, unnormalised).
    q, k: (B, H, T, Dk) non-negative features; v: (B, H, T, Dv). Returns (B, H, T, Dv).
    """
    fn = "key_normalized_attention"
    _check_features(fn, q, k, v)
    _check_key_normalized(fn, causal)
    V.check_choice(fn, "form", form, POSITIONAL_FORMS)
    eps = V.check_eps(fn, eps)
    if form == "quadratic":
        return key_normalized_attention_matrix(q, k, eps=eps) @ v
    future_q = suffix_sum(q, dim=2)  # sum_{i>=j} q_i
    z = (k * future_q).sum(-1, keepdim=True)
    return linear_attention(q, k, v / (z + eps), causal=False, normalize=False)


# --------------------------------------------------------------------------------------
# relative-position band bias (text A's section 5.4)
# --------------------------------------------------------------------------------------


def _band_offsets(w: Tensor, causal: bool) -> range:
    """The offsets Delta = i - j that column d of `w` stands for: 0..K causal, -K..K otherwise."""
    width = w.shape[1]
    return range(0, width) if causal else range(-(width // 2), width // 2 + 1)


def _check_band(fn: str, w, H: int, causal: bool, like: Tensor | None = None) -> None:
    V.check_layout(fn, "w", w, ("H", "W"))
    if w.shape[0] != H:
        raise ValueError(f"{fn}: `w` has {w.shape[0]} rows but there are H={H} heads; expected shape (H, W)")
    if not causal and w.shape[1] % 2 == 0:
        raise ValueError(
            f"{fn}: non-causal `w` must have an odd width 2K+1 (offsets -K..K), got shape {tuple(w.shape)}"
        )
    V.check_values(fn, "w", w)
    if like is not None:
        V.check_same(fn, [("q", like), ("w", w)])


def band_bias_matrix(w: Tensor, T: int, *, causal: bool = True) -> Tensor:
    """The (H, T, T) matrix beta(i - j) with beta(Delta) = w[:, Delta (+K)] for allowed Delta, else 0.

    w: (H, 2K+1) for causal=False (column K + Delta holds Delta = -K..K), or (H, K+1) for
    causal=True (column Delta holds Delta = 0..K).
    """
    fn = "band_bias_matrix"
    V.check_positive_int(fn, "T", T)
    causal = V.check_flag(fn, "causal", causal)
    V.check_layout(fn, "w", w, ("H", "W"))
    _check_band(fn, w, w.shape[0], causal)
    i = torch.arange(T, device=w.device)
    delta = i[:, None] - i[None, :]  # (T, T)
    offsets = _band_offsets(w, causal)
    lo, hi = offsets.start, offsets.stop - 1
    inside = (delta >= lo) & (delta <= hi)
    column = (delta - lo).clamp(0, w.shape[1] - 1)
    return w[:, column] * inside.to(w.dtype)


def _shift(x: Tensor, delta: int) -> Tensor:
    """y[..., i, :] = x[..., i - delta, :] along the T axis (dim -2), zero where i - delta is outside 0..T-1."""
    T = x.shape[-2]
    if delta >= 0:
        return F.pad(x, (0, 0, delta, 0))[..., :T, :]
    return F.pad(x, (0, 0, 0, -delta))[..., -delta:, :]


def _band_apply(w: Tensor, x: Tensor, causal: bool) -> Tensor:
    """sum_{Delta} w_Delta x_{i - Delta}: a banded convolution along T, O(T * K * D)."""
    T = x.shape[-2]
    out = torch.zeros_like(x)
    for col, delta in enumerate(_band_offsets(w, causal)):
        if abs(delta) < T:
            out = out + w[:, col].view(1, -1, 1, 1) * _shift(x, delta)
    return out


def band_bias_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    w: Tensor,
    *,
    causal: bool = True,
    normalize: bool = True,
    form: str = "linear",
    eps: float = DEFAULT_EPS,
) -> Tensor:
    """Linear attention plus an additive relative-position band bias (text A's section 5.4).

    o_i = sum_j [phi(q_i).phi(k_j) + beta(i - j)] v_j / sum_j [phi(q_i).phi(k_j) + beta(i - j)]

    with beta(Delta) = w_Delta for -K <= Delta <= K and 0 beyond (0 <= Delta <= K when causal).
    Because the bias is additive, the numerator splits into the linear-attention term plus a
    banded (2K+1)-tap convolution of v, O(T K d) in all; the normaliser likewise. Two warnings
    the texts miss (errata A30): the linear-attention term stays *global*, so the receptive field
    is not limited; and a negative w can make weights negative and the normaliser small or zero
    (only `eps` guards it). This scalar bias is T5/ALiBi style, not Shaw et al.'s clipped
    relative embeddings inside softmax.

    Args:
        q, k: (B, H, T, Dk) features; v: (B, H, T, Dv).
        w: (H, 2K+1) per-head bias for Delta = -K..K (causal=False), or (H, K+1) for Delta = 0..K.
        normalize: divide by the row sums (+ eps) or return the plain weighted sum.
        form: "linear" (O(T K d)) or "quadratic" (the T x T definition).
    """
    fn = "band_bias_attention"
    V.check_qkv(fn, q, k, v)
    causal = V.check_flag(fn, "causal", causal)
    normalize = V.check_flag(fn, "normalize", normalize)
    _check_band(fn, w, q.shape[1], causal, like=q)
    V.check_choice(fn, "form", form, POSITIONAL_FORMS)
    eps = V.check_eps(fn, eps)
    if form == "quadratic":
        A = _masked(q @ k.transpose(-1, -2), causal) + band_bias_matrix(w, q.shape[2], causal=causal)
        num, den = A @ v, A.sum(-1)
    else:
        ones = torch.ones(*v.shape[:-1], 1, dtype=v.dtype, device=v.device)
        num, den = _num_and_den(q, k, v, causal=causal)
        num, den = num + _band_apply(w, v, causal), den + _band_apply(w, ones, causal)[..., 0]
    return num / (den.unsqueeze(-1) + eps) if normalize else num
