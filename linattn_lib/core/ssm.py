"""State-space models and gated recurrences, seen as linear attention (the texts' chapter 6).

The bridge is one recurrence, S_t = A_t S_{t-1} + k_t v_t^T, o_t = q_t S_t:

* linear attention:      A_t = I,                          q = phi(q), k = phi(k), v = v
* RetNet retention:      A_t = gamma_h I (fixed per head),  no normaliser
* Mamba-2 SSD:           A_t = exp(dt_t A_h) I (scalar, data-dependent),  q = C, k = B, v = dt x
* GLA:                   A_t = diag(exp(g_t)) (a vector gate per key channel)
* Mamba-1:               a diagonal A per (channel, state) pair: no longer a scalar mask
* RWKV-4 WKV:            a per-channel decay-weighted *average* of values (no query)

Scalar decays run through `linear_attention(..., log_decay=...)`; the vector-gated and
per-channel cases get their own small references here, each in forms that the tests
check against each other. Everything is float64-capable and differentiable.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import _validate as V
from .linear import linear_attention
from .masks import segsum
from .reference import FORMS
from .state import LinearAttentionState, expand_log_decay, sum_after

DISCRETIZATIONS = ("zoh", "mamba")
WKV_FORMS = ("recurrent", "quadratic", "naive")


# --------------------------------------------------------------------------------------
# Mamba-2 SSD = causal linear attention with a scalar decay
# --------------------------------------------------------------------------------------


def _check_unnormalized_state(fn: str, state, *, B: int, H: int, Dk: int, Dv: int, device) -> None:
    """`initial_state` = LinearAttentionState(S (B, H, Dk, Dv), None): finite, on `device`, no z.

    These recurrences have no normaliser, so a z would be ignored: refuse it instead (it is
    the sign of a state from a normalised `linear_attention` call).
    """
    V.check_state(fn, "initial_state", state, B=B, H=H, Dk=Dk, Dv=Dv, device=device, normalize=False)
    if state[1] is not None:
        raise ValueError(
            f"{fn}: `initial_state.z` must be None (this recurrence has no normaliser), got "
            f"{V.describe(state[1]) if isinstance(state[1], Tensor) else type(state[1]).__name__}"
        )


def _check_ssd_inputs(fn: str, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor) -> None:
    V.check_layout(fn, "x", x, ("B", "H", "T", "P"))
    batch, H, T, _ = x.shape
    if T == 0:
        raise ValueError(f"{fn}: sequence length T must be at least 1, got `x` with {V.describe(x)}")
    V.check_shape(fn, "dt", dt, (batch, H, T), ("B", "H", "T"))
    V.check_shape(fn, "A", A, (H,), ("H",))
    V.check_layout(fn, "B", B, ("B", "H", "T", "N"))
    V.check_shape(fn, "B", B, (batch, H, T, B.shape[-1]), ("B", "H", "T", "N"))
    V.check_shape(fn, "C", C, tuple(B.shape), ("B", "H", "T", "N"))
    V.check_same(fn, [("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)])
    V.check_values(fn, "dt", dt, low=0.0, strict=True, why="a step size; Mamba uses softplus(.) > 0")
    V.check_values(fn, "A", A, high=0.0, why="the continuous-time decay rate; a_t = exp(dt A) must be <= 1")


def ssd(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    form: str = "chunked",
    chunk_size: int = 64,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
) -> Tensor | tuple[Tensor, LinearAttentionState]:
    """Mamba-2's state-space dual (SSD) layer, computed as linear attention with decay.

        h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t^T,    y_t = C_t^T h_t

    is causal, unnormalised linear attention with q = C, k = B, v = dt x and
    log_decay = dt A (Dao & Gu 2024): (C, B, x) plays (Q, K, V) and only the decay is new.

    Args:
        x: (B, H, T, P) inputs, P channels per head.
        dt: (B, H, T) step sizes, > 0 (softplus outputs in Mamba).
        A: (H,) decay rates, <= 0 (Mamba uses A = -exp(A_log) < 0; A = 0 removes the decay and
            leaves plain causal unnormalised linear attention, errata A31).
        B, C: (B, H, T, N) input and output projections (N = state size). Mamba-2 shares B, C
            across the heads of a group: expand them to H heads first.
        form: "quadratic" (the semiseparable matrix), "recurrent" or "chunked".
        initial_state / return_state: the state h as a LinearAttentionState(S of shape
            (B, H, N, P), z=None), as in `linear_attention`.

    Returns y of shape (B, H, T, P) (and the final state when return_state=True). Mamba's skip
    term D x is not included.
    """
    fn = "ssd"
    _check_ssd_inputs(fn, x, dt, A, B, C)
    V.check_choice(fn, "form", form, FORMS)
    V.check_positive_int(fn, "chunk_size", chunk_size)
    return_state = V.check_flag(fn, "return_state", return_state)
    if initial_state is not None:
        batch, H, _, P = x.shape
        _check_unnormalized_state(fn, initial_state, B=batch, H=H, Dk=B.shape[-1], Dv=P, device=x.device)
    return linear_attention(
        C, B, x * dt.unsqueeze(-1), causal=True, normalize=False, log_decay=dt * A.view(1, -1, 1),
        form=form, chunk_size=chunk_size, initial_state=initial_state, return_state=return_state,
    )


def semiseparable_matrix(C: Tensor, B: Tensor, log_a: Tensor) -> Tensor:
    """SSD's (B, H, T, T) sequence-mixing matrix M = tril(C B^T) o exp(segsum(log a)).

    M_ij = C_i . B_j * a_{j+1} ... a_i for j <= i, so y = M (dt x). Every block below the
    diagonal has rank <= N, which is what "semiseparable" means; with log a = 0 it is
    tril(Q K^T), causal linear attention's matrix.

    Args:
        C, B: (B, H, T, N).
        log_a: (B, H, T) per-token or (H,) per-head log decay, <= 0 (for SSD: dt * A).
    """
    fn = "semiseparable_matrix"
    V.check_layout(fn, "C", C, ("B", "H", "T", "N"))
    V.check_shape(fn, "B", B, tuple(C.shape), ("B", "H", "T", "N"))
    V.check_tensor(fn, "log_a", log_a)
    batch, H, T, _ = C.shape
    if tuple(log_a.shape) not in ((H,), (batch, H, T)):
        raise ValueError(
            f"{fn}: `log_a` has shape {tuple(log_a.shape)}; expected (H,) = ({H},) or (B, H, T) = {(batch, H, T)}"
        )
    V.check_same(fn, [("C", C), ("B", B), ("log_a", log_a)])
    V.check_values(fn, "log_a", log_a, high=0.0, why="a decay factor a = exp(log_a) in (0, 1]")
    g = expand_log_decay(log_a, batch, H, T, dtype=C.dtype, device=C.device)
    return (C @ B.transpose(-1, -2)) * torch.exp(segsum(g))  # exp(-inf) = 0 above the diagonal


# --------------------------------------------------------------------------------------
# discretisation and the Mamba-1 style selective scan
# --------------------------------------------------------------------------------------


def _expm1_over_x(x: Tensor) -> Tensor:
    """(exp(x) - 1) / x, equal to 1 at x = 0, accurate and with the right gradient near 0.

    expm1 keeps full relative precision for small x, but x = 0 itself is 0/0; there the
    Taylor series 1 + x/2 + x^2/6 + x^3/24 (error < x^4/100) takes over.
    """
    small = x.abs() < 1e-4
    x_safe = torch.where(small, torch.ones_like(x), x)
    series = 1 + x * (1 / 2 + x * (1 / 6 + x / 24))
    return torch.where(small, series, torch.expm1(x_safe) / x_safe)


def zoh_discretize(A: Tensor, B: Tensor, dt: Tensor, *, method: str = "zoh") -> tuple[Tensor, Tensor]:
    """Discretise dh/dt = A h + B u with a diagonal A over a step dt: returns (A_bar, B_bar).

    Zero-order hold (u constant over the step)::

        A_bar = exp(dt A),
        B_bar = (dt A)^{-1} (exp(dt A) - I) dt B = expm1(dt A) / A * B,

    computed with expm1 so that it stays exact as dt A -> 0, where B_bar -> dt B.
    method="mamba" gives Mamba's simplification B_bar = dt B (what its kernels and SSD use);
    the two agree to first order in dt A.

    Args:
        A: (..., N) diagonal entries of the continuous state matrix (real; < 0 is stable).
        B: (..., N) input vector(s), the same shape as A.
        dt: (...) step sizes > 0, one per state vector: shape A.shape[:-1].
    """
    fn = "zoh_discretize"
    V.check_tensor(fn, "A", A)
    V.check_tensor(fn, "B", B)
    V.check_tensor(fn, "dt", dt)
    if A.dim() == 0:
        raise ValueError(f"{fn}: `A` must have a last axis N (the diagonal), got a 0-d tensor")
    V.check_same_shape(fn, [("A", A), ("B", B)])
    if tuple(dt.shape) != tuple(A.shape[:-1]):
        raise ValueError(
            f"{fn}: `dt` has shape {tuple(dt.shape)}; expected A.shape[:-1] = {tuple(A.shape[:-1])} "
            "(one step size per state vector)"
        )
    V.check_same(fn, [("A", A), ("B", B), ("dt", dt)])
    V.check_choice(fn, "method", method, DISCRETIZATIONS)
    V.check_values(fn, "A", A)
    V.check_values(fn, "dt", dt, low=0.0, strict=True, why="a step size")
    dtA = dt.unsqueeze(-1) * A
    A_bar = torch.exp(dtA)
    dtB = dt.unsqueeze(-1) * B
    B_bar = dtB if method == "mamba" else _expm1_over_x(dtA) * dtB
    return A_bar, B_bar


def _check_scan_inputs(fn: str, x, dt, A, B, C) -> None:
    V.check_layout(fn, "x", x, ("B", "H", "T", "P"))
    batch, H, T, P = x.shape
    if T == 0:
        raise ValueError(f"{fn}: sequence length T must be at least 1, got `x` with {V.describe(x)}")
    V.check_layout(fn, "B", B, ("B", "H", "T", "N"))
    N = B.shape[-1]
    V.check_shape(fn, "B", B, (batch, H, T, N), ("B", "H", "T", "N"))
    V.check_shape(fn, "C", C, (batch, H, T, N), ("B", "H", "T", "N"))
    V.check_tensor(fn, "dt", dt)
    if tuple(dt.shape) not in ((batch, H, T), (batch, H, T, P)):
        raise ValueError(
            f"{fn}: `dt` has shape {tuple(dt.shape)}; expected (B, H, T) = {(batch, H, T)} per head "
            f"or (B, H, T, P) = {(batch, H, T, P)} per channel"
        )
    V.check_tensor(fn, "A", A)
    if tuple(A.shape) not in ((H,), (H, P, N)):
        raise ValueError(
            f"{fn}: `A` has shape {tuple(A.shape)}; expected (H,) = ({H},) (Mamba-2) or "
            f"(H, P, N) = {(H, P, N)} (Mamba-1: one diagonal per channel)"
        )
    V.check_same(fn, [("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C)])
    V.check_values(fn, "dt", dt, low=0.0, strict=True, why="a step size")
    V.check_values(fn, "A", A, high=0.0, why="a decay rate; exp(dt A) must be <= 1")


def selective_scan_reference(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    discretization: str = "mamba",
    initial_state: Tensor | None = None,
    return_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """A token-by-token diagonal selective SSM (Mamba-1 style), the slow ground truth.

        h_t = A_bar_t o h_{t-1} + B_bar_t x_t,    y_t = h_t C_t

    with a state h of shape (P, N) per head: every input channel p has its own N-dim state and,
    with A of shape (H, P, N), its own diagonal decay -- more general than SSD, whose decay is
    one scalar per head and step. A of shape (H,) and dt of shape (B, H, T) give exactly SSD.

    Args:
        x: (B, H, T, P); dt: (B, H, T) or (B, H, T, P), > 0; A: (H,) or (H, P, N), <= 0;
        B, C: (B, H, T, N).
        discretization: "mamba" (B_bar = dt B, as Mamba's `selective_scan_ref` and SSD) or
            "zoh" (exact zero-order hold, see `zoh_discretize`).
        initial_state: h_0 of shape (B, H, P, N), zeros by default.

    Returns y of shape (B, H, T, P) (and h_T when return_state=True).
    """
    fn = "selective_scan_reference"
    _check_scan_inputs(fn, x, dt, A, B, C)
    V.check_choice(fn, "discretization", discretization, DISCRETIZATIONS)
    return_state = V.check_flag(fn, "return_state", return_state)
    batch, H, T, P = x.shape
    N = B.shape[-1]
    h = x.new_zeros(batch, H, P, N)
    if initial_state is not None:
        V.check_shape(fn, "initial_state", initial_state, (batch, H, P, N), ("B", "H", "P", "N"))
        if initial_state.device != x.device:
            raise ValueError(f"{fn}: `initial_state` is on {initial_state.device} but `x` is on {x.device}")
        V.check_values(fn, "initial_state", initial_state)
        h = initial_state.to(x.dtype)
    # bring everything to one (B, H, T, P, N) grid: a state entry per (channel p, state n)
    dt_full = dt if dt.dim() == 4 else dt.unsqueeze(-1).expand(batch, H, T, P)
    A_full = (A.view(1, H, 1, 1, 1) if A.dim() == 1 else A.view(1, H, 1, P, N)).expand(batch, H, T, P, N)
    B_full = B.unsqueeze(3).expand(batch, H, T, P, N)
    A_bar, B_bar = zoh_discretize(A_full, B_full, dt_full, method=discretization)
    ys = []
    for t in range(T):
        h = A_bar[:, :, t] * h + B_bar[:, :, t] * x[:, :, t, :, None]
        ys.append(h @ C[:, :, t, :, None])
    y = torch.cat(ys, dim=-1).transpose(-1, -2)  # (B, H, T, P)
    return (y, h) if return_state else y


# --------------------------------------------------------------------------------------
# RetNet and GLA
# --------------------------------------------------------------------------------------


def retnet_log_decay(
    H: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
) -> Tensor:
    """RetNet's fixed per-head log decay log(gamma_h) = log(1 - 2^(-5-h)), h = 0..H-1, shape (H,).

    Data-independent: head 0 forgets fastest (gamma = 31/32), later heads ever more slowly
    (errata B8). Same values as fla's `g_gamma`. Pass it as `linear_attention(...,
    log_decay=retnet_log_decay(H), normalize=False)`.
    """
    V.check_positive_int("retnet_log_decay", "H", H)
    V.check_dtype("retnet_log_decay", "dtype", dtype)
    h = torch.arange(H, dtype=torch.float64, device=device)
    return torch.log1p(-torch.exp2(-5.0 - h)).to(dtype)


def _check_gla_inputs(fn: str, q: Tensor, k: Tensor, v: Tensor, log_gates: Tensor) -> None:
    V.check_qkv(fn, q, k, v)
    V.check_shape(fn, "log_gates", log_gates, tuple(k.shape), ("B", "H", "T", "Dk"))
    V.check_same(fn, [("q", q), ("log_gates", log_gates)])
    V.check_values(fn, "log_gates", log_gates, high=0.0, why="a gate exp(g) in (0, 1]")
    V.check_all_finite(fn, (("q", q), ("k", k), ("v", v)))


def _gla_block(q: Tensor, k: Tensor, v: Tensor, g: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    """GLA over one block of tokens that starts from state S: (outputs, state at the block end).

    With G = cumsum(g) inside the block, o_i = sum_{j<=i} sum_d q_id k_jd exp(G_id - G_jd) v_j
    + (q_i o exp(G_i)) S. The decay differs per key channel d, so the mask is a (Dk, T, T)
    stack of segment sums, one per channel; every exponent is <= 0.
    """
    L = torch.exp(segsum(g.transpose(-1, -2)))  # (B, H, Dk, T, T)
    A = torch.einsum("bhid,bhjd,bhdij->bhij", q, k, L)
    G = torch.cumsum(g, dim=-2)
    out = A @ v + (q * torch.exp(G)) @ S
    G_end = G[..., -1:, :]
    # g_{j+1} + ... + g_end, summed from j + 1 on (not G_end - G_j: see core/state.py)
    k_to_end = k * torch.exp(sum_after(g.transpose(-1, -2))).transpose(-1, -2)
    S = torch.exp(G_end).transpose(-1, -2) * S + k_to_end.transpose(-1, -2) @ v
    return out, S


def _gla_recurrent(q, k, v, g, S):
    outs = []
    for t in range(q.shape[2]):
        S = torch.exp(g[:, :, t]).unsqueeze(-1) * S + k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append((q[:, :, t, :, None] * S).sum(-2))
    return torch.stack(outs, dim=2), S


def _gla_chunked(q, k, v, g, S, chunk_size):
    outs = []
    for start in range(0, q.shape[2], chunk_size):
        piece = slice(start, start + chunk_size)
        out, S = _gla_block(q[:, :, piece], k[:, :, piece], v[:, :, piece], g[:, :, piece], S)
        outs.append(out)
    return torch.cat(outs, dim=2), S


def gla_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    log_gates: Tensor,
    *,
    form: str = "chunked",
    chunk_size: int = 64,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
) -> Tensor | tuple[Tensor, LinearAttentionState]:
    """Gated linear attention (Yang et al., ICML 2024) with a data-dependent *vector* gate.

        S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T,    o_t = q_t S_t

    Unlike RetNet/SSD's scalar decay, each key channel forgets at its own rate, so the decay
    cannot be a single (T, T) mask; see `_gla_block`. No normaliser and no q scaling (fla's
    default scale Dk^-0.5 is the caller's choice here).

    Args:
        q, k: (B, H, T, Dk); v: (B, H, T, Dv); log_gates: (B, H, T, Dk), <= 0.
        form: "recurrent" (token loop), "quadratic" (one block) or "chunked" (blocks of
            `chunk_size`, the state carried between them); all three agree.
        initial_state / return_state: LinearAttentionState(S of shape (B, H, Dk, Dv), z=None).
    """
    fn = "gla_attention"
    _check_gla_inputs(fn, q, k, v, log_gates)
    V.check_choice(fn, "form", form, FORMS)
    V.check_positive_int(fn, "chunk_size", chunk_size)
    return_state = V.check_flag(fn, "return_state", return_state)
    batch, H, T, Dk = q.shape
    S = q.new_zeros(batch, H, Dk, v.shape[-1])
    if initial_state is not None:
        _check_unnormalized_state(fn, initial_state, B=batch, H=H, Dk=Dk, Dv=v.shape[-1], device=q.device)
        S = initial_state[0].to(q.dtype)
    if form == "recurrent":
        o, S = _gla_recurrent(q, k, v, log_gates, S)
    elif form == "quadratic":
        o, S = _gla_block(q, k, v, log_gates, S)
    else:
        o, S = _gla_chunked(q, k, v, log_gates, S, chunk_size)
    return (o, LinearAttentionState(S, None)) if return_state else o


# --------------------------------------------------------------------------------------
# RWKV-4 WKV
# --------------------------------------------------------------------------------------


def _check_wkv_inputs(fn: str, w: Tensor, u: Tensor, k: Tensor, v: Tensor) -> None:
    V.check_layout(fn, "k", k, ("B", "T", "C"))
    if k.shape[1] == 0:
        raise ValueError(f"{fn}: sequence length T must be at least 1, got `k` with {V.describe(k)}")
    V.check_shape(fn, "v", v, tuple(k.shape), ("B", "T", "C"))
    channels = k.shape[-1]
    V.check_shape(fn, "w", w, (channels,), ("C",))
    V.check_shape(fn, "u", u, (channels,), ("C",))
    V.check_same(fn, [("k", k), ("v", v), ("w", w), ("u", u)])
    V.check_values(fn, "w", w, low=0.0, why="a decay rate: past tokens are weighted by exp(-w) per step")
    V.check_values(fn, "u", u)
    V.check_values(fn, "k", k)


def _wkv_quadratic(w: Tensor, u: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """wkv_t = softmax_i(logit_ti) . v_i per channel, logit_ti = -(t-1-i) w + k_i (i < t), u + k_t (i = t).

    The WKV average *is* a softmax over positions of decayed keys, so torch.softmax's max
    subtraction makes it stable for any k.
    """
    T = k.shape[1]
    t = torch.arange(T, device=k.device)
    age = (t[:, None] - 1 - t[None, :]).to(k.dtype)  # (T, T): t - 1 - i
    logits = -age[..., None] * w + k[:, None, :, :]  # (B, T, T, C), [b, t, i, c]
    diag = torch.eye(T, dtype=torch.bool, device=k.device)[..., None]
    logits = torch.where(diag, (u + k)[:, None, :, :], logits)
    future = torch.ones(T, T, dtype=torch.bool, device=k.device).triu(1)[..., None]
    logits = logits.masked_fill(future, float("-inf"))
    return torch.einsum("btic,bic->btc", torch.softmax(logits, dim=2), v)


def _wkv_recurrent(w: Tensor, u: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The RWKV-4 CUDA kernel's loop: numerator a and denominator b stored scaled by exp(-p).

    p is the running maximum exponent, so every exp() below has an argument <= 0.
    """
    batch, T, channels = k.shape
    a = torch.zeros(batch, channels, dtype=k.dtype, device=k.device)
    b = torch.zeros_like(a)
    p = torch.full_like(a, float("-inf"))  # nothing seen yet
    outs = []
    for t in range(T):
        kt, vt = k[:, t], v[:, t]
        bonus = u + kt  # the current token's exponent
        m = torch.maximum(p, bonus)
        e_past, e_now = torch.exp(p - m), torch.exp(bonus - m)
        outs.append((e_past * a + e_now * vt) / (e_past * b + e_now))
        decayed = p - w  # one more step of decay for the past
        m = torch.maximum(decayed, kt)
        e_past, e_now = torch.exp(decayed - m), torch.exp(kt - m)
        a, b, p = e_past * a + e_now * vt, e_past * b + e_now, m
    return torch.stack(outs, dim=1)


def _wkv_naive(w: Tensor, u: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The same loop without the running maximum: exp(k) overflows for large k (for teaching)."""
    a = torch.zeros_like(k[:, 0])
    b = torch.zeros_like(a)
    outs = []
    for t in range(k.shape[1]):
        kt, vt = k[:, t], v[:, t]
        outs.append((a + torch.exp(u + kt) * vt) / (b + torch.exp(u + kt)))
        a = torch.exp(-w) * a + torch.exp(kt) * vt
        b = torch.exp(-w) * b + torch.exp(kt)
    return torch.stack(outs, dim=1)


def rwkv4_wkv(w: Tensor, u: Tensor, k: Tensor, v: Tensor, *, form: str = "recurrent") -> Tensor:
    """RWKV-4's WKV operator (Peng et al., Findings of EMNLP 2023), per channel c:

        wkv_t = (sum_{i<t} e^{-(t-1-i) w + k_i} v_i + e^{u + k_t} v_t)
              / (sum_{i<t} e^{-(t-1-i) w + k_i}     + e^{u + k_t})

    a decay-weighted *average* of past values with a bonus u for the current token. There is
    no query: in the full layer the output is sigmoid(r_t) o wkv_t, where the receptance r_t
    is an output gate, not a query (errata B10).

    Args:
        w: (C,) decay rates >= 0 (RWKV stores time_decay with w = exp(time_decay)).
        u: (C,) bonus of the current token ("time_first").
        k, v: (B, T, C) -- RWKV's own layout, no heads.
        form: "recurrent" (the CUDA kernel's running-max loop, stable), "quadratic" (a masked
            softmax over positions, stable) or "naive" (the loop without the max; overflows to
            NaN once exp(k) does -- kept to show why the max is needed).
    Returns wkv of shape (B, T, C).
    """
    fn = "rwkv4_wkv"
    _check_wkv_inputs(fn, w, u, k, v)
    V.check_choice(fn, "form", form, WKV_FORMS)
    impl = {"recurrent": _wkv_recurrent, "quadratic": _wkv_quadratic, "naive": _wkv_naive}[form]
    return impl(w, u, k, v)


# --------------------------------------------------------------------------------------
# RWKV-5/6 (Eagle/Finch): a matrix state read by the receptance as a query
# --------------------------------------------------------------------------------------

RWKV6_FORMS = ("recurrent", "parallel")


def _check_rwkv6_inputs(fn: str, r: Tensor, k: Tensor, v: Tensor, log_w: Tensor, u: Tensor) -> None:
    V.check_layout(fn, "r", r, ("B", "H", "T", "Dk"))
    batch, H, T, Dk = r.shape
    if T == 0:
        raise ValueError(f"{fn}: sequence length T must be at least 1, got `r` with {V.describe(r)}")
    V.check_shape(fn, "k", k, tuple(r.shape), ("B", "H", "T", "Dk"))
    V.check_layout(fn, "v", v, ("B", "H", "T", "Dv"))
    V.check_shape(fn, "v", v, (batch, H, T, v.shape[-1]), ("B", "H", "T", "Dv"))
    V.check_tensor(fn, "log_w", log_w)
    if tuple(log_w.shape) not in ((batch, H, T, Dk), (H, Dk)):
        raise ValueError(
            f"{fn}: `log_w` has shape {tuple(log_w.shape)}; expected (B, H, T, Dk) = {(batch, H, T, Dk)} "
            f"per token (RWKV-6) or (H, Dk) = {(H, Dk)} constant (RWKV-5)"
        )
    V.check_shape(fn, "u", u, (H, Dk), ("H", "Dk"))
    V.check_same(fn, [("r", r), ("k", k), ("v", v), ("log_w", log_w), ("u", u)])
    V.check_all_finite(fn, (("r", r), ("k", k), ("v", v)))
    V.check_values(fn, "log_w", log_w, high=0.0, why="the log of a decay w in (0, 1]")
    V.check_values(fn, "u", u)


def _rwkv6_recurrent(r, k, v, g, u, S):
    outs = []
    for t in range(r.shape[2]):
        kv = k[:, :, t, :, None] * v[:, :, t, None, :]  # (B, H, Dk, Dv)
        outs.append((r[:, :, t, :, None] * (S + u[..., None] * kv)).sum(-2))  # reads S_{t-1}
        S = torch.exp(g[:, :, t]).unsqueeze(-1) * S + kv
    return torch.stack(outs, dim=2), S


def _rwkv6_parallel(r, k, v, g, u, S):
    """o_i = sum_{j<i} sum_c r_ic k_jc exp(g_{j+1,c} + ... + g_{i-1,c}) v_j + (r_i o u) . k_i v_i + decayed S_0.

    segsum(g)[i, j] sums g_{j+1..i}; the read at step i needs g_{j+1..i-1} = segsum(g)[i-1, j],
    so the per-channel (T, T) masks are shifted down one row (row 0 is all -inf: no past yet).
    Every exponent is an interval sum of terms <= 0 (the numerics rule of core/state.py).
    """
    gt = g.transpose(-1, -2)  # (B, H, Dk, T)
    D = torch.nn.functional.pad(segsum(gt)[..., :-1, :], (0, 0, 1, 0), value=float("-inf"))
    A = torch.einsum("bhic,bhjc,bhcij->bhij", r, k, torch.exp(D))
    bonus = (r * u.unsqueeze(1) * k).sum(-1, keepdim=True) * v
    before = torch.nn.functional.pad(torch.cumsum(g[:, :, :-1], dim=2), (0, 0, 1, 0))  # g_0 + ... + g_{i-1}
    out = A @ v + bonus + (r * torch.exp(before)) @ S
    k_to_end = k * torch.exp(sum_after(gt)).transpose(-1, -2)  # g_{j+1} + ... + g_{T-1}
    S = torch.exp(gt.sum(-1)).unsqueeze(-1) * S + k_to_end.transpose(-1, -2) @ v
    return out, S


def rwkv6_attention(
    r: Tensor,
    k: Tensor,
    v: Tensor,
    log_w: Tensor,
    u: Tensor,
    *,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
    form: str = "recurrent",
) -> Tensor | tuple[Tensor, LinearAttentionState]:
    """The WKV of RWKV-5 "Eagle" and RWKV-6 "Finch" (Peng et al. 2024): a matrix state per head.

        o_t = r_t^T (diag(u) k_t v_t^T + S_{t-1}),    S_t = diag(w_t) S_{t-1} + k_t v_t^T

    The receptance r_t reads the state as a query does (RWKV-4's WKV, `rwkv4_wkv`, is a ratio
    with no query). Two differences from GLA (`gla_attention`): the read happens *before* the
    current token enters (S_{t-1}, not S_t), and the current token comes in through its own
    bonus u instead. So the decay between tokens j < i is w_{j+1} ... w_{i-1}.

    Against `linear_attention(q, k, v, causal=True, normalize=False, log_decay=g)`, which reads
    S_t: with u = 0 and one decay for all channels (log_w[..., c] = g), both carry the same
    state S_t, so RWKV's o_t is linear attention's output at t - 1 with the query r_t moved to
    t - 1 (and o_0 = r_0 S_init); equivalently, shift k, v and g one token later.

    Args:
        r, k: (B, H, T, Dk); v: (B, H, T, Dv).
        log_w: log of the decay, <= 0: (B, H, T, Dk) per token (Finch: log w_t = -exp(d_t)),
            or (H, Dk) constant (Eagle).
        u: (H, Dk), the bonus of the current token ("time_first").
        initial_state / return_state: LinearAttentionState(S of shape (B, H, Dk, Dv), z=None).
        form: "recurrent" (the token loop) or "parallel" (quadratic, per-channel masks).

    No scaling of r (fla's default Dk^-0.5 is the caller's choice), no gate, no GroupNorm.
    """
    fn = "rwkv6_attention"
    _check_rwkv6_inputs(fn, r, k, v, log_w, u)
    V.check_choice(fn, "form", form, RWKV6_FORMS)
    return_state = V.check_flag(fn, "return_state", return_state)
    batch, H, T, Dk = r.shape
    g = log_w.view(1, H, 1, Dk).expand(batch, H, T, Dk) if log_w.dim() == 2 else log_w
    S = r.new_zeros(batch, H, Dk, v.shape[-1])
    if initial_state is not None:
        _check_unnormalized_state(fn, initial_state, B=batch, H=H, Dk=Dk, Dv=v.shape[-1], device=r.device)
        S = initial_state[0].to(r.dtype)
    impl = _rwkv6_recurrent if form == "recurrent" else _rwkv6_parallel
    o, S = impl(r, k, v, g, u, S)
    return (o, LinearAttentionState(S, None)) if return_state else o
