"""Feature maps phi with phi(x) . phi(y) ~ kappa(x, y): deterministic maps and random features.

Conventions: inputs x have shape (..., d); a projection W has shape (m, d) with one random
direction w_i per row; features are returned along the last axis. Random maps are unbiased
*estimators* of their kernel (E[phi(x) . phi(y)] = kappa(x, y)); none of the kernels below has
an exact finite-dimensional feature map.

| map                          | estimates                  | sign       | source                 |
|------------------------------|----------------------------|------------|------------------------|
| `elu_plus_one`, `relu`       | (deterministic kernel)     | >= 0       | Katharopoulos 2020     |
| `rff_features`               | exp(-|x-y|^2 / 2 sigma^2)  | indefinite | Rahimi & Recht 2007    |
| `trig_softmax_features`      | exp(x . y)                 | indefinite | Performer SM^trig      |
| `positive_random_features`   | exp(x . y)                 | > 0        | Performer FAVOR+ (PRF) |
| `hyperbolic_random_features` | exp(x . y)                 | > 0        | Performer SM^hyp+      |
| `clipped_trig_features`      | a *different* kernel       | >= 0       | the source texts (bug) |
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _validate as V
from .packed_ops import func_transform_active

SCALINGS = ("chi", "sqrt_d")

# ---------------------------------------------------------------------------------------
# deterministic maps
# ---------------------------------------------------------------------------------------


def elu_plus_one(x: Tensor) -> Tensor:
    """elu(x) + 1 > 0: the Linear Transformer's feature map (Katharopoulos et al. 2020)."""
    V.check_tensor("elu_plus_one", "x", x)
    return F.elu(x) + 1.0


def relu(x: Tensor) -> Tensor:
    """max(x, 0): cosFormer's feature map. Non-negative, but a row can be all zeros."""
    V.check_tensor("relu", "x", x)
    return F.relu(x)


# ---------------------------------------------------------------------------------------
# random projections
# ---------------------------------------------------------------------------------------


def _generator(seed: int | None, fn: str = "random features") -> torch.Generator | None:
    seed = V.check_seed(fn, "seed", seed)
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed(int(seed))
    return g


def gaussian_matrix(m: int, d: int, *, seed: int | None = None, dtype: torch.dtype = torch.float32) -> Tensor:
    """(m, d) matrix of i.i.d. N(0, 1) entries: m independent directions w_i ~ N(0, I_d)."""
    fn = "gaussian_matrix"
    V.check_positive_int(fn, "m", m)
    V.check_positive_int(fn, "d", d)
    V.check_dtype(fn, "dtype", dtype)
    return torch.randn(int(m), int(d), generator=_generator(seed, fn), dtype=torch.float64).to(dtype)


