"""GLA's chunkwise-parallel ("hardware-efficient") form, with secondary chunking.

Gated linear attention (Yang et al., ICML 2024, arXiv 2312.06635) runs

    S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T,    o_t = S_t^T q_t,    g_t <= 0 per key channel.

`gla_attention` in `core/ssm.py` computes each chunk with a (Dk, C, C) stack of per-channel
decay masks: exact, but it is not how the paper gets GLA onto matrix-multiply hardware.
This module writes the paper's §4 form, where the gates are folded into q and k so that the
work inside a chunk is ordinary matrix products, and the second level of chunks that keeps
those products from overflowing.

Inside a chunk, write b_i = g_start + ... + g_i (per channel, from the chunk's first token
on). Then the query at i, the keys j <= i of the chunk and the state S_n that enters it give

    o_i = (q_i o exp(b_i)) S_n + sum_{j <= i} sum_d q_id k_jd exp(b_id - b_jd) v_j,
    S_{n+1} = diag(exp(b_last)) S_n + (K o exp(b_last - B))^T V,

where b_last - b_j = g_{j+1} + ... + g_last is summed over its own interval (`sum_after`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _validate as V
from .masks import segsum
from .ssm import _check_unnormalized_state
from .state import LinearAttentionState, compute_dtype, sum_after


def _check_inputs(fn: str, q: Tensor, k: Tensor, v: Tensor, g: Tensor, chunk_size: object, sub_chunk: object) -> None:
    """The checks of `gla_attention` (shapes, dtype, device, g <= 0), plus the two chunk sizes."""
    V.check_qkv(fn, q, k, v)
    V.check_shape(fn, "g", g, tuple(k.shape), ("B", "H", "T", "Dk"))
    V.check_same(fn, [("q", q), ("g", g)])
    V.check_values(fn, "g", g, high=0.0, why="a log-gate: the gate exp(g) lies in (0, 1]")
    V.check_all_finite(fn, (("q", q), ("k", k), ("v", v)))
    V.check_positive_int(fn, "chunk_size", chunk_size)
    V.check_positive_int(fn, "sub_chunk", sub_chunk)
    if chunk_size % sub_chunk:
        raise ValueError(
            f"{fn}: `sub_chunk` must divide `chunk_size` (a chunk is cut into whole sub-chunks), "
            f"got sub_chunk={sub_chunk!r} and chunk_size={chunk_size!r}"
        )


def _to_chunks(x: Tensor, chunk_size: int) -> Tensor:
    """(B, H, T, D) -> (B, H, N, C, D), padded with zeros at the end to N * C tokens.

    Zero padding is exact here: a padded key and value add nothing to the state, a padded
    log-gate of 0 does not decay it, and the padded outputs are dropped.
    """
    B, H, T, D = x.shape
    pad = -T % chunk_size
    return F.pad(x, (0, 0, 0, pad)).reshape(B, H, (T + pad) // chunk_size, chunk_size, D)


def _between_subchunks(q: Tensor, k: Tensor, g: Tensor) -> Tensor:
    """Scores of queries against keys of *earlier* sub-chunks: (..., n, c, m, c), 0 for m >= n.

    q, k, g: (..., Ns, c, Dk), one chunk cut into Ns sub-chunks of c tokens. The reference
    point for the query sub-chunk n is the boundary just before it, b_ref = b at its last
    preceding token. Then exp(b_i - b_j) = exp(b_i - b_ref) * exp(b_ref - b_j) with

        b_i - b_ref = g_{start of n} + ... + g_i        (a cumsum inside sub-chunk n),
        b_ref - b_j = g_{j+1} + ... + g_{end of m}      (`sum_after` inside sub-chunk m)
                      + totals of sub-chunks m+1 .. n-1 (`segsum` over sub-chunk totals).

    Both are sums of terms <= 0, each over its own interval: no overflow, and no difference
    of large prefix sums. The query factor spans at most one sub-chunk.
    """
    q_in = q * torch.exp(torch.cumsum(g, dim=-2))  # q_i exp(b_i - b_ref)
    to_end = sum_after(g.transpose(-1, -2)).transpose(-1, -2)  # (..., m, c, Dk)
    totals = g.sum(dim=-2).transpose(-1, -2)  # (..., Dk, Ns)
    # gap[d, n, m] = totals over sub-chunks m+1 .. n-1 (0 when m = n-1), -inf when m >= n
    gap = F.pad(segsum(totals)[..., :-1, :], (0, 0, 1, 0), value=float("-inf"))
    gap = gap.movedim(-3, -1).unsqueeze(-2)  # (..., n, m, 1, Dk)
    k_ref = k.unsqueeze(-4) * torch.exp(to_end.unsqueeze(-4) + gap)  # (..., n, m, c, Dk)
    return torch.einsum("...nid,...nmjd->...nimj", q_in, k_ref)


def _within_subchunks(q: Tensor, k: Tensor, g: Tensor) -> Tensor:
    """Scores inside each sub-chunk, pair by pair: (..., Ns, c, c), lower-triangular.

    exp(b_i - b_j) = exp(g_{j+1} + ... + g_i) comes from `segsum`, one (c, c) mask per
    channel: the paper's log-space computation, kept to the small diagonal blocks.
    """
    L = torch.exp(segsum(g.transpose(-1, -2)))  # (..., Ns, Dk, c, c), 0 above the diagonal
    return torch.einsum("...id,...jd,...dij->...ij", q, k, L)


def _chunk_scores(q: Tensor, k: Tensor, g: Tensor, sub_chunk: int) -> Tensor:
    """The intra-chunk matrix P of every chunk, (B, H, N, C, C), assembled from c x c blocks."""
    *lead, C, Dk = q.shape
    ns = C // sub_chunk
    q, k, g = (x.reshape(*lead, ns, sub_chunk, Dk) for x in (q, k, g))
    P = _between_subchunks(q, k, g)  # (..., n, c, m, c)
    eye = torch.eye(ns, dtype=P.dtype, device=P.device)
    P = P + _within_subchunks(q, k, g).unsqueeze(-2) * eye[:, None, :, None]
    return P.reshape(*lead, C, C)


def _chunk_states(k: Tensor, v: Tensor, g: Tensor, S: Tensor) -> tuple[Tensor, Tensor]:
    """The state entering each chunk, (B, H, N, Dk, Dv), and the state after the last one.

    S_{n+1} = diag(exp(b_last)) S_n + (K o exp(b_last - B))^T V, with b_last - b_j summed
    from j + 1 on (`sum_after`), never as b_last - b_j.
    """
    k_to_end = k * torch.exp(sum_after(g.transpose(-1, -2))).transpose(-1, -2)
    decay = torch.exp(g.sum(dim=-2)).unsqueeze(-1)  # (B, H, N, Dk, 1)
    kv = k_to_end.transpose(-1, -2) @ v  # (B, H, N, Dk, Dv)
    entering = []
    for n in range(k.shape[2]):
        entering.append(S)
        S = decay[:, :, n] * S + kv[:, :, n]
    return torch.stack(entering, dim=2), S


def gla_chunkwise(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    *,
    chunk_size: int = 64,
    sub_chunk: int = 16,
    initial_state: LinearAttentionState | None = None,
    return_state: bool = False,
) -> Tensor | tuple[Tensor, LinearAttentionState]:
    """GLA in the paper's chunkwise-parallel form, with secondary chunking (arXiv 2312.06635, §4).

    The obvious way to make the intra-chunk sum a matrix product is to split the decay,
    exp(b_i - b_j) = exp(b_i) exp(-b_j), and compute P = tril((Q o exp(B)) (K o exp(-B))^T).
    That is exact algebra but not arithmetic: b_j only decreases along the chunk, so exp(-b_j)
    grows without bound. With a strong gate, g = -30 per token, b_j = -30 (j + 1): float32
    overflows (exp(x) > 3.4e38 once x > 88.7) at the third token, float64 (x > 709.8) at the
    24th, and exp(-b_j) = inf meets exp(b_i) = 0 in inf * 0 = NaN.

    Secondary chunking cuts each chunk into sub-chunks of `sub_chunk` tokens. A query and a
    key in *different* sub-chunks split the decay at the boundary b_ref before the query's
    sub-chunk: q_i exp(b_i - b_ref) times k_j exp(b_ref - b_j), two exponents <= 0 (the first
    spans at most one sub-chunk), so this block is a plain matrix product (the tensor-core
    work in the paper). Pairs inside one sub-chunk get exp(g_{j+1} + ... + g_i) from `segsum`,
    per channel (the paper's full-precision log-space part). The inter-chunk term
    (q_i o exp(b_i)) S_n and the state update then carry the past from chunk to chunk.

    Args:
        q, k: (B, H, T, Dk); v: (B, H, T, Dv); g: (B, H, T, Dk) log-gates, <= 0
            (the `log_gates` of `gla_attention`).
        chunk_size: tokens per chunk (the last chunk is padded, exactly, with zeros).
        sub_chunk: tokens per sub-chunk; must divide `chunk_size`.
        initial_state / return_state: LinearAttentionState(S of shape (B, H, Dk, Dv), z=None).

    Returns o of shape (B, H, T, Dv), equal to `gla_attention(q, k, v, g)` (and the final
    state when return_state=True). No q scaling (fla's Dk^-0.5 is the caller's choice).
    """
    fn = "gla_chunkwise"
    _check_inputs(fn, q, k, v, g, chunk_size, sub_chunk)
    return_state = V.check_flag(fn, "return_state", return_state)
    B, H, T, Dk = q.shape
    dtype = compute_dtype(q)
    S = q.new_zeros(B, H, Dk, v.shape[-1], dtype=dtype)
    if initial_state is not None:
        _check_unnormalized_state(fn, initial_state, B=B, H=H, Dk=Dk, Dv=v.shape[-1], device=q.device)
        S = initial_state[0].to(dtype)
    qc, kc, vc, gc = (_to_chunks(x.to(dtype), chunk_size) for x in (q, k, v, g))
    entering, S = _chunk_states(kc, vc, gc, S)
    inter = (qc * torch.exp(torch.cumsum(gc, dim=-2))) @ entering  # (q_i o exp(b_i)) S_n
    o = _chunk_scores(qc, kc, gc, sub_chunk) @ vc + inter
    o = o.reshape(B, H, -1, v.shape[-1])[:, :, :T].to(q.dtype)
    return (o, LinearAttentionState(S, None)) if return_state else o
