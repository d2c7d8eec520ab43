"""The chunked delta rule (DeltaNet, Gated DeltaNet): forward in three kernels.

The float64 reference is `delta_rule_attention` in linattn_lib/core/delta.py (read its module
docstring and `_ut_transform`); the tests are tests/test_kernels_delta.py (outputs, final
state, the stored entry states and pseudo-values against the float64 recurrence in the
interpreter, and every kernel compiled ahead of time for sm_80 / sm_90).

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,    o_t = S_t^T q_t

S is Dk x Dv (fp32 throughout), g_t <= 0 the log-gate (none, one per head or one per token).
Inside a chunk of BT tokens entered with state S_n the updates are additions,
S_i = a_i S_{i-1} + k_i u_i^T, of pseudo-values u_i that solve one unit lower triangular system
(`_ut_transform` of delta.py). The three kernels, as flash-linear-attention splits the work:

    delta_wy_kernel      parallel, one program per (chunk, batch * head): the UT transform.
                         A = I + tril(diag(beta) (K K^T * Gam), -1), Gam[i, j] = exp(g_{j+1} +
                         ... + g_i), inverted by forward substitution in registers (fp32), then
                         W = A^-1 diag(beta) (gam * K), U = A^-1 diag(beta) V, gam_i = exp(g_start
                         + ... + g_i); W and U stored fp32. Needs no state.
    delta_state_kernel   sequential over the chunks, one program per (value tile, batch * head),
                         Dk whole: on entry to chunk n it stores S_n, forms the pseudo-values
                         V_new = U - W S_n (stored, fp32) and steps
                         S_{n+1} = exp(g_last) S_n + (exp(a) * K)^T V_new, a_j = g_{j+1} + ...
                         + g_last. Initial state in, final state out.
    delta_output_kernel  parallel, one program per (value tile, chunk, batch * head):
                         o = (gam * Q) S_n + (Q K^T * Gam)_causal V_new.

Every log-decay comes from `chunk_log_decays` (chunk_fwd.py): sums of their own terms or
compensated differences, all <= 0, so no exp overflows (a reset, g = -1e4, gives exp = 0).
Products of two input tiles (K K^T, Q K^T) run in the input dtype with an fp32 accumulator
(tensor cores for fp16 / bf16); products with an fp32 operand (A^-1, W, the state, V_new) use
`dot_precision` (tf32 for 16-bit inputs, ieee for fp32). Padded tokens (t >= T) and padded head
dims are read as 0: a padded token has beta = 0 and g = 0, so its row of A is the identity's
and its W, U, V_new rows are 0.

The backward pass is not written yet (see `delta_rule_fwd`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk_fwd import chunk_log_decays
from .chunk_state import load_log_decay
from .configs import dot_precision, launchable, whole_dim

# --------------------------------------------------------------------------------------
# configs
# --------------------------------------------------------------------------------------

# class -> (BT, BK, BV, num_warps). The three kernels share the chunk length BT. BK is the Dk
# block of the loops of delta_wy_kernel / delta_output_kernel; the state kernel holds Dk whole
# (padded to `whole_dim`: 64, 128 or 256) and its entry's BK is the Dk block of its product
# W S_n (0: Dk whole, from registers; a block re-reads S_n as stored, see `_w_times_state`).
# BV: value columns per program (delta_wy_kernel: the Dv block of its U loop).
#   mma16: fp16 / bf16 on sm_80+ (tensor cores): 64-token chunks, 2 stages.
#   fp32:  float32 inputs (true fp32 products: FMA loops, every reduction blocked by 32):
#          32-token chunks, 1 stage.
# Not tuned on a GPU: picked from the ahead-of-time compile of the heaviest variants (bf16 and
# fp32, sm_80 and sm_90, D = 64 / 128, tests/test_kernels_delta.py): no spill instructions.
# The state kernel's 64 x 128 W tile and 128 x 32 state spilled 26 instructions (bf16, sm_80)
# on 4 warps: 8 warps (244 / 254 registers on sm_80 / sm_90); with Dk = 128 whole in its W S_n
# product the fp32 variant spilled ~1,000, blocked by 32 none (168 / 152).
DELTA_CONFIGS: dict[str, dict[str, tuple[int, int, int, int]]] = {
    "delta_wy": {"mma16": (64, 64, 64, 4), "fp32": (32, 32, 32, 4)},
    "delta_state": {"mma16": (64, 0, 32, 8), "fp32": (32, 32, 32, 4)},
    "delta_output": {"mma16": (64, 32, 32, 4), "fp32": (32, 32, 32, 4)},
}
# The state kernel at Dk = 256: the whole-Dk product spilled 62-186 instructions in bf16 at
# every BV; blocks of 64 with 16 value columns on 8 warps none (190 registers).
_STATE_256 = {"mma16": (64, 64, 16, 8), "fp32": (32, 32, 32, 8)}


def delta_config(kernel: str, Dk: int, dtype: torch.dtype, chunk_size: int | None = None) -> dict:
    """The launch config of `kernel` ("delta_wy", "delta_state", "delta_output") for key dim Dk
    and inputs of `dtype`; `chunk_size` (a power of two >= 16) overrides BT."""
    cls = "fp32" if dtype == torch.float32 else "mma16"
    BT, BK, BV, num_warps = DELTA_CONFIGS[kernel][cls]
    stages = 1 if cls == "fp32" else 2
    extra = {}
    if kernel == "delta_state":
        whole = whole_dim(Dk)
        if whole == 256:
            BT, BK, BV, num_warps = _STATE_256[cls]
        extra = {"BKW": BK or whole}
        BK = whole
        if extra["BKW"] < BK:  # S_n is read back after its store: no loads pipelined across it
            stages = 1
    if chunk_size is not None:
        if chunk_size < 16 or chunk_size & (chunk_size - 1):
            raise ValueError(f"delta_rule_fwd: chunk_size must be a power of two >= 16, got {chunk_size}")
        BT = chunk_size
    return {"BT": BT, "BK": BK, **extra, "BV": BV, "num_warps": num_warps, "num_stages": stages}


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------

@triton.jit
def _chunk_decays(g_ptr, i_h, row0, t, m_t, o_t, BT: tl.constexpr, DECAY: tl.constexpr):
    """(L, gc, after, g_last) of one chunk (`chunk_log_decays`): L[i, j] = g_{j+1} + ... + g_i
    below the diagonal (0 elsewhere), gc_i = g_start + ... + g_i, after_j = g_{j+1} + ... +
    g_last, g_last the chunk's total; all zeros without a decay."""
    g = load_log_decay(g_ptr, i_h, row0, t, m_t, DECAY)
    return chunk_log_decays(g, o_t, BT, False, DECAY == 1)


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
def _solve_columns(Ai, src_ptr, dst_ptr, row0, t, m_t, scale, D, BT: tl.constexpr, BD: tl.constexpr,
                   DOT_PREC: tl.constexpr):
    """dst = Ai @ (scale * src) over one chunk's rows, D walked in blocks of BD; fp32 out."""
    for i_d in range(0, tl.cdiv(D, BD)):
        o_d = i_d * BD + tl.arange(0, BD)
        m_d = o_d < D
        x = _tile(src_ptr, row0, t, m_t, o_d, m_d, D).to(tl.float32) * scale[:, None]
        y = tl.dot(Ai, x, input_precision=DOT_PREC)
        tl.store(dst_ptr + (row0 + t)[:, None] * D + o_d[None, :], y, mask=m_t[:, None] & m_d[None, :])