def orthogonal_gaussian_matrix(
    m: int, d: int, *, scaling: str = "chi", seed: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """(m, d) block-orthogonal random matrix (Performer's ORFs).

    A d x d matrix has at most d orthogonal rows, so m > d rows are ceil(m/d) independent
    orthogonal blocks stacked (the last one truncated). Each block is the Q factor of a Gaussian
    matrix, sign-corrected so that it is exactly Haar distributed. Rows are then rescaled:

    * scaling="chi": norms drawn from chi_d (the norms of fresh N(0, I_d) vectors), so each row
      has the marginal law of a Gaussian vector and the feature maps' estimates stay unbiased;
    * scaling="sqrt_d": every norm is sqrt(d) (Performer's regularised variant). The rows are
      then uniform on a sphere, not Gaussian, and the estimates are biased: they estimate
      Performer's regularised kernel SMREG, which agrees with exp(x^T y) to second order in the
      norms (E[w w^T] = I still holds) but not beyond (chapter 3, exercise 3).
    """
    fn = "orthogonal_gaussian_matrix"
    V.check_positive_int(fn, "m", m)
    V.check_positive_int(fn, "d", d)
    V.check_choice(fn, "scaling", scaling, SCALINGS)
    V.check_dtype(fn, "dtype", dtype)
    m, d = int(m), int(d)
    gen = _generator(seed, fn)
    n_blocks = -(-m // d)
    G = torch.randn(n_blocks, d, d, generator=gen, dtype=torch.float64)
    Q, R = torch.linalg.qr(G)  # one batched QR for all blocks
    Q = Q * torch.sign(torch.diagonal(R, dim1=-2, dim2=-1)).unsqueeze(-2)  # Haar: fix QR's sign ambiguity
    W = Q.transpose(-1, -2).reshape(n_blocks * d, d)[:m]  # the rows of each block are orthonormal
    if scaling == "chi":
        norms = torch.randn(m, d, generator=gen, dtype=torch.float64).norm(dim=1)
    else:
        norms = torch.full((m,), math.sqrt(d), dtype=torch.float64)
    return (W * norms.unsqueeze(1)).to(dtype)


def random_projection(
    m: int, d: int, *, orthogonal: bool = True, scaling: str = "chi", seed: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Block-orthogonal (default) or i.i.d. Gaussian (m, d) projection. `scaling` ("chi" or
    "sqrt_d") sets the row norms of the orthogonal one; i.i.d. rows have chi_d norms already."""
    fn = "random_projection"
    V.check_positive_int(fn, "m", m)
    V.check_positive_int(fn, "d", d)
    V.check_choice(fn, "scaling", scaling, SCALINGS)
    V.check_seed(fn, "seed", seed)
    V.check_dtype(fn, "dtype", dtype)
    if V.check_flag(fn, "orthogonal", orthogonal):
        return orthogonal_gaussian_matrix(m, d, scaling=scaling, seed=seed, dtype=dtype)
    return gaussian_matrix(m, d, seed=seed, dtype=dtype)


# ---------------------------------------------------------------------------------------
# random feature maps
# ---------------------------------------------------------------------------------------


def _check_proj(fn: str, x: Tensor, W: Tensor) -> None:
    V.check_tensor(fn, "x", x)
    if x.dim() == 0:
        raise ValueError(f"{fn}: `x` must have a last axis d, laid out as (..., d), got {V.describe(x)}")
    V.check_layout(fn, "W", W, ("m", "d"))
    if W.shape[0] == 0:
        raise ValueError(f"{fn}: `W` must have at least one row (m >= 1), got {V.describe(W)}")
    if W.shape[1] != x.shape[-1]:
        raise ValueError(
            f"{fn}: `W` has shape {tuple(W.shape)} but `x` has feature size d={x.shape[-1]}; "
            "expected W of shape (m, d)"
        )


def _project(x: Tensor, W: Tensor) -> Tensor:
    return x @ W.to(device=x.device, dtype=x.dtype).T  # (..., m): w_i . x


def rff_features(x: Tensor, W: Tensor, b: Tensor, *, sigma: float = 1.0) -> Tensor:
    """Rahimi-Recht random Fourier features sqrt(2/m) cos(w_i . x / sigma + b_i).

    With w_i ~ N(0, I) and b_i ~ U(0, 2 pi), E[phi(x) . phi(y)] = exp(-‖x - y‖^2 / (2 sigma^2)).
    The sqrt(2/m) matters: cos a cos c = (cos(a - c) + cos(a + c)) / 2 and the second term
    averages to zero over b, so 1/sqrt(m) would estimate only half the kernel.
    """
    fn = "rff_features"
    _check_proj(fn, x, W)
    _check_phases(fn, b, W.shape[0])
    sigma = V.check_finite_number(fn, "sigma", sigma, positive=True)
    m = W.shape[0]
    return math.sqrt(2.0 / m) * torch.cos(_project(x / sigma, W) + b.to(x))


def trig_softmax_features(x: Tensor, W: Tensor) -> Tensor:
    """Performer's SM^trig: exp(‖x‖^2/2)/sqrt(m) [sin(W x), cos(W x)], unbiased for exp(x . y).

    sin a sin c + cos a cos c = cos(a - c), so phi(x) . phi(y) averages to
    exp(‖x‖^2/2 + ‖y‖^2/2) exp(-‖x - y‖^2/2) = exp(x . y). Sign-indefinite: estimates of a small
    kernel value can be negative, which is what breaks the normaliser.
    """
    _check_proj("trig_softmax_features", x, W)
    u = _project(x, W)
    h = torch.exp(0.5 * (x * x).sum(-1, keepdim=True))
    return h / math.sqrt(W.shape[0]) * torch.cat([torch.sin(u), torch.cos(u)], dim=-1)


def _check_phases(fn: str, b, m: int) -> None:
    """b: the (m,) random phases, a floating tensor."""
    V.check_tensor(fn, "b", b)
    if tuple(b.shape) != (m,):
        raise ValueError(f"{fn}: `b` has shape {tuple(b.shape)}; expected (m,) = ({m},)")


def _stabilize(u: Tensor, stabilize: str | None, fn: str = "positive features") -> Tensor:
    """Subtract a maximum from the exponent: exact for normalised attention, avoids overflow.

    "row" subtracts each row's own maximum (queries: a per-query constant cancels between the
    numerator and denominator of that query's output); "global" subtracts one maximum over all
    rows of a sequence (keys of non-causal attention: a constant common to every key cancels
    as well; causal attention uses `running_max_stabiliser` instead, so that no key sees a
    later one). The maximum is detached: the gradient treats it as the constant it is for
    normalised attention.
    """
    _check_stabilize(fn, stabilize)
    if stabilize == "global" and u.dim() < 2:
        raise ValueError(f"{fn}: stabilize='global' needs x of shape (..., T, d), got a {u.dim()}-d input")
    if stabilize is None:
        return u
    if stabilize == "row":
        return u - u.amax(dim=-1, keepdim=True).detach()
    return u - u.amax(dim=(-1, -2), keepdim=True).detach()


def running_max_stabiliser(u: Tensor) -> tuple[Tensor, Tensor]:
    """Causal stabiliser for key exponents u (..., T, m): (u - m_t, g), both detached in m.

    m_t = max over j <= t and every feature of u_j: the largest exponent seen *so far*, so
    no later key changes an earlier key's features. When the maximum grows from m_{t-1} to
    m_t, a state built from the earlier keys must be rescaled by exp(m_{t-1} - m_t) <= 1,
    as online softmax rescales its running sum: that is a per-token log-decay
    g_t = m_{t-1} - m_t <= 0 (g_0 = 0), which `linear_attention(log_decay=g)` applies to S
    and z alike. The product of the decays from j to t is exp(m_j - m_t), so every key ends
    up scaled by exp(-m_t): a constant that cancels in the normalised output at query t.
    """
    if u.dim() < 2:
        raise ValueError(f"running_max_stabiliser: `u` must be (..., T, m), got a {u.dim()}-d tensor")
    m = u.detach().amax(dim=-1).cummax(dim=-1).values  # (..., T)
    g = torch.cat([torch.zeros_like(m[..., :1]), m[..., :-1] - m[..., 1:]], dim=-1)
    return u - m.unsqueeze(-1), g


def _check_stabilize(fn: str, stabilize: str | None) -> None:
    V.check_choice(fn, "stabilize", stabilize, (None, "row", "global"))


def positive_random_features(
    x: Tensor,
    W: Tensor,
    *,
    input_scale: float = 1.0,
    stabilize: str | None = None,
    backend: str = "torch",
) -> Tensor:
    """FAVOR+ positive random features exp(w_i . x' - ‖x'‖^2/2) / sqrt(m), x' = input_scale * x.

    E_w[exp(w . x - ‖x‖^2/2) exp(w . y - ‖y‖^2/2)] = exp(x . y) exactly (Performer Lemma 1), and
    every sample is positive. With input_scale = d^(-1/4) the product estimates
    exp(q . k / sqrt(d)), the softmax kernel at the usual temperature. x: (..., d), W: (m, d)
    (rows w_i); returns (..., m). stabilize: None, "row" (subtract each row's largest
    exponent: for queries) or "global" (one largest over a sequence's rows and features: for
    the keys of non-causal attention; causal keys use `running_max_stabiliser`), a constant
    factor that cancels in normalised attention.

    backend="triton" computes the map in one fused kernel (kernels/favor.py: projection,
    stabiliser and exp without intermediate (T, m) tensors), differentiable like this one. The
    default stays "torch" until the GPU benchmark (`python -m linattn_lib.experiments.gpu_check`) has shown
    that the fusion pays for itself. Under a `torch.func` transform (grad, vmap) of x or W the
    torch map computes the same features: the fused kernel has no vmap rule.
    """
    fn = "positive_random_features"
    _check_proj(fn, x, W)
    V.check_choice(fn, "backend", backend, ("torch", "triton"))
    input_scale = V.check_finite_number(fn, "input_scale", input_scale)
    _check_stabilize(fn, stabilize)
    if backend == "triton" and not func_transform_active():
        from .triton_ops import positive_random_features_triton

        return positive_random_features_triton(x, W, input_scale=input_scale, stabilize=stabilize)
    return torch.exp(_stabilize(_positive_exponents(x, W, input_scale), stabilize, fn)) / math.sqrt(W.shape[0])


def _positive_exponents(x: Tensor, W: Tensor, input_scale: float) -> Tensor:
    """w_i . x' - |x'|^2/2, x' = input_scale * x: the log of the FAVOR+ features times sqrt(m)."""
    x = x * input_scale
    return _project(x, W) - 0.5 * (x * x).sum(-1, keepdim=True)


def _hyperbolic_exponents(x: Tensor, W: Tensor, input_scale: float) -> Tensor:
    """[w . x' - |x'|^2/2, -w . x' - |x'|^2/2]: the log of the SM^hyp+ features times sqrt(2m)."""
    x = x * input_scale
    u = _project(x, W)
    half = 0.5 * (x * x).sum(-1, keepdim=True)
    return torch.cat([u - half, -u - half], dim=-1)


def hyperbolic_random_features(
    x: Tensor, W: Tensor, *, input_scale: float = 1.0, stabilize: str | None = None
) -> Tensor:
    """Performer's SM^hyp+: exp(-‖x'‖^2/2)/sqrt(2m) [exp(W x'), exp(-W x')], positive and unbiased.

    Pairing +w with -w (cosh) is an antithetic sample: lower variance for the same draws.
    """
    fn = "hyperbolic_random_features"
    _check_proj(fn, x, W)
    input_scale = V.check_finite_number(fn, "input_scale", input_scale)
    _check_stabilize(fn, stabilize)
    both = _hyperbolic_exponents(x, W, input_scale)
    return torch.exp(_stabilize(both, stabilize, fn)) / math.sqrt(2 * W.shape[0])


def clipped_trig_features(x: Tensor, W: Tensor, b: Tensor) -> Tensor:
    """Text A's "positive" map m^(-1/2) [max(0, sin(W x + b)), max(0, cos(W x + b))].

    Kept only to show its bias: clipping makes it non-negative but changes the kernel it
    estimates into a shift-invariant one with k(x, x) = 1/2, neither Gaussian nor softmax.
    """
    fn = "clipped_trig_features"
    _check_proj(fn, x, W)
    m = W.shape[0]
    _check_phases(fn, b, m)
    u = _project(x, W) + b.to(x)
    return torch.cat([torch.sin(u).clamp_min(0), torch.cos(u).clamp_min(0)], dim=-1) / math.sqrt(m)


# ---------------------------------------------------------------------------------------
# exact kernels (what the estimators target)
# ---------------------------------------------------------------------------------------


def _check_pairs(fn: str, x, y) -> None:
    """x: (..., n, d) and y: (..., p, d), floating, one dtype and device, the same d."""
    for name, t in (("x", x), ("y", y)):
        V.check_tensor(fn, name, t)
        if t.dim() < 2:
            raise ValueError(f"{fn}: `{name}` must be laid out as (..., n, d), at least 2-d, got {V.describe(t)}")
    V.check_same(fn, [("x", x), ("y", y)])
    if x.shape[-1] != y.shape[-1]:
        raise ValueError(f"{fn}: `y` has d={y.shape[-1]} but `x` has d={x.shape[-1]}; expected one feature size d")


def softmax_kernel(x: Tensor, y: Tensor) -> Tensor:
    """exp(x . y) for every pair: (..., n, d), (..., p, d) -> (..., n, p)."""
    _check_pairs("softmax_kernel", x, y)
    return torch.exp(x @ y.transpose(-1, -2))


def gaussian_kernel(x: Tensor, y: Tensor, *, sigma: float = 1.0) -> Tensor:
    """exp(-‖x - y‖^2 / (2 sigma^2)) for every pair: (..., n, d), (..., p, d) -> (..., n, p)."""
    _check_pairs("gaussian_kernel", x, y)
    sigma = V.check_finite_number("gaussian_kernel", "sigma", sigma, positive=True)
    return torch.exp(-torch.cdist(x, y).pow(2) / (2 * sigma**2))


# ---------------------------------------------------------------------------------------
# a module that owns its projection
# ---------------------------------------------------------------------------------------

KINDS = ("positive", "hyperbolic", "trig", "rff", "clipped")
EXPONENTIAL_KINDS = ("positive", "hyperbolic")  # features exp(u): these have a stabiliser


def default_num_features(d: int) -> int:
    """floor(d ln d), the default of the performer-pytorch reference code (266 for d = 64)."""
    V.check_positive_int("default_num_features", "d", d)
    return max(1, int(d * math.log(d))) if d > 1 else 1


class RandomFeatureMap(nn.Module):
    """A random feature map that owns its projection W (and phases b) and can redraw them.

    Performer redraws W periodically during training; `redraw()` does that. With
    `softmax_temperature=True` (default) inputs are scaled by d^(-1/4): for the softmax kinds
    ("positive", "hyperbolic", "trig") phi(q) . phi(k) then estimates exp(q . k / sqrt(d)), the
    kernel of softmax(q k^T / sqrt(d)); "rff" then estimates the Gaussian kernel of width
    sigma = d^(1/4), and "clipped" text A's biased kernel (see `clipped_trig_features`).

    Stabilised maps (the default) subtract a maximum from the exponents, a constant that
    cancels in normalised attention; the maximum is held constant in the gradient (detached),
    so gradients are those of normalised attention with eps = 0, not of the raw map. With
    `is_query=False` the key maximum is taken over the whole sequence (right for non-causal
    attention); causal attention takes a running maximum instead (`causal_key_features`),
    so that no key is scaled by a later one.
    """

    def __init__(
        self,
        d: int,
        m: int | None = None,
        *,
        kind: str = "positive",
        orthogonal: bool = True,
        scaling: str = "chi",
        softmax_temperature: bool = True,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        fn = "RandomFeatureMap"
        V.check_choice(fn, "kind", kind, KINDS)
        V.check_positive_int(fn, "d", d)
        if m is not None:
            V.check_positive_int(fn, "m", m)
        V.check_flag(fn, "orthogonal", orthogonal)
        V.check_choice(fn, "scaling", scaling, SCALINGS)
        V.check_flag(fn, "softmax_temperature", softmax_temperature)
        seed = V.check_seed(fn, "seed", seed)
        d = int(d)
        self.d, self.m = d, default_num_features(d) if m is None else int(m)
        self.kind, self.orthogonal, self.scaling = kind, orthogonal, scaling
        self.input_scale = d**-0.25 if softmax_temperature else 1.0
        self._seed = seed
        self.register_buffer("W", torch.empty(self.m, d))
        self.register_buffer("b", torch.empty(self.m))
        self.redraw(seed)

    @property
    def seed(self) -> int | None:
        """The seed of the current projection, or None when it was drawn from fresh entropy."""
        return self._seed

    @property
    def out_features(self) -> int:
        return self.m * 2 if self.kind in ("hyperbolic", "trig", "clipped") else self.m

    def reset_parameters(self) -> None:
        """Draw the projection again from its seed: the same values (a fresh draw when the
        seed is None), e.g. after a deferred (meta-device) initialisation."""
        self.redraw(self._seed)

    @torch.no_grad()
    def redraw(self, seed: int | None = None) -> None:
        """Draw a fresh projection (and fresh phases)."""
        seed = V.check_seed("RandomFeatureMap.redraw", "seed", seed)
        self._seed = seed
        W = random_projection(self.m, self.d, orthogonal=self.orthogonal, scaling=self.scaling, seed=seed)
        gen = _generator(None if seed is None else seed + 1)
        b = 2 * math.pi * torch.rand(self.m, generator=gen, dtype=torch.float64)
        self.W.copy_(W.to(self.W))
        self.b.copy_(b.to(self.b))

    def forward(self, x: Tensor, *, is_query: bool = True, stabilize: bool = True, backend: str = "torch") -> Tensor:
        """Features of x (..., d) -> (..., out_features), in x's dtype.

        backend="triton" runs the fused kernel; only the positive (FAVOR+) map has one.
        """
        fn = "RandomFeatureMap"
        self._check_x(fn, x)
        is_query = V.check_flag(fn, "is_query", is_query)
        stabilize = V.check_flag(fn, "stabilize", stabilize)
        V.check_choice(fn, "backend", backend, ("torch", "triton"))
        W = self.W.to(x.dtype)
        mode = ("row" if is_query else "global") if stabilize and x.dim() >= 2 else None
        if backend != "torch" and self.kind != "positive":
            raise ValueError(f"RandomFeatureMap: backend={backend!r} exists for kind='positive' only, not {self.kind!r}")
        if self.kind == "positive":
            return positive_random_features(x, W, input_scale=self.input_scale, stabilize=mode, backend=backend)
        if self.kind == "hyperbolic":
            return hyperbolic_random_features(x, W, input_scale=self.input_scale, stabilize=mode)
        if self.kind == "trig":
            return trig_softmax_features(x * self.input_scale, W)
        if self.kind == "rff":
            return rff_features(x * self.input_scale, W, self.b.to(x.dtype))
        return clipped_trig_features(x * self.input_scale, W, self.b.to(x.dtype))

    def causal_key_features(self, k: Tensor) -> tuple[Tensor, Tensor]:
        """Key features for causal attention with a running-max stabiliser: (phi_k, log_decay).

        k: (..., T, d). phi_k_j = exp(u_j - m_j) / sqrt(m') with m_t the largest exponent of
        keys 0..t (`running_max_stabiliser`), and log_decay (..., T) the rescaling of the
        state when that maximum grows. `linear_attention(phi_q, phi_k, v,
        log_decay=log_decay)` then equals attention with the raw features phi(k) (for
        eps = 0), token t never sees a later key, and a decoder can keep the same state one
        token at a time. Exponential kinds only ("positive", "hyperbolic"); the others have
        nothing to stabilise and return a zero log-decay.
        """
        self._check_x("RandomFeatureMap.causal_key_features", k)
        if k.dim() < 2:
            raise ValueError(f"RandomFeatureMap.causal_key_features: `k` must be (..., T, d), got {V.describe(k)}")
        if self.kind not in EXPONENTIAL_KINDS:
            phi = self(k, is_query=False, stabilize=False)
            return phi, phi.new_zeros(phi.shape[:-1])
        u, log_decay = running_max_stabiliser(self.exponents(k))
        return torch.exp(u) / math.sqrt(self.out_features), log_decay

    def exponents(self, x: Tensor) -> Tensor:
        """u with features exp(u) / sqrt(out_features), for the exponential kinds.

        Stabilisers act on u: any constant subtracted from u that cancels in the normalised
        output leaves the attention unchanged and keeps exp(u) in range.
        """
        self._check_x("RandomFeatureMap.exponents", x)
        if self.kind not in EXPONENTIAL_KINDS:
            raise ValueError(f"RandomFeatureMap.exponents: kind={self.kind!r} has no exponent; expected one of {EXPONENTIAL_KINDS}")
        W = self.W.to(x.dtype)
        if self.kind == "positive":
            return _positive_exponents(x, W, self.input_scale)
        return _hyperbolic_exponents(x, W, self.input_scale)

    def _check_x(self, fn: str, x) -> None:
        """x: a floating (..., d) tensor with this map's d."""
        V.check_tensor(fn, "x", x)
        if x.dim() == 0 or x.shape[-1] != self.d:
            raise ValueError(f"{fn}: `x` must be laid out as (..., d) with d={self.d}, got {V.describe(x)}")

    def extra_repr(self) -> str:
        """The map's settings, as `print(module)` shows them."""
        return f"d={self.d}, m={self.m}, kind={self.kind!r}, orthogonal={self.orthogonal}"


# ---------------------------------------------------------------------------------------
# Based's second-order Taylor map (deterministic, exact for its polynomial kernel)
# ---------------------------------------------------------------------------------------


def _taylor_scale(fn: str, scale: float | None, d: int) -> float:
    """The temperature of s = scale * q . k: 1/sqrt(d) by default, else a finite number > 0."""
    return d**-0.5 if scale is None else V.check_finite_number(fn, "scale", scale, positive=True)


def taylor_features(x: Tensor, *, scale: float | None = None) -> Tensor:
    """Based's Taylor feature map (Arora et al. 2024): (..., d) -> (..., 1 + d + d^2).

        phi(x) = [1, sqrt(scale) x, scale vec(x x^T) / sqrt(2)],  scale = 1/sqrt(d) by default,

    built so that phi(q) . phi(k) = 1 + s + s^2/2 with s = scale * q . k, the Taylor polynomial
    of exp(s) to second order (for the default scale, the kernel of softmax(q k^T / sqrt(d))).
    The HazyResearch/based `TaylorExp` map is the same: x / d^(1/4) and x x^T / (sqrt(2) sqrt(d)).

    * Deterministic: no random draw, so nothing to redraw and no estimator variance.
    * Exact for its own kernel, and that kernel is positive: 1 + s + s^2/2 = ((1 + s)^2 + 1) / 2
      has its minimum 1/2 at s = -1, so normalised attention never divides by ~0.
    * Only an approximation of exp(s): the error is the Taylor remainder, about s^3/6, so it is
      good for small abs(s) and poor for large ones (Based keeps d small, e.g. 16; its code
      does not normalise q and k). The feature count grows as d^2 (273 for d = 16).

    Only the full d^2 quadratic block is produced (x_i x_j and x_j x_i both appear); the
    symmetric d(d+1)/2 form would give the same kernel with fewer features.
    """
    fn = "taylor_features"
    V.check_tensor(fn, "x", x)
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"{fn}: `x` must be laid out as (..., d) with d >= 1, got {V.describe(x)}")
    scale = _taylor_scale(fn, scale, x.shape[-1])
    quad = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) * (scale / math.sqrt(2.0))
    return torch.cat([torch.ones_like(x[..., :1]), x * math.sqrt(scale), quad], dim=-1)


def taylor_kernel(q: Tensor, k: Tensor, *, scale: float | None = None) -> Tensor:
    """The kernel `taylor_features` computes, in closed form: 1 + s + s^2/2, s = scale q_i . k_j.

    q: (..., n, d), k: (..., p, d) -> (..., n, p); scale = 1/sqrt(d) by default. Always >= 1/2.
    """
    fn = "taylor_kernel"
    for name, t in (("q", q), ("k", k)):
        V.check_tensor(fn, name, t)
        if t.dim() < 2:
            raise ValueError(f"{fn}: `{name}` must be laid out as (..., n, d), at least 2-d, got {V.describe(t)}")
    V.check_same(fn, [("q", q), ("k", k)])
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"{fn}: `k` has d={k.shape[-1]} but `q` has d={q.shape[-1]}; expected one feature size d")
    s = (q @ k.transpose(-1, -2)) * _taylor_scale(fn, scale, q.shape[-1])
    return 1 + s + 0.5 * s * s
