"""Random-feature kernel estimators as Monte-Carlo estimators, and the cost of associativity.

Chapters 2 and 3 treat phi(x) . phi(y) as what it is: an average of m random samples whose
expectation is a kernel. This module measures those samples (mean, variance, mean squared
error) against the exact kernels and against the closed forms of Performer's Lemma 2, and
collects the small exact calculations the chapters lean on:

* `per_direction_samples`, `estimates`, `mse`, `lemma2_mse`: the statistics of one estimator;
* `clipped_g`, `clipped_kernel`: the kernel that text A's clipped max(0, sin/cos)
  map really estimates;
* `taylor_features`, `taylor_feature_dim`: exact features of exp(x . y) truncated at an order;
* `attention_flops`, `flop_crossover`: (phi_Q phi_K^T) V versus phi_Q (phi_K^T V) (defined in
  `linattn_lib.flops`, re-exported here);
* `approx_attention_weights`, `attention_row_tv`, `relative_error`, `performer_output_error`,
  `feature_attention_view`: how far an approximate attention matrix and its output are from
  the exact ones;
* `performer_theorem4_num_features`: the number of features Performer's Theorem 4 asks for.

Every sample is computed with the library's own feature maps (`linattn_lib.core.features`), so the
statistics measured here are those of the code the book uses. Computations run in float64.
"""
from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

from .. import _validate as V
from ..core.features import (
    RandomFeatureMap,
    clipped_trig_features,
    hyperbolic_random_features,
    positive_random_features,
    random_projection,
    rff_features,
    trig_softmax_features,
)
from ..core.performer import performer_attention
from ..core.softmax import softmax_attention, softmax_attention_weights
from ..flops import attention_flops, flop_crossover  # noqa: F401  (re-exported for chapters 2-3)

D64 = torch.float64

ESTIMATOR_KINDS = ("positive", "hyperbolic", "trig", "rff", "clipped")
"""What each kind estimates: exp(x . y) for positive / hyperbolic / trig; the Gaussian kernel
exp(-|x - y|^2 / 2) for rff; `clipped_kernel` for clipped."""

# ---------------------------------------------------------------------------------------
# samples of a random-feature estimator
# ---------------------------------------------------------------------------------------