# --------------------------------------------------------------------------------------
# the kernels
# --------------------------------------------------------------------------------------

@triton.jit
def delta_wy_kernel(
    k_ptr, v_ptr,             # (B, H, T, Dk), (B, H, T, Dv) contiguous, input dtype
    beta_ptr,                 # (B, H, T) write strengths, input dtype
    g_ptr,                    # log-decay: (H,) if DECAY == 1, (B, H, T) if DECAY == 2 (fp32)
    w_ptr, u_ptr,             # out: W (B, H, T, Dk), U (B, H, T, Dv), fp32
    T, H, Dk, Dv,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DECAY: tl.constexpr,      # 0: none, 1: one log-decay per head, 2: one per token
    DOT_PREC: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_h = i_bh % H
    row0 = i_bh * T
    o_t = tl.arange(0, BT)
    t = i_n * BT + o_t
    m_t = t < T
    beta = tl.load(beta_ptr + row0 + t, mask=m_t, other=0.0).to(tl.float32)
    kk = _gram(k_ptr, k_ptr, row0, t, m_t, Dk, BT, BK, DOT_PREC)            # k_i . k_j
    gam = tl.full([BT], 1.0, dtype=tl.float32)
    if DECAY > 0:
        L, gc, _, _ = _chunk_decays(g_ptr, i_h, row0, t, m_t, o_t, BT, DECAY)
        kk = kk * tl.exp(L)                                                  # L <= 0
        gam = tl.exp(gc)
    strict = o_t[:, None] > o_t[None, :]
    Ai = _unit_lower_inverse(tl.where(strict, kk * beta[:, None], 0.0), o_t, BT)
    _solve_columns(Ai, k_ptr, w_ptr, row0, t, m_t, beta * gam, Dk, BT, BK, DOT_PREC)   # W
    _solve_columns(Ai, v_ptr, u_ptr, row0, t, m_t, beta, Dv, BT, BV, DOT_PREC)         # U


@triton.jit
def _w_times_state(w_ptr, hn_ptr, S, row0, t, m_t, o_k, m_k, o_v, m_v, Dk, Dv, BT: tl.constexpr, BK: tl.constexpr,
                   BKW: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr):
    """W S_n (BT x BV, fp32) for one chunk; S_n is in registers and was just stored at hn_ptr.

    BKW == BK: one product over the whole Dk. BKW < BK: Dk in blocks of BKW, each block of S_n
    read back from hn_ptr (after a barrier: other threads of the program stored it). That is for
    fp32 inputs, whose true-fp32 tl.dot is a loop of FMAs that holds each thread's rows and
    columns of both operands over the whole reduction: over Dk = 128 it spills hundreds of
    registers, over blocks of 32 none."""
    if BKW == BK:
        w = _tile(w_ptr, row0, t, m_t, o_k, m_k, Dk)
        ws = tl.dot(w, S, input_precision=DOT_PREC)
    else:
        tl.debug_barrier()
        ws = tl.zeros([BT, BV], dtype=tl.float32)
        for i_k in tl.static_range(0, BK // BKW):
            o_b = i_k * BKW + tl.arange(0, BKW)
            m_b = o_b < Dk
            w = _tile(w_ptr, row0, t, m_t, o_b, m_b, Dk)
            s = tl.load(hn_ptr + o_b[:, None] * Dv + o_v[None, :], mask=m_b[:, None] & m_v[None, :], other=0.0)
            ws = tl.dot(w, s, acc=ws, input_precision=DOT_PREC)
    return ws


@triton.jit
def delta_state_kernel(
    k_ptr,                    # (B, H, T, Dk) contiguous, input dtype
    w_ptr, u_ptr,             # W (B, H, T, Dk), U (B, H, T, Dv) fp32 (delta_wy_kernel)
    g_ptr,                    # log-decay: (H,) if DECAY == 1, (B, H, T) if DECAY == 2 (fp32)
    h_ptr,                    # out: entry states (B, H, NT, Dk, Dv) fp32
    vn_ptr,                   # out: pseudo-values V_new (B, H, T, Dv) fp32
    s0_ptr, st_ptr,           # initial (HAS_S0), final (STORE_ST) state (B, H, Dk, Dv) fp32
    T, H, Dk, Dv, NT,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,   # BK: Dk whole, padded
    BKW: tl.constexpr,        # Dk block of the product W S_n (BK: whole, from registers)
    DECAY: tl.constexpr, HAS_S0: tl.constexpr, STORE_ST: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    i_h = i_bh % H
    row0 = i_bh * T
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < Dk
    m_v = o_v < Dv
    m_kv = m_k[:, None] & m_v[None, :]
    kv_off = o_k[:, None] * Dv + o_v[None, :]
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
    vn_ptr,                   # pseudo-values V_new (B, H, T, Dv) fp32 (delta_state_kernel)
    g_ptr,                    # log-decay: (H,) if DECAY == 1, (B, H, T) if DECAY == 2 (fp32)
    h_ptr,                    # entry states (B, H, NT, Dk, Dv) fp32 (delta_state_kernel)
    o_ptr,                    # out: (B, H, T, Dv), in the dtype of v
    T, H, Dk, Dv, NT,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DECAY: tl.constexpr, DOT_PREC: tl.constexpr,
):
    i_v = tl.program_id(0)
    i_n = tl.program_id(1)
    i_bh = tl.program_id(2).to(tl.int64)
    i_h = i_bh % H
    row0 = i_bh * T
    o_t = tl.arange(0, BT)
    t = i_n * BT + o_t
    m_t = t < T
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < Dv
    A, o = _scores_and_inter(q_ptr, k_ptr, h_ptr, row0, i_bh * NT + i_n, t, m_t, o_v, m_v, Dk, Dv,
                             BT, BK, BV, DOT_PREC)
    if DECAY > 0:
        L, gc, _, _ = _chunk_decays(g_ptr, i_h, row0, t, m_t, o_t, BT, DECAY)
        A = A * tl.exp(L)                   # L <= 0 (0 outside the causal triangle)
        o = o * tl.exp(gc)[:, None]         # S_n decayed to each query
    A = tl.where(o_t[:, None] >= o_t[None, :], A, 0.0)
    vn = _tile(vn_ptr, row0, t, m_t, o_v, m_v, Dv)
    o = tl.dot(A, vn, acc=o, input_precision=DOT_PREC)
    tl.store(o_ptr + (row0 + t)[:, None] * Dv + o_v[None, :], o.to(o_ptr.dtype.element_ty),
             mask=m_t[:, None] & m_v[None, :])


# --------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------

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
    cfg = config or delta_config("delta_wy", Dk, k.dtype)
    g, decay = _decay_args(log_decay, B, H, T)
    w = torch.empty(B, H, T, Dk, dtype=torch.float32, device=k.device)
    u = torch.empty(B, H, T, Dv, dtype=torch.float32, device=k.device)
    if B * H * T == 0:
        return w, u
    launchable(delta_wy_kernel, k.device)[(triton.cdiv(T, cfg["BT"]), B * H)](
        k.contiguous(), v.contiguous(), beta.contiguous(), g if g is not None else w, w, u, T, H, Dk, Dv,
        BT=cfg["BT"], BK=cfg["BK"], BV=cfg["BV"], DECAY=decay, DOT_PREC=dot_precision(k.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return w, u


def delta_states(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, *, log_decay: torch.Tensor | None = None,
                 initial_state: torch.Tensor | None = None, store_final_state: bool = False,
                 config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Launch `delta_state_kernel`: (h (B, H, NT, Dk, Dv), V_new (B, H, T, Dv), S_final or None),
    fp32; h[:, :, n] is the state on entry to chunk n (the initial state or 0 for n = 0)."""
    B, H, T, Dk = k.shape
    Dv = u.shape[-1]
    cfg = config or delta_config("delta_state", Dk, k.dtype)
    NT = triton.cdiv(T, cfg["BT"])
    g, decay = _decay_args(log_decay, B, H, T)
    f32 = dict(dtype=torch.float32, device=k.device)
    h = torch.empty(B, H, NT, Dk, Dv, **f32)
    vn = torch.empty(B, H, T, Dv, **f32)
    S_T = torch.empty(B, H, Dk, Dv, **f32) if store_final_state else None
    S0 = None if initial_state is None else initial_state.to(torch.float32).contiguous()
    if S0 is not None and S0.shape != (B, H, Dk, Dv):
        raise ValueError(f"delta_rule_fwd: initial_state must be (B, H, Dk, Dv) = {(B, H, Dk, Dv)}, "
                         f"got {tuple(S0.shape)}")
    if B * H == 0:
        return h, vn, S_T
    ptrs = [g, h, vn, S0, S_T]
    launchable(delta_state_kernel, k.device)[(triton.cdiv(Dv, cfg["BV"]), B * H)](
        k.contiguous(), w, u, *(p if p is not None else h for p in ptrs), T, H, Dk, Dv, NT,
        BT=cfg["BT"], BK=cfg["BK"], BV=cfg["BV"], BKW=cfg["BKW"], DECAY=decay, HAS_S0=S0 is not None,
        STORE_ST=store_final_state, DOT_PREC=dot_precision(k.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return h, vn, S_T


def delta_output(q: torch.Tensor, k: torch.Tensor, vn: torch.Tensor, h: torch.Tensor, *, out_dtype: torch.dtype,
                 log_decay: torch.Tensor | None = None, config: dict | None = None) -> torch.Tensor:
    """Launch `delta_output_kernel`: o (B, H, T, Dv) in `out_dtype`, from the pseudo-values and
    entry states of `delta_states` (computed with the same BT)."""
    B, H, T, Dk = q.shape
    Dv = vn.shape[-1]
    cfg = config or delta_config("delta_output", Dk, q.dtype)
    NT = triton.cdiv(T, cfg["BT"])
    if h.shape != (B, H, NT, Dk, Dv):
        raise ValueError(f"delta_output: entry states of shape {tuple(h.shape)} do not match "
                         f"(B, H, NT, Dk, Dv) = {(B, H, NT, Dk, Dv)} for chunks of {cfg['BT']}")
    g, decay = _decay_args(log_decay, B, H, T)
    o = torch.empty(B, H, T, Dv, dtype=out_dtype, device=q.device)
    if B * H * T == 0:
        return o
    launchable(delta_output_kernel, q.device)[(triton.cdiv(Dv, cfg["BV"]), NT, B * H)](
        q.contiguous(), k.contiguous(), vn, g if g is not None else vn, h, o, T, H, Dk, Dv, NT,
        BT=cfg["BT"], BK=cfg["BK"], BV=cfg["BV"], DECAY=decay, DOT_PREC=dot_precision(q.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return o


def delta_rule_fwd_pieces(q, k, v, beta, *, log_decay=None, initial_state=None, store_final_state=False,
                          chunk_size=None) -> dict:
    """`delta_rule_fwd` keeping what a backward pass recomputes or reads: a dict with o, S_final,
    W, U (delta_wy), h, V_new (delta_states) and the chunk length BT."""
    Dk = q.shape[-1]
    if k.shape != q.shape or v.shape[:3] != q.shape[:3] or beta.shape != q.shape[:3]:
        raise ValueError(f"delta_rule_fwd: q, k (B, H, T, Dk), v (B, H, T, Dv), beta (B, H, T) expected, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}, {tuple(beta.shape)}")
    if len({q.dtype, k.dtype, v.dtype}) != 1:
        raise ValueError(f"delta_rule_fwd: q, k, v need one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    cfgs = {name: delta_config(name, Dk, q.dtype, chunk_size) for name in DELTA_CONFIGS}
    w, u = delta_wy(k, v, beta.to(q.dtype), log_decay=log_decay, config=cfgs["delta_wy"])
    h, vn, S_T = delta_states(k, w, u, log_decay=log_decay, initial_state=initial_state,
                              store_final_state=store_final_state, config=cfgs["delta_state"])
    o = delta_output(q, k, vn, h, out_dtype=v.dtype, log_decay=log_decay, config=cfgs["delta_output"])
    return {"o": o, "S_final": S_T, "W": w, "U": u, "h": h, "V_new": vn, "BT": cfgs["delta_wy"]["BT"]}


def delta_rule_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    log_decay: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    store_final_state: bool = False,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked delta-rule forward: (o, S_final), as `delta_rule_attention(q, k, v, beta,
    log_decay=..., initial_state=..., return_state=True)` of linattn_lib/core/delta.py.

    q, k: (B, H, T, Dk), v: (B, H, T, Dv), one dtype (fp32, fp16, bf16); beta (B, H, T);
    log_decay None, (H,) or (B, H, T), <= 0; initial_state (B, H, Dk, Dv) (any float dtype,
    read as fp32). Dk <= 256. Returns o in the dtype of v and S_final (B, H, Dk, Dv) fp32 when
    store_final_state, else None. chunk_size: the chunk length (a power of two >= 16), default
    64 for 16-bit inputs, 32 for fp32. Inputs are not validated beyond their shapes (keys are
    expected unit, beta in (0, 2]: `delta_rule_attention` checks). Forward only: no autograd.
    """
    pieces = delta_rule_fwd_pieces(q, k, v, beta, log_decay=log_decay, initial_state=initial_state,
                                   store_final_state=store_final_state, chunk_size=chunk_size)
    return pieces["o"], pieces["S_final"]


# --------------------------------------------------------------------------------------
# ahead-of-time compilation: signature and constexprs of each kernel's heaviest variant
# --------------------------------------------------------------------------------------

def _with_constexprs(signature: dict, constexprs: dict) -> tuple[dict, dict]:
    signature = dict(signature)
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return signature, constexprs


def compile_spec_wy(cfg: dict, dtype: str) -> tuple[dict, dict]:
    """`delta_wy_kernel` with a per-token decay."""
    signature = {"k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "beta_ptr": f"*{dtype}", "g_ptr": "*fp32",
                 "w_ptr": "*fp32", "u_ptr": "*fp32", "T": "i32", "H": "i32", "Dk": "i32", "Dv": "i32"}
    constexprs = {"BT": cfg["BT"], "BK": cfg["BK"], "BV": cfg["BV"], "DECAY": 2, "DOT_PREC": dot_precision(dtype)}
    return _with_constexprs(signature, constexprs)


def compile_spec_state(cfg: dict, dtype: str) -> tuple[dict, dict]:
    """`delta_state_kernel` with a per-token decay, initial and final state."""
    signature = {"k_ptr": f"*{dtype}", "w_ptr": "*fp32", "u_ptr": "*fp32", "g_ptr": "*fp32", "h_ptr": "*fp32",
                 "vn_ptr": "*fp32", "s0_ptr": "*fp32", "st_ptr": "*fp32", "T": "i32", "H": "i32", "Dk": "i32",
                 "Dv": "i32", "NT": "i32"}
    constexprs = {"BT": cfg["BT"], "BK": cfg["BK"], "BV": cfg["BV"], "BKW": cfg["BKW"], "DECAY": 2, "HAS_S0": True,
                  "STORE_ST": True, "DOT_PREC": dot_precision(dtype)}
    return _with_constexprs(signature, constexprs)


def compile_spec_output(cfg: dict, dtype: str) -> tuple[dict, dict]:
    """`delta_output_kernel` with a per-token decay."""
    signature = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "vn_ptr": "*fp32", "g_ptr": "*fp32", "h_ptr": "*fp32",
                 "o_ptr": f"*{dtype}", "T": "i32", "H": "i32", "Dk": "i32", "Dv": "i32", "NT": "i32"}
    constexprs = {"BT": cfg["BT"], "BK": cfg["BK"], "BV": cfg["BV"], "DECAY": 2, "DOT_PREC": dot_precision(dtype)}
    return _with_constexprs(signature, constexprs)


# kernel name (a key of DELTA_CONFIGS) -> (the @triton.jit function, compile_spec(config, dtype))
DELTA_KERNELS = {
    "delta_wy": (delta_wy_kernel, compile_spec_wy),
    "delta_state": (delta_state_kernel, compile_spec_state),
    "delta_output": (delta_output_kernel, compile_spec_output),
}
