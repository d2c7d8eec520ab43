"""The reference forms of linear attention: quadratic, recurrent and chunked, in plain autograd.

The recurrence they compute is stated in `state.py`. Three forms, all agreeing:

* ``"quadratic"`` materialises the T x T matrix (q k^T) * L with the decay mask L,
* ``"recurrent"`` runs the recurrence token by token (the RNN view),
* ``"chunked"`` splits T into chunks: masked matmuls inside a chunk, the state between chunks.

These are the readable definitions the fast paths (`torch_chunked.py`, `triton_ops.py`) are
tested against; `linear_attention` (in `linear.py`) checks the inputs and picks a backend.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .masks import segsum
from .state import (
    DEFAULT_EPS,
    LinearAttentionState,
    compute_dtype,
    expand_log_decay,
    noncausal,
    sum_after,
)

FORMS = ("quadratic", "recurrent", "chunked")


def _finish(num: Tensor, den: Tensor | None, eps: float) -> Tensor:
    return num if den is None else num / (den.unsqueeze(-1) + eps)


def _init_state(q: Tensor, v: Tensor, state: LinearAttentionState | None, normalize: bool, dtype):
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
    o, S, z = noncausal(q, k, v, S, z, normalize, eps)
    return o, LinearAttentionState(S, z)


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
    to_end = torch.exp(sum_after(g)).unsqueeze(-1)  # exp(g_{j+1} + ... + g_T) <= 1
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
    k_out = kc * torch.exp(sum_after(g.reshape(B, H, N, C))).unsqueeze(-1)  # keys decayed to the chunk end
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


def reference_linear_attention(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool = True, normalize: bool = True,
    log_decay: Tensor | None = None, form: str = "chunked", chunk_size: int = 64,
    eps: float = DEFAULT_EPS, initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
) -> Tensor | tuple[Tensor, LinearAttentionState]:
    """Plain-autograd reference of `linear_attention` (no input checks; call the public one)."""
    B, H, T, _ = q.shape
    dtype = compute_dtype(q)
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
