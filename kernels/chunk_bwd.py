"""Causal chunked linear attention, backward: the kernel for dQ (and, run backwards, dK).

Differentiate o_i = sum_{j <= i} w_ij (q_i . k_j) v_j, with w_ij = exp(G_i - G_j) the decay
from j to i (G the cumulative log-decay), and an initial state S0 decayed by exp(G_i):

    dq_i = sum_{j <= i} w_ij (dO_i . v_j) k_j + exp(G_i) S0 dO_i
    dk_j = sum_{i >= j} w_ij (v_j . dO_i) q_i + exp(G_T - G_j) dS_T v_j
    dv_j = sum_{i >= j} w_ij (k_j . q_i) dO_i + exp(G_T - G_j) dS_T^T k_j

Each line is linear attention again:
* dq is causal linear attention with (query, key, value) = (dO, v, k), and the state it
  carries is the forward state S itself (sum_j k_j v_j^T), rebuilt on the fly chunk by chunk:
  no state is stored by the forward pass;
* dk is the same computation run backwards in time with (dO, v, k) replaced by (v, dO, q);
  its state is dS = sum_{i later} q_i dO_i^T, started from dS_T, the gradient of the final state;
* dv is the forward kernel run backwards in time with (q, k, v) = (k, q, dO)
  (chunk_fwd_kernel with REVERSE=True); its final state is dS0, the gradient of S0.

This file holds the kernel for the first two lines. One program owns one (batch, head) and
one tile of BK columns of dq (or dk); it holds Dv whole, because dO_i . v_j sums over it.

The normaliser. With o = num / den (den = d + eps), the wrapper passes dnum = dO / den in
place of dO and the per-token dden = -(dO . o) / den. Since den_i = sum_j w_ij (q_i . k_j)
(plus the initial z), dden adds a rank-one term to the scores: dq gets
sum_j w_ij dden_i k_j (+ the decayed z0), dk gets sum_i w_ij dden_i q_i (+ the decayed dz_T).
The kernel adds dden to the scores (on the query side for dq, the key side for dk) and carries
the matching vector state m (z for dq, dz for dk) beside the matrix state: one pass.

Masks select (tl.where), they do not multiply, as in chunk_fwd.py. With HAS_LEN the tokens
from len[b, h] on are left out: read as zeros, their gradients written as exactly 0. The
wrapper passes 1 + the last position whose output has a nonzero cotangent, past which every
gradient is exactly zero (a token only reaches the outputs from itself on), so that a
right-padded tail, or everything after a NaN that the loss does not use, cannot meet a zero in
a matmul (0 * NaN = NaN) and spoil the gradients of the tokens before it.

The gradient of the log-decay needs no kernel of its own: G_t enters as +G_t on the query side
and -G_t on the key side, so dL/dG_t = q_t . dq_t - k_t . dk_t (+ <dS_T, S_T> at the last token),
and dL/dg_t is the reverse cumulative sum of that (linattn_lib/core/triton_ops.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import dot_precision, launchable, select_config


@triton.jit
def chunk_log_decays_fixed(g, REVERSE: tl.constexpr):
    """The log-decays of one chunk from exact prefix sums in 64-bit fixed point.

    Returns what `chunk_log_decays` in chunk_fwd.py does -- (L, row_log, col_log, g_last), L
    the log of the decay between the two tokens of a visible pair (clamped to <= 0 outside) --
    by another route that leaves the registers alone: that kernel's 2-d scans made this one
    spill (sm_86, fp32: 111 spill instructions where it had none).

    Each g (<= 0) becomes an integer number of 2^-32 steps (g is first clamped at -2^20:
    exp(-2^20) = 0 as exp(g) does, and any sum that holds it stays below -2^20), so the prefix
    sums G are integers below 2^58 in magnitude: exact, whatever the order or size of the terms.
    G_i - G_j is then *exactly* the sum of the steps between j and i -- not a difference of
    rounded prefix sums, which after a reset (g = -1e5) keeps ~1e-2 of absolute precision in
    fp32 -- and one conversion to fp32 rounds it relative to itself. The steps are truncated to
    2^-32 (2.3e-10) each, so a sum over a chunk is off by at most BT * 2.3e-10 absolutely,
    which changes exp(L) by that much relatively.
    """
    STEP: tl.constexpr = 2.3283064365386963e-10     # 2^-32
    gi = (tl.maximum(g, -1048576.0) * 4294967296.0).to(tl.int64)
    G = tl.cumsum(gi, axis=0)                      # g_start + ... + g_i, exact
    G_last = tl.sum(gi, axis=0)
    g_last = G_last.to(tl.float32) * STEP
    gc = G.to(tl.float32) * STEP                   # from the chunk start to token i
    after = (G_last - G).to(tl.float32) * STEP     # g_{i+1} + ... + g_last
    if REVERSE:
        L = tl.minimum((G[None, :] - G[:, None]).to(tl.float32) * STEP, 0.0)   # g_{i+1} + ... + g_j
        row_log = after
        col_log = gc
    else:
        L = tl.minimum((G[:, None] - G[None, :]).to(tl.float32) * STEP, 0.0)   # g_{j+1} + ... + g_i
        row_log = gc
        col_log = after
    return L, row_log, col_log, g_last


@triton.jit
def chunk_bwd_dqk_kernel(
    do_ptr, v_ptr, k_ptr,    # dq: (dnum, v, k); dk: (v, dnum, q). (B, H, T, Dv) (B, H, T, Dv) (B, H, T, Dk)
    dd_ptr,                  # (B, H, T) fp32 dden, the gradient of the denominator (HAS_DD)
    len_ptr,                 # (B, H) int32: tokens t >= len[b, h] are left out (HAS_LEN), else unused
    g_ptr,                   # log-decay: (H,) if DECAY == 1, (B, H, T) if DECAY == 2 (fp32)
    dq_ptr,                  # output (B, H, T, Dk)
    s0_ptr, z0_ptr,          # state on entry (B, H, Dk, Dv), (B, H, Dk) fp32: dq: (S0, z0); dk: (dS_T, dz_T)
    T, H, Dk, Dv,
    BT: tl.constexpr,        # chunk length
    BK: tl.constexpr,        # columns of dq per program
    BV: tl.constexpr,        # Dv rounded up to a power of two
    DECAY: tl.constexpr,     # 0: none, 1: per head, 2: per token
    HAS_DD: tl.constexpr,    # normalised attention: add dden to the scores, carry m
    HAS_S0: tl.constexpr,    # start from (s0, z0) instead of zeros
    REVERSE: tl.constexpr,   # False: dq (causal, j <= i); True: dk (anti-causal, i >= j)
    HAS_LEN: tl.constexpr,   # read tokens t < len[b, h] only, write exactly 0 at the others
    DOT_PREC: tl.constexpr,
):
    i_k = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)

    o_t = tl.arange(0, BT)
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = tl.arange(0, BV)
    m_k = o_k < Dk
    m_v = o_v < Dv

    do_base = do_ptr + i_bh * T * Dv
    v_base = v_ptr + i_bh * T * Dv
    k_base = k_ptr + i_bh * T * Dk
    dq_base = dq_ptr + i_bh * T * Dk

    # M: this program's rows of the (Dk x Dv) state; m: the matching slice of the vector state.
    M = tl.zeros([BK, BV], dtype=tl.float32)
    m = tl.zeros([BK], dtype=tl.float32)
    if HAS_S0:
        M = tl.load(s0_ptr + i_bh * Dk * Dv + o_k[:, None] * Dv + o_v[None, :],
                    mask=m_k[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        if HAS_DD:
            m = tl.load(z0_ptr + i_bh * Dk + o_k, mask=m_k, other=0.0).to(tl.float32)

    if REVERSE:
        visible = o_t[:, None] <= o_t[None, :]
    else:
        visible = o_t[:, None] >= o_t[None, :]

    NT = tl.cdiv(T, BT)
    for n in range(0, NT):
        if REVERSE:
            i_n = NT - 1 - n
        else:
            i_n = n
        t = i_n * BT + o_t
        m_t = t < T
        if HAS_LEN:                         # tokens that take part (see chunk_fwd_kernel)
            m_l = t < tl.load(len_ptr + i_bh)
        else:
            m_l = m_t
        do = tl.load(do_base + t[:, None] * Dv + o_v[None, :], mask=m_l[:, None] & m_v[None, :], other=0.0)
        v = tl.load(v_base + t[:, None] * Dv + o_v[None, :], mask=m_l[:, None] & m_v[None, :], other=0.0)
        k = tl.load(k_base + t[:, None] * Dk + o_k[None, :], mask=m_l[:, None] & m_k[None, :], other=0.0)

        # Scores of the gradient: (dO_i . v_j) for dq, (v_j . dO_i) for dk, both a (BT x BT)
        # masked matmul, plus dden where the normaliser is on (row side for dq, column side for dk).
        P = tl.dot(do, tl.trans(v), input_precision=DOT_PREC)
        if HAS_DD:
            dd = tl.load(dd_ptr + i_bh * T + t, mask=m_l, other=0.0)
            if REVERSE:
                P += dd[None, :]
                row_w = tl.where(m_l, 1.0, 0.0)   # weight of m in the output row
                col_w = dd                        # weight of each token in m
            else:
                P += dd[:, None]
                row_w = dd
                col_w = tl.where(m_l, 1.0, 0.0)
        if DECAY > 0:
            if DECAY == 1:
                g = tl.where(m_t, tl.load(g_ptr + i_bh % H).to(tl.float32), 0.0)
            else:
                g = tl.load(g_ptr + i_bh * T + t, mask=m_t, other=0.0).to(tl.float32)
            # Every exponent <= 0 and exact up to one rounding (see chunk_log_decays_fixed).
            L, row_log, col_log, g_last = chunk_log_decays_fixed(g, REVERSE)
            P = P * tl.exp(L)
        P = tl.where(visible, P, 0.0)      # select, do not multiply (inf * 0 = NaN)

        dq = tl.dot(P.to(k.dtype), k, input_precision=DOT_PREC)
        # Inter-chunk, through the state: row_decay_i * (M dO_i + row_w_i m), in fp32.
        do_s = do.to(tl.float32)
        if DECAY > 0:
            row_decay = tl.exp(row_log)
            do_s = do_s * row_decay[:, None]
        dq += tl.dot(do_s, tl.trans(M), input_precision=DOT_PREC)
        if HAS_DD:
            if DECAY > 0:
                row_w = row_w * row_decay
            dq += row_w[:, None] * m[None, :]
        if HAS_LEN:
            dq = tl.where(m_l[:, None], dq, 0.0)   # tokens left out get exactly 0
        tl.store(dq_base + t[:, None] * Dk + o_k[None, :], dq.to(dq_ptr.dtype.element_ty),
                 mask=m_t[:, None] & m_k[None, :])

        # Pass the state on: M <- exp(g_last) M + sum_j col_decay_j k_j v_j^T.
        k_s = k.to(tl.float32)
        if DECAY > 0:
            k_s = k_s * tl.exp(col_log)[:, None]
            M = M * tl.exp(g_last)
            if HAS_DD:
                m = m * tl.exp(g_last)
        M += tl.dot(tl.trans(k_s), v.to(tl.float32), input_precision=DOT_PREC)
        if HAS_DD:
            m += tl.sum(k_s * col_w[:, None], axis=0)


def chunk_bwd_dqk(
    do: torch.Tensor,
    v: torch.Tensor,
    k: torch.Tensor,
    *,
    dden: torch.Tensor | None = None,
    log_decay: torch.Tensor | None = None,
    initial_state: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    reverse: bool = False,
    lengths: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """Launch `chunk_bwd_dqk_kernel`; returns dq (reverse=False) or dk (reverse=True).

    For dq pass (dnum, v, k) and the forward initial state (S0, z0); for dk pass (v, dnum, q)
    and the gradient of the final state (dS_T, dz_T). dden is the fp32 (B, H, T) gradient of
    the denominator (normalised attention only). The result has dtype `out_dtype` (default:
    the dtype of k). lengths: None or (B, H) integers: tokens from lengths[b, h] on are read as
    zeros and get exactly 0 (a tail no loss term depends on; see linattn_lib/core/triton_ops.py).
    """
    B, H, T, Dv = do.shape
    Dk = k.shape[-1]
    do, v, k = do.contiguous(), v.contiguous(), k.contiguous()
    cfg = config or select_config("chunk_bwd_dqk", Dv, k.dtype, k.device)
    dq = torch.empty(B, H, T, Dk, dtype=out_dtype or k.dtype, device=k.device)
    decay_kind = 0 if log_decay is None else (1 if log_decay.dim() == 1 else 2)
    g = log_decay.to(torch.float32).contiguous() if log_decay is not None else None
    dd = dden.to(torch.float32).contiguous() if dden is not None else None
    lens = lengths.to(device=k.device, dtype=torch.int32).contiguous() if lengths is not None else None
    S0 = z0 = None
    if initial_state is not None:
        S0 = initial_state[0].to(torch.float32).contiguous()
        if dd is not None:
            z0 = initial_state[1].to(torch.float32).contiguous()

    dummy = dq
    grid = (triton.cdiv(Dk, cfg["BK"]), B * H)
    launchable(chunk_bwd_dqk_kernel, k.device)[grid](
        do, v, k, dd if dd is not None else dummy, lens if lens is not None else dummy,
        g if g is not None else dummy, dq,
        S0 if S0 is not None else dummy, z0 if z0 is not None else dummy,
        T, H, Dk, Dv,
        BT=cfg["BT"], BK=cfg["BK"], BV=cfg["BV"], DECAY=decay_kind, HAS_DD=dd is not None,
        HAS_S0=S0 is not None, REVERSE=reverse, HAS_LEN=lens is not None, DOT_PREC=dot_precision(k.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return dq


def compile_spec(cfg: dict, dtype: str) -> tuple[dict, dict]:
    """Signature and constexprs of the heaviest variant, for ahead-of-time compilation."""
    signature = {
        "do_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "dd_ptr": "*fp32",
        "len_ptr": "*i32", "g_ptr": "*fp32", "dq_ptr": "*fp32", "s0_ptr": "*fp32", "z0_ptr": "*fp32",
        "T": "i32", "H": "i32", "Dk": "i32", "Dv": "i32",
    }
    constexprs = {
        "BT": cfg["BT"], "BK": cfg["BK"], "BV": cfg["BV"], "DECAY": 2, "HAS_DD": True,
        "HAS_S0": True, "REVERSE": True, "HAS_LEN": True, "DOT_PREC": dot_precision(dtype),
    }
    for name in constexprs:
        signature[name] = "constexpr"
    return signature, constexprs