def _pairs(fn: str, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """(d,) or (P, d) pairs as (P, d) float64 tensors."""
    V.check_tensor(fn, "x", x)
    V.check_tensor(fn, "y", y)
    if x.dim() == 1:
        x = x.unsqueeze(0)
    if y.dim() == 1:
        y = y.unsqueeze(0)
    if x.dim() != 2 or x.shape != y.shape:
        raise ValueError(
            f"{fn}: `x` ({V.describe(x)}) and `y` ({V.describe(y)}) must both be (d,) or both (P, d): "
            "row p of x is paired with row p of y"
        )
    return x.to(D64), y.to(D64)


def draw_directions(
    n: int, d: int, *, orthogonal: bool = False, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """n random directions W (n, d) and phases b (n,) ~ U(0, 2 pi), in float64.

    With orthogonal=True, W is the library's block-orthogonal matrix: consecutive groups of d
    rows are orthogonal, with chi_d norms (each row is marginally N(0, I_d)).
    """
    V.check_positive_int("draw_directions", "n", n)
    V.check_positive_int("draw_directions", "d", d)
    if orthogonal:
        W = random_projection(n, d, orthogonal=True, seed=seed, dtype=D64)
    else:
        W = random_projection(n, d, orthogonal=False, seed=seed, dtype=D64)
    gen = torch.Generator().manual_seed(int(seed) + 1)
    b = 2 * math.pi * torch.rand(n, generator=gen, dtype=D64)
    return W, b


def _samples(x: Tensor, y: Tensor, W: Tensor, b: Tensor, kind: str) -> Tensor:
    """(n, P): sample i is direction i's term, so mean over m rows = the m-feature estimate."""
    n = W.shape[0]
    if kind == "positive":
        fx, fy = positive_random_features(x, W), positive_random_features(y, W)
    elif kind == "hyperbolic":
        fx, fy = hyperbolic_random_features(x, W), hyperbolic_random_features(y, W)
    elif kind == "trig":
        fx, fy = trig_softmax_features(x, W), trig_softmax_features(y, W)
    elif kind == "rff":
        fx, fy = rff_features(x, W, b), rff_features(y, W, b)
    else:
        fx, fy = clipped_trig_features(x, W, b), clipped_trig_features(y, W, b)
    prod = fx * fy * n  # undo the 1/m of the feature scaling: one sample per feature
    if prod.shape[-1] == 2 * n:  # (sin, cos) or (+w, -w) halves belong to the same direction
        prod = prod[..., :n] + prod[..., n:]
    return prod.T


def per_direction_samples(
    x: Tensor, y: Tensor, *, kind: str, n: int, orthogonal: bool = False, seed: int = 0
) -> Tensor:
    """n per-direction samples of the estimator for each pair: a (n, P) tensor.

    Row i is the contribution of direction w_i, scaled so that the mean of any m rows is the
    estimate phi(x) . phi(y) with those m features. With i.i.d. directions the rows are
    independent, so their variance is m times the variance of an m-feature estimate.
    """
    fn = "per_direction_samples"
    V.check_choice(fn, "kind", kind, ESTIMATOR_KINDS)
    x, y = _pairs(fn, x, y)
    W, b = draw_directions(n, x.shape[-1], orthogonal=orthogonal, seed=seed)
    return _samples(x, y, W, b, kind)


def estimates(
    x: Tensor,
    y: Tensor,
    *,
    kind: str,
    m: int,
    n_draws: int,
    orthogonal: bool = False,
    seed: int = 0,
    max_rows: int = 1 << 18,
) -> Tensor:
    """n_draws independent m-feature estimates phi(x) . phi(y) of each pair: (n_draws, P).

    Each draw gets its own projection; with orthogonal=True it is ceil(m/d) whole orthogonal
    blocks cut to m rows, exactly as `RandomFeatureMap` draws it. Work is done in batches of at
    most `max_rows` directions to bound memory.
    """
    fn = "estimates"
    V.check_choice(fn, "kind", kind, ESTIMATOR_KINDS)
    V.check_positive_int(fn, "m", m)
    V.check_positive_int(fn, "n_draws", n_draws)
    x, y = _pairs(fn, x, y)
    d, P = x.shape[-1], x.shape[0]
    per = -(-m // d) * d if orthogonal else m  # whole blocks per draw keep draws independent
    W, b = draw_directions(per * n_draws, d, orthogonal=orthogonal, seed=seed)
    W, b = W.view(n_draws, per, d)[:, :m], b.view(n_draws, per)[:, :m]
    step = max(1, max_rows // m)
    out = []
    for s in range(0, n_draws, step):
        Wc, bc = W[s : s + step].reshape(-1, d), b[s : s + step].reshape(-1)
        out.append(_samples(x, y, Wc, bc, kind).view(-1, m, P).mean(1))
    return torch.cat(out)


def exact_kernel(x: Tensor, y: Tensor, *, kind: str) -> Tensor:
    """The kernel value that `kind` estimates, for each pair: (P,)."""
    fn = "exact_kernel"
    V.check_choice(fn, "kind", kind, ESTIMATOR_KINDS)
    x, y = _pairs(fn, x, y)
    if kind in ("positive", "hyperbolic", "trig"):
        return torch.exp((x * y).sum(-1))
    if kind == "rff":
        return torch.exp(-0.5 * ((x - y) ** 2).sum(-1))
    return clipped_kernel(x, y)


def mse(est: Tensor, target: Tensor) -> Tensor:
    """Mean squared error over draws (dim 0) of estimates against the exact values: (P,)."""
    return ((est - target.to(est)) ** 2).mean(0)


def lemma2_mse(x: Tensor, y: Tensor, *, kind: str, m: int) -> Tensor:
    """Closed-form MSE of an m-feature estimator with i.i.d. directions, for each pair: (P,).

    Performer's Lemma 2 (SM = exp(x . y)):
      trig:       exp(|x|^2 + |y|^2) (1 - exp(-|x - y|^2))^2 / (2m)
      positive:   exp(|x + y|^2) SM^2 (1 - exp(-|x + y|^2)) / m
      hyperbolic: (1 - exp(-|x + y|^2)) / 2 times the positive MSE
    and for Rahimi-Recht features of the Gaussian kernel, ((1 - exp(-|x - y|^2))^2 + 1) / (2m).
    The trig MSE grows as SM -> 0 while the positive MSE goes to 0 with SM.
    """
    fn = "lemma2_mse"
    V.check_choice(fn, "kind", kind, ("positive", "hyperbolic", "trig", "rff"))
    V.check_positive_int(fn, "m", m)
    x, y = _pairs(fn, x, y)
    s2 = ((x + y) ** 2).sum(-1)
    d2 = ((x - y) ** 2).sum(-1)
    sm = torch.exp((x * y).sum(-1))
    if kind == "trig":
        return torch.exp((x * x).sum(-1) + (y * y).sum(-1)) * (1 - torch.exp(-d2)) ** 2 / (2 * m)
    if kind == "rff":
        return ((1 - torch.exp(-d2)) ** 2 + 1) / (2 * m)
    pos = torch.exp(s2) * sm**2 * (1 - torch.exp(-s2)) / m
    return pos if kind == "positive" else 0.5 * (1 - torch.exp(-s2)) * pos


# ---------------------------------------------------------------------------------------
# the kernel of the clipped map
# ---------------------------------------------------------------------------------------


def clipped_g(delta: Tensor) -> Tensor:
    """g(D) = [(pi - |D|) cos D + sin |D|] / (2 pi) on [-pi, pi], extended 2 pi-periodically.

    It is E_b[sum of max(0, sin)(.) max(0, sin)(.) + max(0, cos)(.) max(0, cos)(.)] for two phases
    that differ by D, with b ~ U(0, 2 pi): the per-direction kernel of the clipped map.
    """
    delta = torch.as_tensor(delta, dtype=D64)
    r = torch.remainder(delta + math.pi, 2 * math.pi) - math.pi
    a = r.abs()
    return ((math.pi - a) * torch.cos(r) + torch.sin(a)) / (2 * math.pi)


def clipped_kernel(x: Tensor, y: Tensor, *, n_nodes: int = 20001) -> Tensor:
    """k(x, y) = E_w[g(w . (x - y))], w ~ N(0, I): what the clipped map estimates, for each pair.

    w . (x - y) ~ N(0, |x - y|^2), so this is a one-dimensional Gaussian average of `clipped_g`
    (computed by the trapezoid rule over +-10 standard deviations). Shift-invariant, with
    k(x, x) = 1/2: neither the Gaussian kernel nor exp(x . y).
    """
    x, y = _pairs("clipped_kernel", x, y)
    sigma = (x - y).norm(dim=-1)  # (P,)
    z = torch.linspace(-10.0, 10.0, n_nodes, dtype=D64)
    dens = torch.exp(-0.5 * z**2) / math.sqrt(2 * math.pi)
    vals = clipped_g(sigma[:, None] * z[None, :]) * dens
    return torch.trapezoid(vals, z, dim=-1)


# ---------------------------------------------------------------------------------------
# exact features of exp(x . y), truncated
# ---------------------------------------------------------------------------------------


def taylor_feature_dim(d: int, order: int) -> int:
    """1 + d + d^2 + ... + d^order: the size of `taylor_features`."""
    return sum(d**n for n in range(order + 1))


def taylor_features(x: Tensor, order: int) -> Tensor:
    """[1, x, x(x)x / sqrt(2!), ..., x^(x)N / sqrt(N!)] flattened: (..., taylor_feature_dim(d, N)).

    phi(x) . phi(y) = sum_{n <= N} (x . y)^n / n!, the Taylor series of exp(x . y) cut after
    order N. Every finite N leaves a remainder, and the size grows like d^N: the exact feature
    space of the exponential kernel is infinite-dimensional.
    """
    V.check_tensor("taylor_features", "x", x)
    if isinstance(order, bool) or not isinstance(order, int) or order < 0:
        raise ValueError(f"taylor_features: `order` must be a non-negative int, got {order!r}")
    cur = torch.ones(*x.shape[:-1], 1, dtype=x.dtype, device=x.device)
    parts = [cur]
    for n in range(1, order + 1):
        cur = (cur.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2)  # x^(x)n
        parts.append(cur / math.sqrt(math.factorial(n)))
    return torch.cat(parts, dim=-1)


# ---------------------------------------------------------------------------------------
# approximate attention matrices and outputs
# ---------------------------------------------------------------------------------------


def approx_attention_weights(phi_q: Tensor, phi_k: Tensor, *, causal: bool = False) -> Tensor:
    """D^-1 (phi_Q phi_K^T), masked when causal: the attention matrix the features imply.

    Only for looking at it (it is T x T). Rows sum to one; with sign-indefinite features some
    weights, and some row sums, can be negative.
    """
    V.check_tensor("approx_attention_weights", "phi_q", phi_q)
    V.check_tensor("approx_attention_weights", "phi_k", phi_k)
    A = phi_q @ phi_k.transpose(-1, -2)
    if causal:
        A = A.tril()
    return A / A.sum(-1, keepdim=True)


def attention_row_tv(approx: Tensor, exact: Tensor) -> Tensor:
    """Total-variation distance of each row, (1/2) sum_j |approx_ij - exact_ij|: (..., T)."""
    return 0.5 * (approx - exact).abs().sum(-1)


def relative_error(approx: Tensor, exact: Tensor) -> float:
    """|approx - exact|_F / |exact|_F, computed in float64."""
    a, e = approx.to(D64), exact.to(D64)
    return ((a - e).norm() / e.norm()).item()


def performer_output_error(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    m: int,
    kind: str = "positive",
    orthogonal: bool = True,
    seeds: Iterable[int] = range(4),
    causal: bool = False,
    eps: float = 0.0,
    backend: str = "auto",
) -> float:
    """Mean over seeds of the relative error of `performer_attention` against softmax attention.

    q, k are raw (B, H, T, d) queries and keys; both sides use the 1/sqrt(d) temperature.
    `eps` is passed to the denominator; the default 0 measures the estimator alone (with the
    key stabiliser, denominators can be small enough for the library's default 1e-6 to bias
    the output).
    """
    exact = softmax_attention(q, k, v, causal=causal)
    errs = [
        relative_error(
            performer_attention(
                q, k, v, causal=causal, num_features=m, kind=kind, orthogonal=orthogonal, seed=s, eps=eps,
                backend=backend,
            ),
            exact,
        )
        for s in seeds
    ]
    if not errs:
        raise ValueError("performer_output_error: `seeds` is empty")
    return sum(errs) / len(errs)


def feature_attention_view(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    m: int,
    kind: str = "positive",
    orthogonal: bool = False,
    seed: int = 0,
    causal: bool = False,
) -> dict:
    """What the chapter-3 widget shows for one random feature map, for one head.

    q, k: raw (T, d) queries and keys, v: (T, dv). The map is `RandomFeatureMap(d, m, kind=...,
    orthogonal=..., seed=...)` with the 1/sqrt(d) temperature, stabilised for positive kinds.
    Returns a dict with "exact" and "approx" (T, T) attention matrices, "row_tv" (T,) (the
    total-variation distance of each row), "output_error" (relative error of approx @ v) and
    "negative" (the fraction of negative approximate weights).
    """
    fn = "feature_attention_view"
    for name, x in (("q", q), ("k", k), ("v", v)):
        V.check_tensor(fn, name, x, ndim=2)
    fm = RandomFeatureMap(q.shape[-1], m, kind=kind, orthogonal=orthogonal, seed=seed).to(q)
    stabilize = kind in ("positive", "hyperbolic")
    phi_q = fm(q, is_query=True, stabilize=stabilize)
    phi_k = fm(k, is_query=False, stabilize=stabilize)
    approx = approx_attention_weights(phi_q, phi_k, causal=causal)
    exact = softmax_attention_weights(q[None, None], k[None, None], causal=causal)[0, 0]
    return {
        "exact": exact,
        "approx": approx,
        "row_tv": attention_row_tv(approx, exact),
        "output_error": relative_error(approx @ v, exact @ v),
        "negative": (approx < 0).double().mean().item(),
    }


def performer_theorem4_num_features(d: int, R: float, eps: float) -> float:
    """The number of features in Performer's Theorem 4, with its Theta-constant set to 1.

    Theorem 4 (uniform convergence, for SM^trig with orthogonal random features): if
    |q|, |k| <= R, let l = R d^(-1/4), h* = exp(l^2 / 2) and delta = eps / h*^2; then
    m = Theta((d / delta^2) log(4 d^(3/4) R / delta)) features give max_ij |A_hat - A| <= eps
    with any constant probability, A being the unnormalised matrix exp(Q K^T / sqrt(d)).
    delta is an accuracy, not a failure probability.
    """
    V.check_positive_int("performer_theorem4_num_features", "d", d)
    if R <= 0 or eps <= 0:
        raise ValueError(f"performer_theorem4_num_features: `R` and `eps` must be positive, got R={R}, eps={eps}")
    l = R * d**-0.25
    h = math.exp(l * l / 2)
    delta = eps / h**2
    return d / delta**2 * math.log(4 * d**0.75 * R / delta)


__all__ = [
    "ESTIMATOR_KINDS",
    "draw_directions",
    "per_direction_samples",
    "estimates",
    "exact_kernel",
    "mse",
    "lemma2_mse",
    "clipped_g",
    "clipped_kernel",
    "taylor_feature_dim",
    "taylor_features",
    "attention_flops",
    "flop_crossover",
    "approx_attention_weights",
    "attention_row_tv",
    "relative_error",
    "performer_output_error",
    "feature_attention_view",
    "performer_theorem4_num_features",
]
