"""The chunked delta rule (DeltaNet, Gated DeltaNet): forward in three kernels, backward in three.

Reference: `delta_rule_attention` (linattn_lib/core/delta.py, `_ut_transform`); autograd and
the backward's launcher: core/delta_triton.py; tests: tests/test_kernels_delta.py.

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t

S is Dk x Dv (fp32 throughout), g_t <= 0 the log-gate (none, one per head or one per token).
In a chunk of BT tokens entered with state S_n the updates are additions of pseudo-values that
solve one unit lower triangular system. With gc_i = g_start + ... + g_i, gam = exp(gc),
Gam[i, j] = exp(gc_i - gc_j), a_j = g_{j+1} + ... + g_last, as flash-linear-attention splits it:

    delta_wy_kernel      parallel (chunk, batch * head): A = I + tril(diag(beta) (K K^T * Gam), -1)
                         inverted by forward substitution (fp32, registers), W = A^-1 diag(beta)
                         (gam * K), U = A^-1 diag(beta) V, stored fp32. Needs no state.
    delta_state_kernel   sequential over chunks, per (value tile, batch * head), Dk whole: stores
                         S_n, V_new = U - W S_n, steps S_{n+1} = exp(g_last) S_n + (exp(a) K)^T V_new.
    delta_output_kernel  parallel: o = (gam * Q) S_n + (Q K^T * Gam)_causal V_new.

The backward (dO, dS_final given; W, U, h = S_n, V_new recomputed by the first two), with
dS = dL/dS_{n+1}, the gradient of the state leaving chunk n:

    delta_bwd_state_kernel  sequential, from the last chunk back (dS = dS_final first), stores
                         dS per chunk, dV_new = (Q K^T * Gam)_causal^T dO + exp(a) K dS, steps
                         dS_n = exp(g_last) dS + (gam Q)^T dO - W^T dV_new; dS_0 out.
    delta_bwd_dqk_kernel parallel (key block, chunk, batch * head), ds = (dO V_new^T * Gam)_causal:
                         dq = gam dO S_n^T + ds K, dk0 = ds^T Q + exp(a) V_new dS^T, dW = -dV_new S_n^T.
    delta_bwd_wy_kernel  parallel, the UT transform backward with dU = dV_new: dv = beta A^-T dU,
                         dK~ = A^-T dW; dA^-1 = dU (beta V)^T + dW (beta gam K)^T, dN = -(A^-T dA^-1
                         A^-T)_strict for N = diag(beta) (K K^T * Gam); dk = dk0 + beta gam dK~ +
                         (dN beta * Gam + its transpose) K, dbeta from all three.

dL/dg: every term sees g through gc (Gam, gam, a = gc_last - gc), so dL/dg_t = sum over i >= t
in its chunk of dL/dgc_i (reversed cumsum in the kernels): q . dq - k . dk0 plus the chunk
total's terms (dqk), W's gam and N's Gam (wy); the partials are summed in torch.

Log-decays come from `chunk_log_decays` (chunk_fwd.py): all <= 0, no exp overflows (a reset,
g = -1e4, gives exp = 0). Products of two input tiles (K K^T, Q K^T) run in the input dtype
with an fp32 accumulator; those with an fp32 operand use `dot_precision` (tf32 for 16-bit
inputs, ieee for fp32). Padded tokens (t >= T) and head dims are read as 0: a padded token has
beta = 0 and g = 0, its row of A the identity's, its W, U, V_new rows 0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk_decay import load_log_decay
from .chunk_fwd import chunk_log_decays
from .configs import dot_precision, launchable, select_config, signature_of
from .shapes import checked_grid

# --- configs ---

def delta_config(kernel: str, Dk: int, dtype: torch.dtype, chunk_size: int | None = None,
                 device: torch.device | str | tuple | None = None) -> dict:
    """The launch config of `kernel` (a key of DELTA_KERNELS) for key dim Dk, inputs of `dtype`
    on `device` (a torch device or a (major, minor) capability; None and CPU: sm_80's choice):
    `select_config`'s answer from configs.py, where the table and the reasons for it are.
    `chunk_size` (a power of two >= 16) overrides BT."""
    cfg = select_config(kernel, Dk, dtype, device)
    if chunk_size is not None:
        if chunk_size < 16 or chunk_size & (chunk_size - 1):
            raise ValueError(f"delta_rule_fwd: chunk_size must be a power of two >= 16, got {chunk_size}")
        cfg = dict(cfg, BT=chunk_size)
    return cfg


# --- helpers ---

@triton.jit
def _chunk_decays(g_ptr, i_h, row0, t, m_t, o_t, BT: tl.constexpr, DECAY: tl.constexpr):
    """(L, gc, after, g_last) of one chunk (`chunk_log_decays`): L[i, j] = g_{j+1} + ... + g_i
    below the diagonal (0 elsewhere), gc_i = g_start + ... + g_i, after_j = g_{j+1} + ... +
    g_last, g_last the chunk's total; all zeros without a decay."""
    g = load_log_decay(g_ptr, i_h, row0, t, m_t, DECAY)
    return chunk_log_decays(g, o_t, BT, False, DECAY == 1)


@triton.jit
def _decayed(g_ptr, i_h, row0, t, m_t, o_t, pairs, by_gc, by_after, total, BT: tl.constexpr, DECAY: tl.constexpr):
    """One chunk's decays applied (`_chunk_decays`, every exponent <= 0): pairs (BT x BT) times
    exp(L) and kept on the causal triangle i >= j, the rows of by_gc times exp(gc), those of
    by_after times exp(after), total times exp(g_last)."""
    if DECAY > 0:
        L, gc, after, g_last = _chunk_decays(g_ptr, i_h, row0, t, m_t, o_t, BT, DECAY)
        pairs, total = pairs * tl.exp(L), total * tl.exp(g_last)
        by_gc, by_after = by_gc * tl.exp(gc)[:, None], by_after * tl.exp(after)[:, None]
    return tl.where(o_t[:, None] >= o_t[None, :], pairs, 0.0), by_gc, by_after, total


@triton.jit
def _tile(ptr, row0, t, m_t, o_d, m_d, D):
    """The (len(t) x len(o_d)) tile of rows row0 + t, columns o_d of a (rows x D) matrix."""
    return tl.load(ptr + (row0 + t)[:, None] * D + o_d[None, :], mask=m_t[:, None] & m_d[None, :], other=0.0)


@triton.jit
def _gram(a_ptr, b_ptr, row0, t, m_t, D, BT: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr):
    """a b^T over one chunk's rows (BT x BT, fp32), D walked in blocks of BK."""
    acc = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(D, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        a = _tile(a_ptr, row0, t, m_t, o_k, o_k < D, D)
        b = _tile(b_ptr, row0, t, m_t, o_k, o_k < D, D)
        acc = tl.dot(a, tl.trans(b), acc=acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _unit_lower_inverse(N, o_t, BT: tl.constexpr):
    """(I + N)^-1 for a strictly lower triangular N (BT x BT, fp32), by forward substitution.

    Row i of X = (I + N)^-1 is e_i - sum_{j<i} N[i, j] X[j, :]. The strict part of X is built
    in place in the rows of M = -N: when row i is reached, rows j < i already hold X's strict
    part R[j, :] and row i still holds -N[i, :], so R[i, :] = M[i, :] + M[i, :] @ R (M[i, j] = 0
    for j >= i: the rows not yet done do not contribute). BT - 1 steps, each a BT x BT
    multiply-and-reduce; the diagonal's ones are added at the end."""
    M = -N
    for i in range(1, BT):
        row = tl.sum(tl.where(o_t[:, None] == i, M, 0.0), axis=0)          # M[i, :]
        row = row + tl.sum(row[:, None] * M, axis=0)                         # + M[i, :] R
        M = tl.where(o_t[:, None] == i, row[None, :], M)
    return M + tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)


@triton.jit
def _wy_inverse(k_ptr, beta_ptr, g_ptr, i_h, row0, t, m_t, o_t, Dk, BT: tl.constexpr, BK: tl.constexpr,
                DECAY: tl.constexpr, DOT_PREC: tl.constexpr):
    """(beta, gam, (K K^T * Gam)_strict, A^-1) of a chunk, fp32; A = I + diag(beta) (K K^T * Gam)_strict."""
    beta = tl.load(beta_ptr + row0 + t, mask=m_t, other=0.0).to(tl.float32)
    kk = _gram(k_ptr, k_ptr, row0, t, m_t, Dk, BT, BK, DOT_PREC)            # k_i . k_j
    gam = tl.full([BT], 1.0, dtype=tl.float32)
    if DECAY > 0:
        L, gc, _, _ = _chunk_decays(g_ptr, i_h, row0, t, m_t, o_t, BT, DECAY)
        kk = kk * tl.exp(L)                                                  # L <= 0
        gam = tl.exp(gc)
    kk = tl.where(o_t[:, None] > o_t[None, :], kk, 0.0)
    return beta, gam, kk, _unit_lower_inverse(kk * beta[:, None], o_t, BT)


@triton.jit
def _solve_columns(Ai, src_ptr, dst_ptr, row0, t, m_t, scale, D, BT: tl.constexpr, BD: tl.constexpr,
                   DOT_PREC: tl.constexpr):
    """dst = Ai @ (scale * src) over one chunk's rows, D walked in blocks of BD; fp32 out."""
    for i_d in range(0, tl.cdiv(D, BD)):
        o_d = i_d * BD + tl.arange(0, BD)
        m_d = o_d < D
        x = _tile(src_ptr, row0, t, m_t, o_d, m_d, D).to(tl.float32) * scale[:, None]
        y = tl.dot(Ai, x, input_precision=DOT_PREC)
        tl.store(dst_ptr + (row0 + t)[:, None] * D + o_d[None, :], y, mask=m_t[:, None] & m_d[None, :])


# --- the kernels ---

@triton.jit
def delta_wy_kernel(
    k_ptr, v_ptr, beta_ptr,   # (B, H, T, Dk), (B, H, T, Dv), (B, H, T) contiguous, input dtype
    g_ptr,                    # log-decay: (H,) if DECAY == 1, (B, H, T) if DECAY == 2 (fp32)
    w_ptr, u_ptr,             # out: W (B, H, T, Dk), U (B, H, T, Dv), fp32
    T, H, Dk, Dv, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DECAY: tl.constexpr,      # 0: none, 1: one log-decay per head, 2: one per token
    DOT_PREC: tl.constexpr,
):
    i_n, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    row0, o_t = i_bh * T, tl.arange(0, BT)
    t = i_n * BT + o_t
    m_t = t < T
    beta, gam, _, Ai = _wy_inverse(k_ptr, beta_ptr, g_ptr, i_bh % H, row0, t, m_t, o_t, Dk, BT, BK, DECAY, DOT_PREC)
    _solve_columns(Ai, k_ptr, w_ptr, row0, t, m_t, beta * gam, Dk, BT, BK, DOT_PREC)   # W
    _solve_columns(Ai, v_ptr, u_ptr, row0, t, m_t, beta, Dv, BT, BV, DOT_PREC)         # U


@triton.jit
def _w_times_state(w_ptr, hn_ptr, S, row0, t, m_t, o_k, m_k, o_v, m_v, Dk, Dv, BT: tl.constexpr, BK: tl.constexpr,
                   BKW: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr):
    """W S_n (BT x BV, fp32) for one chunk (W any float dtype; also the backward's K dS_{n+1}); S_n
    is in registers and was just stored at hn_ptr. BKW == BK: one product over the whole Dk.
    BKW < BK: Dk in blocks of BKW, each block of S_n read back from hn_ptr (after a barrier:
    other threads stored it). That is for fp32 inputs, whose true-fp32 tl.dot (FMA loops) over
    Dk = 128 spills hundreds of registers, over blocks of 32 none."""
    if BKW == BK:
        w = _tile(w_ptr, row0, t, m_t, o_k, m_k, Dk).to(tl.float32)
        ws = tl.dot(w, S, input_precision=DOT_PREC)
    else:
        tl.debug_barrier()
        ws = tl.zeros([BT, BV], dtype=tl.float32)
        for i_k in tl.static_range(0, BK // BKW):
            o_b = i_k * BKW + tl.arange(0, BKW)
            m_b = o_b < Dk
            w = _tile(w_ptr, row0, t, m_t, o_b, m_b, Dk).to(tl.float32)
            s = tl.load(hn_ptr + o_b[:, None] * Dv + o_v[None, :], mask=m_b[:, None] & m_v[None, :], other=0.0)
            ws = tl.dot(w, s, acc=ws, input_precision=DOT_PREC)
    return ws


@triton.jit
def delta_state_kernel(
    k_ptr, w_ptr, u_ptr,      # K (B, H, T, Dk) input dtype; W, U (delta_wy_kernel) fp32
    g_ptr,                    # log-decay: (H,) if DECAY == 1, (B, H, T) if DECAY == 2 (fp32)
    h_ptr, vn_ptr,            # out: entry states (B, H, NT, Dk, Dv), pseudo-values V_new (B, H, T, Dv) fp32
    s0_ptr, st_ptr,           # initial (HAS_S0), final (STORE_ST) state (B, H, Dk, Dv) fp32
    T, H, Dk, Dv, NT, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,   # BK: Dk whole, padded
    BKW: tl.constexpr,        # Dk block of the product W S_n (BK: whole, from registers)
    DECAY: tl.constexpr, HAS_S0: tl.constexpr, STORE_ST: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_h, row0, o_t, o_k = i_bh % H, i_bh * T, tl.arange(0, BT), tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < Dk, o_v < Dv
    m_kv, kv_off = m_k[:, None] & m_v[None, :], o_k[:, None] * Dv + o_v[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_S0:
        S = tl.load(s0_ptr + i_bh * Dk * Dv + kv_off, mask=m_kv, other=0.0).to(tl.float32)
    for n in range(0, NT):
        tl.store(h_ptr + (i_bh * NT + n) * Dk * Dv + kv_off, S, mask=m_kv)
        t = n * BT + o_t
        m_t = t < T
        u = _tile(u_ptr, row0, t, m_t, o_v, m_v, Dv)
        vn = u - _w_times_state(w_ptr, h_ptr + (i_bh * NT + n) * Dk * Dv, S, row0, t, m_t, o_k, m_k, o_v, m_v,
                                Dk, Dv, BT, BK, BKW, BV, DOT_PREC)           # U - W S_n
        tl.store(vn_ptr + (row0 + t)[:, None] * Dv + o_v[None, :], vn, mask=m_t[:, None] & m_v[None, :])
        k = _tile(k_ptr, row0, t, m_t, o_k, m_k, Dk).to(tl.float32)
        if DECAY > 0:
            _, _, after, g_last = _chunk_decays(g_ptr, i_h, row0, t, m_t, o_t, BT, DECAY)
            k = k * tl.exp(after)[:, None]                                   # carried to the chunk end
            S = S * tl.exp(g_last)
        S = tl.dot(tl.trans(k), vn, acc=S, input_precision=DOT_PREC)
    if STORE_ST:
        tl.store(st_ptr + i_bh * Dk * Dv + kv_off, S, mask=m_kv)


@triton.jit
def _scores_and_inter(q_ptr, k_ptr, h_ptr, row0, i_s, t, m_t, o_v, m_v, Dk, Dv, BT: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr):
    """Over the blocks of Dk: the raw scores Q K^T (BT x BT) and Q S_n (BT x BV), fp32."""
    A = tl.zeros([BT, BT], dtype=tl.float32)
    o = tl.zeros([BT, BV], dtype=tl.float32)
    h_base = h_ptr + i_s * Dk * Dv
    for i_k in range(0, tl.cdiv(Dk, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < Dk
        q = _tile(q_ptr, row0, t, m_t, o_k, m_k, Dk)
        k = _tile(k_ptr, row0, t, m_t, o_k, m_k, Dk)
        S = tl.load(h_base + o_k[:, None] * Dv + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        A = tl.dot(q, tl.trans(k), acc=A, input_precision=DOT_PREC)
        o = tl.dot(q.to(tl.float32), S, acc=o, input_precision=DOT_PREC)
    return A, o


@triton.jit
def delta_output_kernel(
    q_ptr, k_ptr,             # (B, H, T, Dk) contiguous, input dtype
    vn_ptr, g_ptr,            # pseudo-values V_new (B, H, T, Dv) fp32 (delta_state_kernel); log-decay
    h_ptr,                    # entry states (B, H, NT, Dk, Dv) fp32 (delta_state_kernel)
    o_ptr,                    # out: (B, H, T, Dv), in the dtype of v
    T, H, Dk, Dv, NT, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DECAY: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_v, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    i_h, row0, o_t = i_bh % H, i_bh * T, tl.arange(0, BT)
    t = i_n * BT + o_t
    m_t = t < T
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < Dv
    A, o = _scores_and_inter(q_ptr, k_ptr, h_ptr, row0, i_bh * NT + i_n, t, m_t, o_v, m_v, Dk, Dv,
                             BT, BK, BV, DOT_PREC)
    A, o, _, _ = _decayed(g_ptr, i_h, row0, t, m_t, o_t, A, o, 0.0, 0.0, BT, DECAY)  # S_n decayed to each query
    vn = _tile(vn_ptr, row0, t, m_t, o_v, m_v, Dv)
    o = tl.dot(A, vn, acc=o, input_precision=DOT_PREC)
    tl.store(o_ptr + (row0 + t)[:, None] * Dv + o_v[None, :], o.to(o_ptr.dtype.element_ty),
             mask=m_t[:, None] & m_v[None, :])


# --- the backward kernels (the maths: the module docstring; the launcher: core/delta_triton.py) ---

@triton.jit
def delta_bwd_state_kernel(
    q_ptr, k_ptr, w_ptr, do_ptr, g_ptr,   # Q, K (input dtype), W (fp32), dO (input dtype), log-decay
    dh_ptr, dvn_ptr,          # out: dS_{n+1} per chunk (B, H, NT, Dk, Dv), dV_new (B, H, T, Dv) fp32
    dst_ptr, ds0_ptr,         # dS_final in (HAS_DST), dS_0 out (STORE_DS0): (B, H, Dk, Dv) fp32
    T, H, Dk, Dv, NT, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BKW: tl.constexpr,
    DECAY: tl.constexpr, HAS_DST: tl.constexpr, STORE_DS0: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """The chunks from the last back, one program per (value tile, batch * head), Dk whole; Q K^T
    in blocks of BKW."""
    i_v, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    row0, o_t, o_k = i_bh * T, tl.arange(0, BT), tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < Dk, o_v < Dv
    m_kv, kv_off = m_k[:, None] & m_v[None, :], o_k[:, None] * Dv + o_v[None, :]
    dS = tl.load(dst_ptr + i_bh * Dk * Dv + kv_off, mask=m_kv & HAS_DST, other=0.0)   # 0 without dS_final
    for i in range(0, NT):
        n = NT - 1 - i
        dh_n = dh_ptr + (i_bh * NT + n) * Dk * Dv
        tl.store(dh_n + kv_off, dS, mask=m_kv)
        t = n * BT + o_t
        m_t = t < T
        m_tv, tv_off = m_t[:, None] & m_v[None, :], (row0 + t)[:, None] * Dv + o_v[None, :]
        kdS = _w_times_state(k_ptr, dh_n, dS, row0, t, m_t, o_k, m_k, o_v, m_v, Dk, Dv, BT, BK, BKW, BV, DOT_PREC)
        A = _gram(q_ptr, k_ptr, row0, t, m_t, Dk, BT, BKW, DOT_PREC)           # q_i . k_j
        q = _tile(q_ptr, row0, t, m_t, o_k, m_k, Dk).to(tl.float32)
        A, q, kdS, dS = _decayed(g_ptr, i_bh % H, row0, t, m_t, o_t, A, q, kdS, dS, BT, DECAY)
        do = _tile(do_ptr, row0, t, m_t, o_v, m_v, Dv).to(tl.float32)
        dvn = tl.dot(tl.trans(A), do, acc=kdS, input_precision=DOT_PREC)     # dV_new
        tl.store(dvn_ptr + tv_off, dvn, mask=m_tv)
        dS = tl.dot(tl.trans(q), do, acc=dS, input_precision=DOT_PREC)
        dS -= tl.dot(tl.trans(_tile(w_ptr, row0, t, m_t, o_k, m_k, Dk)), dvn, input_precision=DOT_PREC)
    if STORE_DS0:
        tl.store(ds0_ptr + i_bh * Dk * Dv + kv_off, dS, mask=m_kv)


@triton.jit
def _dqk_sums(do_ptr, vn_ptr, dvn_ptr, h_ptr, dh_ptr, row0, i_s, t, m_t, o_k, m_k, Dk, Dv,
              BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr):
    """Over the blocks of Dv: dO V_new^T (BT x BT), dO S_n^T, V_new dS_{n+1}^T, dV_new S_n^T
    (BT x BK) and sum(dS_{n+1} * S_n) over this Dk block; fp32."""
    ds, hh = tl.zeros([BT, BT], dtype=tl.float32), tl.zeros([BK], dtype=tl.float32)
    dqS = tl.zeros([BT, BK], dtype=tl.float32)
    dkH, dw = dqS, dqS
    for i_v in range(0, tl.cdiv(Dv, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < Dv
        do = _tile(do_ptr, row0, t, m_t, o_v, m_v, Dv).to(tl.float32)
        vn = _tile(vn_ptr, row0, t, m_t, o_v, m_v, Dv)
        s_off = i_s * Dk * Dv + o_k[:, None] * Dv + o_v[None, :]
        S = tl.load(h_ptr + s_off, mask=m_k[:, None] & m_v[None, :], other=0.0)
        dH = tl.load(dh_ptr + s_off, mask=m_k[:, None] & m_v[None, :], other=0.0)
        ds = tl.dot(do, tl.trans(vn), acc=ds, input_precision=DOT_PREC)
        dqS = tl.dot(do, tl.trans(S), acc=dqS, input_precision=DOT_PREC)
        dkH = tl.dot(vn, tl.trans(dH), acc=dkH, input_precision=DOT_PREC)
        dw = tl.dot(_tile(dvn_ptr, row0, t, m_t, o_v, m_v, Dv), tl.trans(S), acc=dw, input_precision=DOT_PREC)
        hh += tl.sum(S * dH, axis=1)
    return ds, dqS, dkH, dw, tl.sum(hh, axis=0)


@triton.jit
def delta_bwd_dqk_kernel(
    q_ptr, k_ptr, vn_ptr, dvn_ptr, do_ptr,   # Q, K (input dtype), V_new, dV_new (fp32), dO (input dtype)
    g_ptr, h_ptr, dh_ptr,     # log-decay (DECAY); S_n, dS_{n+1} (B, H, NT, Dk, Dv) fp32
    dq_ptr, dk0_ptr, dw_ptr,  # out: dq (input dtype); dk of o and the states, dW (B, H, T, Dk) fp32
    dg_ptr,                   # out (NK, B, H, T) fp32: this Dk block's part of dL/dg (DECAY)
    T, H, Dk, Dv, NT, n_rows, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DECAY: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One program per (key block, chunk, batch * head)."""
    i_k, i_n, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    row0, o_t = i_bh * T, tl.arange(0, BT)
    t = i_n * BT + o_t
    m_t = t < T
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = o_k < Dk
    ds, dqS, dkH, dw, hh = _dqk_sums(do_ptr, vn_ptr, dvn_ptr, h_ptr, dh_ptr, row0, i_bh * NT + i_n, t, m_t,
                                     o_k, m_k, Dk, Dv, BT, BK, BV, DOT_PREC)
    ds, dqS, dkH, hh = _decayed(g_ptr, i_bh % H, row0, t, m_t, o_t, ds, dqS, dkH, hh, BT, DECAY)
    q = _tile(q_ptr, row0, t, m_t, o_k, m_k, Dk).to(tl.float32)
    k = _tile(k_ptr, row0, t, m_t, o_k, m_k, Dk).to(tl.float32)
    dq = tl.dot(ds, k, acc=dqS, input_precision=DOT_PREC)
    dk = tl.dot(tl.trans(ds), q, acc=dkH, input_precision=DOT_PREC)
    m_tk, off = m_t[:, None] & m_k[None, :], (row0 + t)[:, None] * Dk + o_k[None, :]
    tl.store(dq_ptr + off, dq.to(dq_ptr.dtype.element_ty), mask=m_tk)
    tl.store(dk0_ptr + off, dk, mask=m_tk)
    tl.store(dw_ptr + off, -dw, mask=m_tk)
    if DECAY > 0:  # dL/dgc_i = q_i . dq_i - k_i . dk_i; the chunk total's terms reach every token
        dgc = tl.sum(q * dq - k * dk, axis=1)
        dg = tl.cumsum(dgc, axis=0, reverse=True) + hh + tl.sum(tl.sum(k * dkH, axis=1), axis=0)
        tl.store(dg_ptr + i_k * n_rows + row0 + t, dg, mask=m_t)


@triton.jit
def _wy_bwd_values(Ai, beta, v_ptr, du_ptr, dv_ptr, row0, t, m_t, Dv, BT: tl.constexpr, BV: tl.constexpr,
                   DOT_PREC: tl.constexpr):
    """U = A^-1 diag(beta) V: stores dv = beta (A^-1)^T dU; returns dU (beta V)^T and dbeta's part."""
    dAi, dbeta = tl.zeros([BT, BT], dtype=tl.float32), tl.zeros([BT], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(Dv, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < Dv
        v = _tile(v_ptr, row0, t, m_t, o_v, m_v, Dv).to(tl.float32)
        du = _tile(du_ptr, row0, t, m_t, o_v, m_v, Dv)
        dvb = tl.dot(tl.trans(Ai), du, input_precision=DOT_PREC)
        dbeta += tl.sum(dvb * v, axis=1)
        dAi = tl.dot(du, tl.trans(v * beta[:, None]), acc=dAi, input_precision=DOT_PREC)
        tl.store(dv_ptr + (row0 + t)[:, None] * Dv + o_v[None, :], (dvb * beta[:, None]).to(dv_ptr.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])
    return dAi, dbeta


@triton.jit
def _wy_bwd_keys(Ai, scale, dG, k_ptr, dw_ptr, dk0_ptr, dk_ptr, row0, t, m_t, Dk, BT: tl.constexpr,
                 BK: tl.constexpr, DOT_PREC: tl.constexpr, FINAL: tl.constexpr):
    """W = A^-1 diag(scale) K. FINAL False: returns dW (scale K)^T and ((A^-1)^T dW . K) per row;
    FINAL True: stores dk = dk0 + scale (A^-1)^T dW + (dG + dG^T) K."""
    dAi, dsc = tl.zeros([BT, BT], dtype=tl.float32), tl.zeros([BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(Dk, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < Dk
        k = _tile(k_ptr, row0, t, m_t, o_k, m_k, Dk).to(tl.float32)
        dw = _tile(dw_ptr, row0, t, m_t, o_k, m_k, Dk)
        dkb = tl.dot(tl.trans(Ai), dw, input_precision=DOT_PREC)
        if FINAL:
            dk = _tile(dk0_ptr, row0, t, m_t, o_k, m_k, Dk) + dkb * scale[:, None]
            dk = tl.dot(tl.trans(dG), k, acc=tl.dot(dG, k, acc=dk, input_precision=DOT_PREC), input_precision=DOT_PREC)
            tl.store(dk_ptr + (row0 + t)[:, None] * Dk + o_k[None, :], dk.to(dk_ptr.dtype.element_ty),
                     mask=m_t[:, None] & m_k[None, :])
        else:
            dsc += tl.sum(dkb * k, axis=1)
            dAi = tl.dot(dw, tl.trans(k * scale[:, None]), acc=dAi, input_precision=DOT_PREC)
    return dAi, dsc


@triton.jit
def delta_bwd_wy_kernel(
    k_ptr, v_ptr, beta_ptr, g_ptr,   # K, V, beta (input dtype); log-decay (DECAY)
    dw_ptr, du_ptr, dk0_ptr,  # dW, dU = dV_new, dk of o and the states (delta_bwd_dqk_kernel), fp32
    dk_ptr, dv_ptr, dbeta_ptr, dg_ptr,  # out: dk, dv, dbeta (input dtype); the wy part of dL/dg (B, H, T) fp32
    T, H, Dk, Dv, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DECAY: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """The UT transform backward, one program per (chunk, batch * head)."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    row0, o_t = i_bh * T, tl.arange(0, BT)
    t = i_n * BT + o_t
    m_t = t < T
    beta, gam, kk, Ai = _wy_inverse(k_ptr, beta_ptr, g_ptr, i_bh % H, row0, t, m_t, o_t, Dk, BT, BK, DECAY, DOT_PREC)
    dAi, dbeta = _wy_bwd_values(Ai, beta, v_ptr, du_ptr, dv_ptr, row0, t, m_t, Dv, BT, BV, DOT_PREC)
    dAk, dbg = _wy_bwd_keys(Ai, beta * gam, kk, k_ptr, dw_ptr, dk0_ptr, dk_ptr, row0, t, m_t, Dk, BT, BK,
                            DOT_PREC, False)
    # A = I + N, N = diag(beta) (K K^T * Gam)_strict: dN = -(A^-T (dA^-1) A^-T)_strict
    dN = tl.dot(tl.trans(Ai), tl.dot(dAi + dAk, tl.trans(Ai), input_precision=DOT_PREC), input_precision=DOT_PREC)
    dN = tl.where(o_t[:, None] > o_t[None, :], -dN, 0.0)
    dbeta += gam * dbg + tl.sum(dN * kk, axis=1)
    dG = dN * beta[:, None]                                                  # d(K K^T * Gam)
    dG_kk = dG                                                               # d(K K^T) = dG * Gam
    if DECAY > 0:
        dG_kk = dG * tl.exp(_chunk_decays(g_ptr, i_bh % H, row0, t, m_t, o_t, BT, DECAY)[0])
    _wy_bwd_keys(Ai, beta * gam, dG_kk, k_ptr, dw_ptr, dk0_ptr, dk_ptr, row0, t, m_t, Dk, BT, BK, DOT_PREC, True)
    tl.store(dbeta_ptr + row0 + t, dbeta.to(dbeta_ptr.dtype.element_ty), mask=m_t)
    if DECAY > 0:  # dL/dgc_i: beta gam from W, the rows minus the columns of dG * (K K^T * Gam)
        dgc = beta * gam * dbg + tl.sum(dG * kk, axis=1) - tl.sum(dG * kk, axis=0)
        tl.store(dg_ptr + row0 + t, tl.cumsum(dgc, axis=0, reverse=True), mask=m_t)


# --- launchers ---

def launch(kernel: str, device: torch.device, grid: tuple, cfg: dict, *args, **constexprs) -> None:
    """Launch `DELTA_KERNELS[kernel]` on `grid` with the tile sizes and warps of `cfg`."""
    from .configs import TRANSPOSED_DOT_KERNELS, refuse_transposed_dots
    if kernel in TRANSPOSED_DOT_KERNELS:  # Hopper with Triton in [3.4, 3.7.1): refused (configs.py)
        refuse_transposed_dots(f"the delta rule's backward ({kernel})", device)
    fn = DELTA_KERNELS[kernel]
    tiles = {n: cfg[n] for n in ("BT", "BK", "BV", "BKW") if n in cfg and n in fn.arg_names}
    launchable(fn, device)[checked_grid(kernel, *grid)](*args, **tiles, **constexprs, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _decay_args(log_decay: torch.Tensor | None, B: int, H: int, T: int) -> tuple[torch.Tensor | None, int]:
    """(fp32 contiguous log-decay or None, DECAY constexpr) after checking its shape."""
    if log_decay is None:
        return None, 0
    if tuple(log_decay.shape) not in ((H,), (B, H, T)):
        raise ValueError(f"delta_rule_fwd: log_decay must be (H,) = ({H},) or (B, H, T) = {(B, H, T)}, "
                         f"got {tuple(log_decay.shape)}")
    return log_decay.to(torch.float32).contiguous(), 1 if log_decay.dim() == 1 else 2


def delta_wy(k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *, log_decay: torch.Tensor | None = None,
             config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch `delta_wy_kernel`: (W (B, H, T, Dk), U (B, H, T, Dv)), fp32, per chunk of the
    config's BT (`_ut_transform` of linattn_lib/core/delta.py for every chunk)."""
    B, H, T, Dk = k.shape
    Dv = v.shape[-1]
    cfg = config or delta_config("delta_wy", Dk, k.dtype, device=k.device)
    g, decay = _decay_args(log_decay, B, H, T)
    w, u = (torch.empty(B, H, T, D, dtype=torch.float32, device=k.device) for D in (Dk, Dv))
    if B * H * T == 0:
        return w, u
    launch("delta_wy", k.device, (triton.cdiv(T, cfg["BT"]), B * H), cfg, k.contiguous(), v.contiguous(),
           beta.contiguous(), g if g is not None else w, w, u, T, H, Dk, Dv, DECAY=decay,
           DOT_PREC=dot_precision(k.dtype))
    return w, u


def delta_states(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, *, log_decay: torch.Tensor | None = None,
                 initial_state: torch.Tensor | None = None, store_final_state: bool = False,
                 config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch `delta_state_kernel`: (h (B, H, NT, Dk, Dv), V_new (B, H, T, Dv), S_final or None),
    fp32; h[:, :, n] is the state on entry to chunk n (the initial state or 0 for n = 0)."""
    B, H, T, Dk = k.shape
    Dv = u.shape[-1]
    cfg = config or delta_config("delta_state", Dk, k.dtype, device=k.device)
    NT = triton.cdiv(T, cfg["BT"])
    g, decay = _decay_args(log_decay, B, H, T)
    f32 = dict(dtype=torch.float32, device=k.device)
    h, vn = torch.empty(B, H, NT, Dk, Dv, **f32), torch.empty(B, H, T, Dv, **f32)
    S_T = torch.empty(B, H, Dk, Dv, **f32) if store_final_state else None
    S0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    if S0 is not None and S0.shape != (B, H, Dk, Dv):
        raise ValueError(f"delta_rule_fwd: initial_state must be (B, H, Dk, Dv) = {(B, H, Dk, Dv)}, "
                         f"got {tuple(S0.shape)}")
    if B * H == 0:
        return h, vn, S_T
    ptrs = [g, h, vn, S0, S_T]
    launch("delta_state", k.device, (triton.cdiv(Dv, cfg["BV"]), B * H), cfg, k.contiguous(), w, u,
           *(p if p is not None else h for p in ptrs), T, H, Dk, Dv, NT, DECAY=decay, HAS_S0=S0 is not None,
           STORE_ST=store_final_state, DOT_PREC=dot_precision(k.dtype))
    return h, vn, S_T


def delta_output(q: torch.Tensor, k: torch.Tensor, vn: torch.Tensor, h: torch.Tensor, *, out_dtype: torch.dtype,
                 log_decay: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """Launch `delta_output_kernel`: o (B, H, T, Dv) in `out_dtype`, from the pseudo-values and
    entry states of `delta_states` (computed with the same BT)."""
    B, H, T, Dk = q.shape
    Dv = vn.shape[-1]
    cfg = config or delta_config("delta_output", Dk, q.dtype, device=q.device)
    NT = triton.cdiv(T, cfg["BT"])
    if h.shape != (B, H, NT, Dk, Dv):
        raise ValueError(f"delta_output: entry states of shape {tuple(h.shape)} do not match "
                         f"(B, H, NT, Dk, Dv) = {(B, H, NT, Dk, Dv)} for chunks of {cfg['BT']}")
    g, decay = _decay_args(log_decay, B, H, T)
    o = torch.empty(B, H, T, Dv, dtype=out_dtype, device=q.device)
    if B * H * T == 0:
        return o
    launch("delta_output", q.device, (triton.cdiv(Dv, cfg["BV"]), NT, B * H), cfg, q.contiguous(), k.contiguous(),
           vn, g if g is not None else vn, h, o, T, H, Dk, Dv, NT, DECAY=decay, DOT_PREC=dot_precision(q.dtype))
    return o


def aligned_dim(d: int) -> int:
    """`d` rounded up to a multiple of 16: the head dims the kernels are launched with."""
    return -(-d // 16) * 16


def pad_head_dims(Dk: int, Dv: int, qk=(), v=(), states=()) -> list[torch.Tensor | None]:
    """Zero-pad keys / queries (last dim Dk), values (Dv) and states (Dk x Dv, or None) to
    `aligned_dim`: then the JIT knows every row stride is a multiple of 16 and compiles the
    kernels as tests/test_kernels_compile.py checks them (at odd head dims the state and
    backward kernels spill). Zero columns change no product; the caller slices them off."""
    pk, pv, pad = aligned_dim(Dk), aligned_dim(Dv), torch.nn.functional.pad
    return ([pad(x, (0, pk - Dk)) for x in qk] + [pad(x, (0, pv - Dv)) for x in v]
            + [None if S is None else pad(S, (0, pv - Dv, 0, pk - Dk)) for S in states])


def delta_rule_fwd_pieces(q, k, v, beta, *, log_decay=None, initial_state=None, store_final_state=False,
                          chunk_size=None) -> dict:
    """`delta_rule_fwd` keeping what a backward pass recomputes or reads: a dict with o, S_final,
    W, U (delta_wy), h, V_new (delta_states) and the chunk length BT."""
    Dk, Dv = q.shape[-1], v.shape[-1]
    if k.shape != q.shape or v.shape[:3] != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"delta_rule_fwd: q, k (B, H, T, Dk), v (B, H, T, Dv), beta (B, H, T) expected, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, {tuple(beta.shape)}")
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise ValueError(f"delta_rule_fwd: q, k, v need one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if initial_state is not None and initial_state.shape != (*q.shape[:2], Dk, Dv):
        raise ValueError(f"delta_rule_fwd: initial_state must be (B, H, Dk, Dv) = {(*q.shape[:2], Dk, Dv)}, "
                         f"got {tuple(initial_state.shape)}")
    if (aligned_dim(Dk), aligned_dim(Dv)) != (Dk, Dv):
        q, k, v, initial_state = pad_head_dims(Dk, Dv, (q, k), (v,), (initial_state,))
        p = delta_rule_fwd_pieces(q, k, v, beta, log_decay=log_decay, initial_state=initial_state,
                                  store_final_state=store_final_state, chunk_size=chunk_size)
        cut = {"o": (Dv,), "S_final": (Dk, Dv), "W": (Dk,), "U": (Dv,), "h": (Dk, Dv), "V_new": (Dv,)}
        return {n: x if x is None or n not in cut else x[..., :cut[n][0]] if len(cut[n]) == 1
                else x[..., :Dk, :Dv] for n, x in p.items()}
    cfgs = {name: delta_config(name, Dk, q.dtype, chunk_size, q.device) for name in DELTA_KERNELS}
    w, u = delta_wy(k, v, beta.to(q.dtype), log_decay=log_decay, config=cfgs["delta_wy"])
    h, vn, S_T = delta_states(k, w, u, log_decay=log_decay, initial_state=initial_state,
                              store_final_state=store_final_state, config=cfgs["delta_state"])
    o = delta_output(q, k, vn, h, out_dtype=v.dtype, log_decay=log_decay, config=cfgs["delta_output"])
    return {"o": o, "S_final": S_T, "W": w, "U": u, "h": h, "V_new": vn, "BT": cfgs["delta_wy"]["BT"]}


def delta_rule_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, *,
                   log_decay: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                   store_final_state: bool = False, chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked delta-rule forward: (o, S_final), as `delta_rule_attention(q, k, v, beta,
    log_decay=..., initial_state=..., return_state=True)` of linattn_lib/core/delta.py.

    q, k: (B, H, T, Dk), v: (B, H, T, Dv), one dtype (fp32, fp16, bf16); beta (B, H, T);
    log_decay None, (H,) or (B, H, T), <= 0; initial_state (B, H, Dk, Dv) (any float dtype,
    read as fp32). Dk <= 256. Returns o in the dtype of v and S_final (B, H, Dk, Dv) fp32 when
    store_final_state, else None. chunk_size: the chunk length (a power of two >= 16), default
    64 for 16-bit inputs, 32 for fp32. Inputs are not validated beyond their shapes (keys are
    expected unit, beta in (0, 2]: `delta_rule_attention` checks). No autograd here (core/delta_triton.py)."""
    pieces = delta_rule_fwd_pieces(q, k, v, beta, log_decay=log_decay, initial_state=initial_state,
                                   store_final_state=store_final_state, chunk_size=chunk_size)
    return pieces["o"], pieces["S_final"]


# kernel name -> the @triton.jit function (`launch`; `compile_spec`)
DELTA_KERNELS = {
    "delta_wy": delta_wy_kernel, "delta_state": delta_state_kernel, "delta_output": delta_output_kernel,
    "delta_bwd_state": delta_bwd_state_kernel, "delta_bwd_dqk": delta_bwd_dqk_kernel,
    "delta_bwd_wy": delta_bwd_wy_kernel,
}

def compile_spec(kernel: str):
    """`compile_spec(cfg, dtype) -> (signature, constexprs)` of `kernel`'s heaviest variant: a
    per-token decay, every optional state in and out (`configs.signature_of`)."""
    flags = {"DECAY": 2, "HAS_S0": True, "STORE_ST": True, "HAS_DST": True, "STORE_DS0": True}
    inputs = {"q_ptr", "k_ptr", "v_ptr", "beta_ptr", "o_ptr", "do_ptr", "dq_ptr", "dk_ptr", "dv_ptr", "dbeta_ptr"}
    return lambda cfg, dtype: signature_of(DELTA_KERNELS[kernel], cfg, dtype, flags, inputs)
