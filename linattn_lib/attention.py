"""Softmax attention and linear attention: the exact reference implementations.

Layout everywhere is (B, H, T, D), as in `torch.nn.functional.scaled_dot_product_attention`.

`linear_attention` takes *features*: the caller applies the feature map phi to queries and keys
first. With a log-decay g (<= 0) the causal recurrence it computes is

    S_t = exp(g_t) S_{t-1} + k_t v_t^T          (state, Dk x Dv)
    z_t = exp(g_t) z_{t-1} + k_t                (normaliser state, Dk)
    o_t = q_t S_t / (q_t . z_t + eps)           (or q_t S_t when normalize=False)

and without a decay g = 0. Three forms compute it:

* ``"quadratic"`` materialises the T x T matrix (q k^T) * L with the decay mask L,
* ``"recurrent"`` runs the loop above token by token (the RNN view),
* ``"chunked"`` splits T into chunks: masked matmuls inside a chunk, the state between chunks.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _validate as V
from .masks import segsum

FORMS = ("quadratic", "recurrent", "chunked")
BACKENDS = ("auto", "torch", "triton")
DEFAULT_EPS = 1e-6  # as in Katharopoulos et al.'s fast-transformers: added to the denominator


class LinearAttentionState(NamedTuple):
    """Recurrent state of causal linear attention.

    S: (B, H, Dk, Dv), the running sum of decayed outer products k_j v_j^T.
    z: (B, H, Dk), the running sum of decayed keys (None when normalize=False).
    """

    S: Tensor
    z: Optional[Tensor] = None


# --------------------------------------------------------------------------------------
# softmax attention
# --------------------------------------------------------------------------------------


def softmax_attention_weights(q: Tensor, k: Tensor, *, causal: bool = False, scale: Optional[float] = None) -> Tensor:
    """The (B, H, T, T) matrix softmax(q k^T * scale) (rows sum to one; causal masks j > i)."""
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


def softmax_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: Optional[float] = None) -> Tensor:
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


# --------------------------------------------------------------------------------------
# linear attention
# --------------------------------------------------------------------------------------


def _check_finite(fn: str, named) -> None:
    """Refuse NaN and inf in q, k, v.

    In the chunked and quadratic forms a value at position t meets the causal mask's zeros
    in a matmul (0 * NaN = NaN) and would poison outputs *before* t, which the recurrent
    form keeps; so every form refuses it instead, naming the first position. (Finite
    garbage, e.g. in right-padding, is harmless: masks select, they do not multiply.)
    """
    for name, x in named:
        bad = ~torch.isfinite(x)
        if bad.any():
            where = tuple(int(i) for i in bad.nonzero()[0])
            value = x[where].item()
            raise ValueError(
                f"{fn}: `{name}` has a non-finite value ({value}) at index {where} ({V.describe(x)}); "
                "expected finite values (pad with zeros, not NaN or inf)"
            )


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def expand_log_decay(log_decay: Optional[Tensor], B: int, H: int, T: int, *, dtype, device) -> Tensor:
    """(H,) or (B, H, T) log-decay as a (B, H, T) tensor; zeros when there is no decay."""
    if log_decay is None:
        return torch.zeros(B, H, T, dtype=dtype, device=device)
    g = log_decay.to(dtype)
    if g.dim() == 1:
        g = g.view(1, H, 1).expand(B, H, T)
    return g


def _finish(num: Tensor, den: Optional[Tensor], eps: float) -> Tensor:
    return num if den is None else num / (den.unsqueeze(-1) + eps)


def _init_state(q: Tensor, v: Tensor, state: Optional[LinearAttentionState], normalize: bool, dtype):
    B, H, _, Dk = q.shape
    Dv = v.shape[-1]
    if state is None:
        S = q.new_zeros(B, H, Dk, Dv, dtype=dtype)
        z = q.new_zeros(B, H, Dk, dtype=dtype) if normalize else None
    else:
        S = state.S.to(dtype)
        z = state.z.to(dtype) if normalize else None
    return S, z


def _noncausal(q, k, v, S, z, normalize, eps):
    S = S + k.transpose(-1, -2) @ v
    num = q @ S
    den = None
    if normalize:
        z = z + k.sum(-2)
        den = (q * z.unsqueeze(-2)).sum(-1)
    return _finish(num, den, eps), LinearAttentionState(S, z)


def _sum_after(g: Tensor) -> Tensor:
    """g_{j+1} + ... + g_last for every j (0 at the last position), along the last axis.

    Summed from j + 1 on, not taken as cumsum(g)[-1] - cumsum(g)[j]: after one huge step (a
    reset, g = -1e4) that difference of two large prefix sums keeps only about 1e-3 of
    absolute precision in float32, the same trap `segsum` avoids for the mask.
    """
    return F.pad(g.flip(-1).cumsum(-1).flip(-1)[..., 1:], (0, 1))


def _masked_scores(q: Tensor, k: Tensor, g: Tensor) -> Tensor:
    """(q k^T) * L with the decay mask L = exp(segsum(g)), zero above the diagonal.

    The upper triangle is *selected* away, not multiplied by L's zeros: a future key whose
    score is inf would otherwise give inf * 0 = NaN in an earlier row.
    """
    T = q.shape[-2]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return torch.where(causal, (q @ k.transpose(-1, -2)) * torch.exp(segsum(g)), 0.0)


def _quadratic(q, k, v, g, S0, z0, causal, normalize, eps):
    """(q k^T * L) v plus the decayed contribution of the initial state."""
    if not causal:
        return _noncausal(q, k, v, S0, z0, normalize, eps)
    A = _masked_scores(q, k, g)
    cg = torch.cumsum(g, dim=-1)  # decay of the initial state up to position i
    q0 = q * torch.exp(cg).unsqueeze(-1)
    num = A @ v + q0 @ S0
    den = (A.sum(-1) + (q0 * z0.unsqueeze(-2)).sum(-1)) if normalize else None
    # final state: every key decayed to the end, plus the decayed initial state
    to_end = torch.exp(_sum_after(g)).unsqueeze(-1)  # exp(g_{j+1} + ... + g_T) <= 1
    total = torch.exp(cg[..., -1]).unsqueeze(-1)
    S = total.unsqueeze(-1) * S0 + (k * to_end).transpose(-1, -2) @ v
    z = (total * z0 + (k * to_end).sum(-2)) if normalize else None
    return _finish(num, den, eps), LinearAttentionState(S, z)


def _recurrent(q, k, v, g, S, z, causal, normalize, eps):
    """The RNN view: one state update and one readout per token."""
    if not causal:
        for t in range(q.shape[2]):
            S = S + k[:, :, t, :, None] * v[:, :, t, None, :]
            if normalize:
                z = z + k[:, :, t]
        num = q @ S
        den = (q * z.unsqueeze(-2)).sum(-1) if normalize else None
        return _finish(num, den, eps), LinearAttentionState(S, z)
    outs, dens = [], []
    for t in range(q.shape[2]):
        a = torch.exp(g[:, :, t])[..., None]  # (B, H, 1)
        S = a.unsqueeze(-1) * S + k[:, :, t, :, None] * v[:, :, t, None, :]
        outs.append((q[:, :, t, :, None] * S).sum(-2))
        if normalize:
            z = a * z + k[:, :, t]
            dens.append((q[:, :, t] * z).sum(-1))
    num = torch.stack(outs, dim=2)
    den = torch.stack(dens, dim=2) if normalize else None
    return _finish(num, den, eps), LinearAttentionState(S, z)


def _chunked(q, k, v, g, S, z, causal, normalize, eps, chunk_size):
    """Chunkwise-parallel form: intra-chunk masked matmuls, inter-chunk state passing.

    Every exponent is a sum of log-decays over a forward interval, hence <= 0: nothing overflows.
    """
    if not causal:
        return _noncausal(q, k, v, S, z, normalize, eps)
    B, H, T, Dk = q.shape
    C = chunk_size
    pad = (-T) % C
    if pad:  # zero keys add nothing to the state and g = 0 does not decay it
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g = F.pad(g, (0, pad))
    N = q.shape[2] // C
    qc, kc, vc = (x.reshape(B, H, N, C, x.shape[-1]) for x in (q, k, v))
    gc = torch.cumsum(g.reshape(B, H, N, C), dim=-1)  # decay from the chunk start, <= 0
    # intra-chunk: (q k^T * L) v with L = exp(gc_i - gc_j) on and below the diagonal
    A = _masked_scores(qc, kc, g.reshape(B, H, N, C))
    num = A @ vc
    den = A.sum(-1) if normalize else None
    q_in = qc * torch.exp(gc).unsqueeze(-1)  # queries see the chunk-entry state decayed by gc_i
    k_out = kc * torch.exp(_sum_after(g.reshape(B, H, N, C))).unsqueeze(-1)  # keys decayed to the chunk end
    total = torch.exp(gc[..., -1])  # (B, H, N): decay across a whole chunk
    inter_num, inter_den = [], []
    for n in range(N):
        inter_num.append(q_in[:, :, n] @ S)
        if normalize:
            inter_den.append((q_in[:, :, n] * z.unsqueeze(-2)).sum(-1))
            z = total[:, :, n, None] * z + k_out[:, :, n].sum(-2)
        S = total[:, :, n, None, None] * S + k_out[:, :, n].transpose(-1, -2) @ vc[:, :, n]
    num = num + torch.stack(inter_num, dim=2)
    if normalize:
        den = den + torch.stack(inter_den, dim=2)
    o = _finish(num, den, eps).reshape(B, H, N * C, -1)[:, :, :T]
    return o, LinearAttentionState(S, z)


def linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    normalize: bool = True,
    log_decay: Optional[Tensor] = None,
    form: str = "chunked",
    chunk_size: int = 64,
    eps: float = DEFAULT_EPS,
    backend: str = "auto",
    initial_state: Optional[LinearAttentionState] = None,
    return_state: bool = False,
):
    """Linear attention over feature maps: o_i = sum_j w_ij (q_i . k_j) v_j [/ sum_j w_ij (q_i . k_j)].

    Args:
        q, k: (B, H, T, Dk) *features* phi(q), phi(k) (apply the feature map first).
        v: (B, H, T, Dv).
        causal: sum over j <= i (True) or over all j (False).
        normalize: divide by the kernel row sums (plus `eps`); False gives the unnormalised
            form used by RetNet and Mamba-2 / SSD.
        log_decay: optional log of the per-step decay, <= 0, shape (H,) or (B, H, T); then
            w_ij = exp(log_decay[j+1] + ... + log_decay[i]). Needs causal=True.
        form: "quadratic", "recurrent" or "chunked" (all three agree).
        chunk_size: chunk length of the chunked form on the torch path (the Triton kernels use
            the chunk length of their launch config, `linattn_lib.kernels.select_config`).
        eps: added to the denominator when normalize=True.
        backend: "auto" (compiled Triton on CUDA for fp16/bf16/fp32, torch otherwise), "torch", or "triton"
            (on CPU tensors: the Triton interpreter, slow, for teaching and tests). Only the
            chunked form has a Triton implementation.
        initial_state: a LinearAttentionState to resume from (e.g. the state returned by a
            previous call on the preceding piece of the sequence).
        return_state: also return the final LinearAttentionState.

    Returns:
        o of shape (B, H, T, Dv) in the dtype of v, or (o, state) when return_state=True.
    """
    fn = "linear_attention"
    V.check_qkv(fn, q, k, v)
    V.check_choice(fn, "form", form, FORMS)
    V.check_choice(fn, "backend", backend, BACKENDS)
    V.check_positive_int(fn, "chunk_size", chunk_size)
    V.check_flag(fn, "causal", causal)
    V.check_flag(fn, "normalize", normalize)
    V.check_flag(fn, "return_state", return_state)
    eps = V.check_eps(fn, eps)
    _check_finite(fn, (("q", q), ("k", k), ("v", v)))
    if log_decay is not None:
        V.check_log_decay(fn, log_decay, q, causal=causal)
    if initial_state is not None:
        B, H, _, Dk = q.shape
        V.check_state(fn, "initial_state", initial_state, B=B, H=H, Dk=Dk, Dv=v.shape[-1], device=q.device, normalize=normalize)

    from ._triton import linear_attention_triton, triton_available, triton_supports

    # auto: the compiled kernels on CUDA for the inputs they support (fp16/bf16/fp32, head dims
    # up to 256); float64 and wider heads stay on torch
    use_triton = backend == "triton" or (
        backend == "auto" and q.is_cuda and form == "chunked" and triton_supports(q, v)
    )
    if use_triton:
        if form != "chunked":
            raise ValueError(f"{fn}: backend='triton' implements form='chunked' only, got form={form!r}")
        if not triton_available():
            raise RuntimeError(f"{fn}: backend='triton' needs the `triton` package and linattn_lib.kernels")

        return linear_attention_triton(
            q, k, v, causal=causal, normalize=normalize, log_decay=log_decay, eps=eps,
            initial_state=initial_state, return_state=return_state,
        )

    if form == "chunked" and backend in ("auto", "torch"):
        from ._chunked import chunked_linear_attention  # the fast torch path (custom backward)

        return chunked_linear_attention(
            q, k, v, causal=causal, normalize=normalize, log_decay=log_decay, eps=eps,
            chunk_size=chunk_size, initial_state=initial_state, return_state=return_state,
        )
    return reference_linear_attention(
        q, k, v, causal=causal, normalize=normalize, log_decay=log_decay, form=form,
        chunk_size=chunk_size, eps=eps, initial_state=initial_state, return_state=return_state,
    )


def reference_linear_attention(
    q, k, v, *, causal=True, normalize=True, log_decay=None, form="chunked", chunk_size=64,
    eps=DEFAULT_EPS, initial_state=None, return_state=False,
):
    """Plain-autograd reference of `linear_attention` (no input checks; call the public one)."""
    B, H, T, _ = q.shape
    dtype = _compute_dtype(q)
    qq, kk, vv = (x.to(dtype) for x in (q, k, v))
    g = expand_log_decay(log_decay, B, H, T, dtype=dtype, device=q.device)
    S, z = _init_state(q, v, initial_state, normalize, dtype)
    if form == "quadratic":
        o, state = _quadratic(qq, kk, vv, g, S, z, causal, normalize, eps)
    elif form == "recurrent":
        o, state = _recurrent(qq, kk, vv, g, S, z, causal, normalize, eps)
    else:
        o, state = _chunked(qq, kk, vv, g, S, z, causal, normalize, eps, chunk_size)
    o = o.to(v.dtype)
    return (o, state) if return_state else o
