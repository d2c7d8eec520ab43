"""Two-phase causal backward: the state gradient per chunk, then every chunk's
dq, dk, dv.

The autograd wrappers call it through `causal_backward` in
linattn_lib/core/triton_ops.py; the
tests are tests/test_kernels_two_phase.py (each phase against float64) and
tests/test_kernels_interpret.py (gradients of the whole op). The forward
(chunk_state.py, chunk_output.py) computes, per chunk with entry state
(S_n, z_n), gc_i the decay from the chunk start to token i, a_j from token j to
the chunk end and L_ij from j to i (all from `chunk_log_decays`, all <= 0):

    num_i = sum_{j <= i} exp(L_ij) (q_i . k_j) v_j + exp(gc_i) q_i S_n
    den_i = sum_{j <= i} exp(L_ij) (q_i . k_j)     + exp(gc_i) q_i . z_n + eps
    o_i   = num_i / den_i

With dO the output cotangent, r_i = 1 / den_i and e_i = -(dO_i . o_i) / den_i
(the gradient of den_i), both fp32, formed by `chunk_bwd_prep_kernel`, the
gradient is linear attention again:

    phase 1  dH_n: the gradient of the state leaving chunk n,
             from the last chunk back,
             dH_{n-1} = exp(g_last) dH_n + sum_i exp(gc_i) r_i q_i^T dO_i
                                                          (dZ with e_i q_i)
             -- chunk_state.py run in reverse with (k, v) = (q, dO),
             keys scaled by r; the state before chunk 0 comes out as the
             gradient of the initial state;
    phase 2  every chunk on its own, with
             W_ij = exp(L_ij) (r_i (dO_i . v_j) + e_i), i >= j,
             dq_i = sum_j W_ij k_j + exp(gc_i) (r_i dO_i S_n^T + e_i z_n)
                                                           chunk_dqk_kernel
             dk_j = sum_i W_ij q_i + exp(a_j)  (v_j dH_n^T + dZ_n)
                                                           chunk_dqk_kernel
             dv_j = sum_i exp(L_ij) r_i (q_i . k_j) dO_i + exp(a_j) k_j dH_n
                                                            chunk_dv_kernel

and the log-decay's gradient, dL/dG_t = q_t . dq_t - k_t . dk_t, summed over the
tokens after each (a suffix sum, decay_grad_kernel). The dqk kernel forms the
row products from its fp32 dq, dk before they are rounded, one partial per Dk
block. r, e and the suffix sum are chunk_grad_prep.py's.

One kernel, or two. chunk_dqk_kernel (a program per chunk and Dk block) and
chunk_dv_kernel (a program per chunk and value tile) both read the chunk's q, k,
dO and dH_n; chunk_dqkv_kernel does both kernels' work in one program per chunk
(W once, the second reads from L2): the GPU check's candidate (`fused_dqkv`).

Precision. 1 / den and dL/dden are fp32 and never meet fp16: dO / den underflows
fp16 for a mean loss over long sequences (where the previous engine needed loss
scaling and fp32 copies of dO). The products that carry r or e (W with k and q,
the state terms) are fp32 operands (tf32 for 16-bit inputs, fp32 range); dO v^T
and q k^T run in the input dtype. (Phase 1's product is the exception for bf16,
whose range is fp32's: its scaled queries are rounded to bf16, as the forward's
decayed keys are; see chunk_state.py.) dq, dk, dv are written in the input dtype
directly. For bf16 inputs the per-chunk states are stored in bf16 between the
kernels, as fla stores its forward's (half the bytes of the largest tensors),
and so are the state gradients unless the log-decay's gradient is asked for
(`chunk_bwd_two_phase`): the products that read them take them back to fp32
(tf32).

Masks select, they do not multiply, and the dead tail (tokens from `lengths`:
past the last nonzero cotangent) is read as 0, as in the forward kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk_decay import (
    ChunkDecays,
    chunk_decays,
    chunk_decays_at,
    launch_config,
)
from .chunk_fwd import _gap
from .chunk_grad_prep import chunk_bwd_prep, decay_grad
from .chunk_state import chunk_states, state_config
from .configs import dot_precision, launchable, max_registers, rounds_operands
from .sequences import (
    as_f32,
    cdiv,
    chunk_of_program,
    dim_mask,
    even_dims,
    first_chunk,
    is_padding_chunk,
    packed_layout,
    sequence_rows,
)
from .shapes import check_backward, checked_grid
from .shapes import entry_states as checked_states


@triton.jit
def _load_rows(ptr, c_row, o_r, m_t, o_c, m_c, D):
    """A (BT x block) tile of a (rows x D) tensor, rows c_row + o_r; 0 outside
    the masks. c_row, the chunk's first row, is 64-bit and the tile's offsets
    from it 32-bit: 64-bit offsets for every element cost ~6% of the
    instructions (chunk_output_kernel, sm_90)."""
    return tl.load(ptr + c_row * D + (o_r[:, None] * D + o_c[None, :]),
                   mask=m_t[:, None] & m_c[None, :], other=0.0)


@triton.jit
def _dqk_products(
    do_ptr, v_ptr, h_ptr, dh_ptr, c_row, o_r, i_s, m_t, o_k, m_k, Dk, Dv,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_PREC: tl.constexpr, ROUND: tl.constexpr, EVEN_D: tl.constexpr,
    SCORES: tl.constexpr = True, STATES: tl.constexpr = True,
):
    """Over the blocks of Dv: dO v^T (BT x BT, SCORES), dO S_n^T (BT x BK) and
    dH_n v^T (BK x BT: dk's state term, transposed like dk) (STATES), fp32
    (ROUND: the states rounded to the input dtype first)."""
    A = tl.zeros([BT, BT], dtype=tl.float32)
    dqS = tl.zeros([BT, BK], dtype=tl.float32)
    dkH = tl.zeros([BK, BT], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(Dv, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = dim_mask(o_v, Dv, BV, EVEN_D)
        do = _load_rows(do_ptr, c_row, o_r, m_t, o_v, m_v, Dv)
        v = _load_rows(v_ptr, c_row, o_r, m_t, o_v, m_v, Dv)
        if STATES:
            s_off = i_s * Dk * Dv + o_k[:, None] * Dv + o_v[None, :]
            m_kv = m_k[:, None] & m_v[None, :]
            # fp32 or bf16 (see below)
            if ROUND:
                S = tl.load(h_ptr + s_off, mask=m_kv, other=0.0).to(do.dtype)
            else:
                S = tl.load(h_ptr + s_off, mask=m_kv,
                            other=0.0).to(tl.float32)
            dH = tl.load(dh_ptr + s_off, mask=m_kv, other=0.0)
        if SCORES:
            A = tl.dot(do, tl.trans(v), acc=A, input_precision=DOT_PREC)
        if STATES:
            if ROUND:
                dqS = tl.dot(do, tl.trans(S), acc=dqS)
                dkH = tl.dot(dH.to(v.dtype), tl.trans(v), acc=dkH)
            else:
                dqS = tl.dot(do.to(tl.float32), tl.trans(S), acc=dqS,
                             input_precision=DOT_PREC)
                dkH = tl.dot(dH.to(tl.float32), tl.trans(v.to(tl.float32)),
                             acc=dkH, input_precision=DOT_PREC)
    return A, dqS, dkH


@triton.jit
def _weights(A, M, r_ptr, e_ptr, c_row, o_r, m_t, NORMALIZE: tl.constexpr):
    """The chunk's gradient weights W = M (r A + e) (NORMALIZE) or M A, from
    A = dO v^T and the decays M."""
    if NORMALIZE:
        r = tl.load(r_ptr + c_row + o_r, mask=m_t, other=0.0)
        e = tl.load(e_ptr + c_row + o_r, mask=m_t, other=0.0)
        W = M * (r[:, None] * A + e[:, None])
    else:
        W = M * A
    return W


@triton.jit
def _w_product(x, W, acc, W_FIRST: tl.constexpr, ROUND: tl.constexpr,
               DOT_PREC: tl.constexpr):
    """acc + W x (W_FIRST) or acc + x W, for x loaded in the input dtype: in
    tf32 from fp32 operands, or (ROUND) with W rounded to x's dtype."""
    if ROUND:
        w = W.to(x.dtype)
    else:
        x = x.to(tl.float32)
        w = W
    if W_FIRST:
        out = tl.dot(w, x, acc=acc, input_precision=DOT_PREC)
    else:
        out = tl.dot(x, w, acc=acc, input_precision=DOT_PREC)
    return out


@triton.jit
def _decays(g_ptr, hi_ptr, lo_ptr, ka_ptr, kr_ptr, i_h, i_s, row0, i_n, t,
            T_live, o_t, BT: tl.constexpr, DECAY: tl.constexpr,
            TRANSPOSED: tl.constexpr = False):
    """exp(L) on the causal triangle (0 off it), exp(gc) and exp(a) of chunk
    i_n (entry i_s of the per-chunk tables). TRANSPOSED: exp(L)^T (row j,
    column i), for products that give the keys' rows.

    A decay per token comes from `chunk_decays`' tables: exp(gc) and exp(a)
    are its kr and ka, and L[i, j] = P_i - P_j the gap of its compensated
    prefix sums (hi, lo), as the output kernel forms it. Scanning the chunk's
    log-decays here instead cost 209 of dv's 1323 SASS instructions and 169
    of dqk's 1329 (sm_90, bf16: scans, shuffles, layout changes through shared
    memory), and dv 20 more registers (168)."""
    if TRANSPOSED:
        visible = o_t[:, None] <= o_t[None, :]
    else:
        visible = o_t[:, None] >= o_t[None, :]
    if DECAY == 2:
        at = i_s * BT + o_t
        hi, lo = tl.load(hi_ptr + at), tl.load(lo_ptr + at)
        if TRANSPOSED:  # row j, column i: P_i - P_j
            L = _gap(hi[None, :], lo[None, :], hi[:, None], lo[:, None])
        else:
            L = _gap(hi[:, None], lo[:, None], hi[None, :], lo[None, :])
        return (tl.where(visible, tl.exp(L), 0.0),
                tl.load(kr_ptr + at), tl.load(ka_ptr + at))
    elif DECAY == 1:
        L, first, second, _ = chunk_decays_at(
            g_ptr, i_h, row0, i_n, t, T_live, BT, TRANSPOSED, DECAY)
        if TRANSPOSED:
            return (tl.where(visible, tl.exp(L), 0.0),
                    tl.exp(second), tl.exp(first))
        return (tl.where(visible, tl.exp(L), 0.0),
                tl.exp(first), tl.exp(second))
    else:
        ones = tl.full([BT], 1.0, dtype=tl.float32)
        return tl.where(visible, 1.0, 0.0), ones, ones


@triton.jit
def _chunk_program(cu_ptr, co_ptr, ci_ptr, len_ptr, T, H, NT,
                   BT: tl.constexpr, HAS_LEN: tl.constexpr,
                   IS_VARLEN: tl.constexpr):
    """Where a parallel program's chunk is: (row of its sequence's first token,
    head, index of its per-chunk states, its index i_n in the sequence, its
    tokens t, the bound below which they are read (T_live) and stored (T_seq),
    whether the program has no chunk and returns: a slot past the last chunk
    of packed sequences, sequences.py). With HAS_LEN the tokens from len on
    are read as 0, and their gradients stored as 0."""
    i_hb = tl.program_id(2).to(tl.int64)
    i_seq, i_h, i_n = chunk_of_program(
        tl.program_id(1), i_hb, ci_ptr, H, IS_VARLEN)
    row0, T_seq = sequence_rows(i_seq, i_h, cu_ptr, T, H, IS_VARLEN)
    T_live = T_seq
    if HAS_LEN:
        T_live = tl.minimum(T_seq, tl.load(len_ptr + i_hb))
    i_s = first_chunk(i_seq, i_h, co_ptr, NT, H, IS_VARLEN) + i_n
    t = i_n * BT + tl.arange(0, BT)
    skip = False
    if IS_VARLEN:
        skip = is_padding_chunk(i_n, T_seq, BT)
    return row0, i_h, i_s, i_n, t, T_live, T_seq, skip


@triton.jit
def _dq_dk(
    q_ptr, k_ptr, v_ptr, do_ptr, g_ptr, hi_ptr, lo_ptr, ka_ptr, kr_ptr,
    r_ptr, e_ptr, h_ptr, hz_ptr, dh_ptr, dhz_ptr, dq_ptr, dk_ptr, dg_ptr,
    row0, i_h, i_s, i_n, t, T_live, T_seq, i_k, Dk, Dv, n_rows,
    W, q_decay, k_decay,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DECAY: tl.constexpr, DG: tl.constexpr, NORMALIZE: tl.constexpr,
    HAS_LEN: tl.constexpr, DOT_PREC: tl.constexpr, KEPT: tl.constexpr,
    ROUND: tl.constexpr, W_GIVEN: tl.constexpr, EVEN_D: tl.constexpr,
):
    """dq and dk of Dk block i_k of a chunk (`_chunk_program`'s), and (DG) its
    partial of q . dq - k . dk; the gradient weights W and the decays q_decay,
    k_decay formed here, or given (W_GIVEN)."""
    m_t, m_out = t < T_live, t < T_seq
    # the chunk's first row and the tokens' rows from it (`_load_rows`)
    c_row, o_r = row0 + i_n * BT, t - i_n * BT
    o_k = i_k * BK + tl.arange(0, BK)
    m_k = dim_mask(o_k, Dk, BK, EVEN_D)
    A, dqS, dkH = _dqk_products(
        do_ptr, v_ptr, h_ptr, dh_ptr, c_row, o_r, i_s, m_t, o_k, m_k, Dk, Dv,
        BT, BK, BV, DOT_PREC, ROUND, EVEN_D, not W_GIVEN)
    if not W_GIVEN:
        M, q_decay, k_decay = _decays(
            g_ptr, hi_ptr, lo_ptr, ka_ptr, kr_ptr, i_h, i_s, row0, i_n, t,
            T_live, tl.arange(0, BT), BT, DECAY)
        W = _weights(A, M, r_ptr, e_ptr, c_row, o_r, m_t, NORMALIZE)
    if NORMALIZE:
        r = tl.load(r_ptr + c_row + o_r, mask=m_t, other=0.0)
        e = tl.load(e_ptr + c_row + o_r, mask=m_t, other=0.0)
        z = tl.load(hz_ptr + i_s * Dk + o_k, mask=m_k, other=0.0)
        dz = tl.load(dhz_ptr + i_s * Dk + o_k, mask=m_k, other=0.0)
        dq_state = r[:, None] * dqS + e[:, None] * z[None, :]
        dk_state = dkH + dz[:, None]
    else:
        dq_state = dqS
        dk_state = dkH
    # dk = W^T q as q^T W (BK x BT), q loaded and dk stored transposed: tl.dot
    # of tl.trans(W), W a dot result, is miscompiled on Hopper by Triton 3.4 <=
    # v < 3.7.1 (fla #640; tests/test_kernels_dot_transpose.py).
    base, rows = c_row * Dk, o_r * Dk
    m_kt = m_k[:, None] & m_t[None, :]
    qT = tl.load(q_ptr + base + (rows[None, :] + o_k[:, None]), mask=m_kt,
                 other=0.0)
    dkT = _w_product(qT, W, k_decay[None, :] * dk_state, False, ROUND, DOT_PREC)
    tl.store(dk_ptr + base + (rows[None, :] + o_k[:, None]),
             dkT.to(dk_ptr.dtype.element_ty),
             mask=m_k[:, None] & m_out[None, :])
    if DG:
        kT = tl.load(k_ptr + base + (rows[None, :] + o_k[:, None]),
                     mask=m_kt, other=0.0).to(tl.float32)
        # padded keys: 0 (kT), selected out
        kdk = tl.where(m_t, tl.sum(kT * dkT, axis=0), 0.0)
    k = _load_rows(k_ptr, c_row, o_r, m_t, o_k, m_k, Dk)
    dq = _w_product(k, W, q_decay[:, None] * dq_state, True, ROUND, DOT_PREC)
    if HAS_LEN and KEPT:
        # past the live length dO is 0, but entry states kept from the forward
        # may hold what the tail held (NaN padding): its gradients are 0
        dq = tl.where(m_t[:, None], dq, 0.0)
    tl.store(dq_ptr + base + (rows[:, None] + o_k[None, :]),
             dq.to(dq_ptr.dtype.element_ty),
             mask=m_out[:, None] & m_k[None, :])
    if DG:
        q = _load_rows(q_ptr, c_row, o_r, m_t, o_k, m_k, Dk).to(tl.float32)
        qdq = tl.where(m_t, tl.sum(q * dq, axis=1), 0.0)
        tl.store(dg_ptr + i_k * n_rows + c_row + o_r, qdq - kdk, mask=m_out)


@triton.jit
def _dv(
    q_ptr, k_ptr, do_ptr, g_ptr, hi_ptr, lo_ptr, ka_ptr, kr_ptr, r_ptr,
    dh_ptr, dv_ptr, row0, i_h, i_s, i_n, t, T_live, T_seq, i_v, Dk, Dv,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DECAY: tl.constexpr,
    NORMALIZE: tl.constexpr, DOT_PREC: tl.constexpr, ROUND: tl.constexpr,
    EVEN_D: tl.constexpr,
):
    """dv of value tile i_v of a chunk (`_chunk_program`'s)."""
    m_t, m_out = t < T_live, t < T_seq
    o_t = tl.arange(0, BT)
    c_row, o_r = row0 + i_n * BT, t - i_n * BT  # as in _dq_dk
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = dim_mask(o_v, Dv, BV, EVEN_D)
    # P^T (row j, column i: k_j . q_i), computed as K Q^T from the loaded
    # tiles: dv = P^T dO then takes no transpose of a dot result (fla #640,
    # see chunk_dqk_kernel)
    Pt = tl.zeros([BT, BT], dtype=tl.float32)
    kH = tl.zeros([BT, BV], dtype=tl.float32)     # k_j dH_n
    for i_k in range(0, tl.cdiv(Dk, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = dim_mask(o_k, Dk, BK, EVEN_D)
        q = _load_rows(q_ptr, c_row, o_r, m_t, o_k, m_k, Dk)
        k = _load_rows(k_ptr, c_row, o_r, m_t, o_k, m_k, Dk)
        dH = tl.load(dh_ptr + i_s * Dk * Dv + o_k[:, None] * Dv + o_v[None, :],
                     mask=m_k[:, None] & m_v[None, :], other=0.0)
        Pt = tl.dot(k, tl.trans(q), acc=Pt, input_precision=DOT_PREC)
        if ROUND:
            kH = tl.dot(k, dH.to(k.dtype), acc=kH)
        else:
            kH = tl.dot(k.to(tl.float32), dH.to(tl.float32), acc=kH,
                        input_precision=DOT_PREC)
    Mt, _, k_decay = _decays(
        g_ptr, hi_ptr, lo_ptr, ka_ptr, kr_ptr, i_h, i_s, row0, i_n, t, T_live,
        o_t, BT, DECAY, True)
    Pt = Mt * Pt
    if NORMALIZE:
        Pt = Pt * tl.load(r_ptr + c_row + o_r, mask=m_t, other=0.0)[None, :]
    if ROUND:
        do = _load_rows(do_ptr, c_row, o_r, m_t, o_v, m_v, Dv)
        dv = tl.dot(Pt.to(do.dtype), do, acc=k_decay[:, None] * kH)
    else:
        do = _load_rows(do_ptr, c_row, o_r, m_t, o_v, m_v, Dv).to(tl.float32)
        dv = tl.dot(Pt, do, acc=k_decay[:, None] * kH,
                    input_precision=DOT_PREC)
    tl.store(dv_ptr + c_row * Dv + (o_r[:, None] * Dv + o_v[None, :]),
             dv.to(dv_ptr.dtype.element_ty),
             mask=m_out[:, None] & m_v[None, :])


@triton.jit
def chunk_dqk_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr,  # (B, H, T, Dk) x 2, (B, H, T, Dv) x 2;
                                  # contiguous, one dtype
    g_ptr,                        # log-decay per head (H,) fp32 (DECAY == 1)
    hi_ptr, lo_ptr, ka_ptr, kr_ptr,  # DECAY == 2: chunk_decays' tables
    r_ptr, e_ptr,                 # (B, H, T) fp32 from chunk_bwd_prep_kernel
                                  # (NORMALIZE)
    h_ptr, hz_ptr,                # forward entry states (B, H, NT, Dk, Dv),
                                  # (B, H, NT, Dk) fp32
    dh_ptr, dhz_ptr,              # state gradients leaving each chunk,
                                  # same shapes
    dq_ptr, dk_ptr,               # out, the input dtype
    dg_ptr,                       # out (NK, B, H, T) fp32: q . dq - k . dk
                                  # over this Dk block (DG)
    cu_ptr, co_ptr, ci_ptr, len_ptr,
    T, H, Dk, Dv, NT, n_rows,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DECAY: tl.constexpr, DG: tl.constexpr, NORMALIZE: tl.constexpr,
    HAS_LEN: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
    KEPT: tl.constexpr = False,   # h, hz kept from the forward (not recomputed)
    ROUND: tl.constexpr = False,  # operands rounded to the input dtype
                                  # (rounds_operands)
    EVEN_D: tl.constexpr = False,  # Dk, Dv multiples of BK, BV (dim_mask)
):
    row0, i_h, i_s, i_n, t, T_live, T_seq, skip = _chunk_program(
        cu_ptr, co_ptr, ci_ptr, len_ptr, T, H, NT, BT, HAS_LEN, IS_VARLEN)
    if skip:
        return
    _dq_dk(q_ptr, k_ptr, v_ptr, do_ptr, g_ptr, hi_ptr, lo_ptr, ka_ptr, kr_ptr,
           r_ptr, e_ptr, h_ptr, hz_ptr, dh_ptr, dhz_ptr, dq_ptr, dk_ptr, dg_ptr,
           row0, i_h, i_s, i_n, t, T_live, T_seq, tl.program_id(0), Dk, Dv,
           n_rows, None, None, None, BT, BK, BV, DECAY, DG, NORMALIZE, HAS_LEN,
           DOT_PREC, KEPT, ROUND, False, EVEN_D)


@triton.jit
def chunk_dv_kernel(
    q_ptr, k_ptr, do_ptr,         # (B, H, T, Dk) x 2, (B, H, T, Dv);
                                  # contiguous, one dtype
    g_ptr,                        # log-decay per head (H,) fp32 (DECAY == 1)
    hi_ptr, lo_ptr, ka_ptr, kr_ptr,  # DECAY == 2: chunk_decays' tables
    r_ptr,                        # 1 / den (B, H, T) fp32 (NORMALIZE)
    dh_ptr,                       # state gradients leaving each chunk
                                  # (B, H, NT, Dk, Dv) fp32 or bf16
    dv_ptr,                       # out, the input dtype
    cu_ptr, co_ptr, ci_ptr, len_ptr,
    T, H, Dk, Dv, NT,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DECAY: tl.constexpr,
    NORMALIZE: tl.constexpr, HAS_LEN: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
    ROUND: tl.constexpr = False,  # as chunk_dqk_kernel's
    EVEN_D: tl.constexpr = False,  # as chunk_dqk_kernel's
):
    row0, i_h, i_s, i_n, t, T_live, T_seq, skip = _chunk_program(
        cu_ptr, co_ptr, ci_ptr, len_ptr, T, H, NT, BT, HAS_LEN, IS_VARLEN)
    if skip:
        return
    _dv(q_ptr, k_ptr, do_ptr, g_ptr, hi_ptr, lo_ptr, ka_ptr, kr_ptr, r_ptr,
        dh_ptr, dv_ptr, row0, i_h, i_s, i_n, t, T_live, T_seq,
        tl.program_id(0), Dk, Dv, BT, BK, BV, DECAY, NORMALIZE, DOT_PREC, ROUND,
        EVEN_D)


@triton.jit
def chunk_dqkv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, g_ptr, hi_ptr, lo_ptr, ka_ptr, kr_ptr,
    r_ptr, e_ptr, h_ptr, hz_ptr, dh_ptr, dhz_ptr,
    dq_ptr, dk_ptr, dv_ptr, dg_ptr,  # as chunk_dqk_kernel's and chunk_dv's
    cu_ptr, co_ptr, ci_ptr, len_ptr,
    T, H, Dk, Dv, NT, n_rows, zero,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,  # chunk_dqk's
    BKV: tl.constexpr, BVO: tl.constexpr,  # chunk_dv's BK, BV
    NVO: tl.constexpr,  # value tiles: cdiv(Dv, BVO)
    DECAY: tl.constexpr, DG: tl.constexpr, NORMALIZE: tl.constexpr,
    HAS_LEN: tl.constexpr, IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
    KEPT: tl.constexpr = False, ROUND: tl.constexpr = False,
    EVEN_D: tl.constexpr = False,  # Dk, Dv multiples of all four widths
):
    """A chunk's dq, dk and dv in one program (grid (1, chunks, B H)): the
    gradient weights W (dO v^T over all of Dv, the decays) formed once, then
    chunk_dqk_kernel's work for every Dk block, then chunk_dv_kernel's for
    every value tile. Apart, W is formed once per Dk block, and dv's kernel
    reads q, k, dO and dH_n again from HBM (0.9-1.1 GB more at B = 2,
    T = 16384, H = 16, d = 128, by the model's count); here they come from L2.
    The GPU check's candidate (`fused_dqkv`).

    `zero` is 0. The compiler hoists whatever does not change between the
    trips of the Dk-block loop out of it (the 64 x 64 pointer, mask and decay
    broadcasts of every block), and reuses the address tables of W's decays
    for dv's: all live at once, they took 175-235 registers (sm_90, bf16,
    d = 128), 19-174 spill instructions under the cap of 128. Offset by
    i_k * zero (the block's tokens and first row) or zero (dv's chunk), which
    it cannot fold, they are formed where they are used: 108-128 registers,
    no spills in bf16 (Triton 3.6.0 and 3.7.1; fp16, whose products are tf32,
    spills up to 12 with a per-head decay). The value tiles are unrolled (NVO)
    for the same reason."""
    row0, i_h, i_s, i_n, t, T_live, T_seq, skip = _chunk_program(
        cu_ptr, co_ptr, ci_ptr, len_ptr, T, H, NT, BT, HAS_LEN, IS_VARLEN)
    if skip:
        return
    m_t = t < T_live
    o_t = tl.arange(0, BT)
    c_row = row0 + i_n * BT
    A, _, _ = _dqk_products(
        do_ptr, v_ptr, h_ptr, dh_ptr, c_row, o_t, i_s, m_t, o_t, m_t, Dk, Dv,
        BT, BK, BV, DOT_PREC, ROUND, EVEN_D, True, False)
    M, q_decay, k_decay = _decays(
        g_ptr, hi_ptr, lo_ptr, ka_ptr, kr_ptr, i_h, i_s, row0, i_n, t, T_live,
        o_t, BT, DECAY)
    W = _weights(A, M, r_ptr, e_ptr, c_row, o_t, m_t, NORMALIZE)
    if ROUND:
        W = W.to(q_ptr.dtype.element_ty)
    for i_k in range(0, tl.cdiv(Dk, BK)):
        kz = i_k * zero
        _dq_dk(q_ptr, k_ptr, v_ptr, do_ptr, g_ptr, hi_ptr, lo_ptr, ka_ptr,
               kr_ptr, r_ptr, e_ptr, h_ptr, hz_ptr, dh_ptr, dhz_ptr, dq_ptr,
               dk_ptr, dg_ptr, row0 + kz, i_h, i_s, i_n, t + kz, T_live,
               T_seq, i_k, Dk, Dv, n_rows, W, q_decay + kz, k_decay + kz, BT,
               BK, BV, DECAY, DG, NORMALIZE, HAS_LEN, DOT_PREC, KEPT, ROUND,
               True, EVEN_D)
    for i_v in tl.static_range(NVO):
        _dv(q_ptr, k_ptr, do_ptr, g_ptr, hi_ptr, lo_ptr, ka_ptr, kr_ptr, r_ptr,
            dh_ptr, dv_ptr, row0, i_h, i_s + zero, i_n, t, T_live, T_seq, i_v,
            Dk, Dv, BT, BKV, BVO, DECAY, NORMALIZE, DOT_PREC, ROUND, EVEN_D)


def _decay_tables(g: torch.Tensor | None, decays: ChunkDecays | None,
                  BT: int, layout: tuple, lengths: torch.Tensor | None
                  ) -> list[torch.Tensor | None]:
    """(g, hi, lo, ka, kr) as the parallel backward kernels take them: g for a
    decay per head, the tables of `chunk_decays` for a decay per token (made
    here when not given), None where unused."""
    if g is None or g.dim() == 1:
        return [g, None, None, None, None]
    if decays is None or decays.hi is None or decays.kr is None:
        B, H, T = g.shape
        decays = chunk_decays(g, B, H, T, BT, layout=layout, lengths=lengths,
                              to_start=True, prefix=True)
    return [None, decays.hi, decays.lo, decays.ka, decays.kr]


def chunk_dqk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              do: torch.Tensor, g: torch.Tensor | None,
              r: torch.Tensor | None, e: torch.Tensor | None,
              states: tuple, grads: tuple, layout: tuple,
              lengths: torch.Tensor | None, cfg: dict, need_dg: bool = True,
              kept: bool = False, decays: ChunkDecays | None = None,
              dv_config: dict | None = None) -> tuple:
    """Launch `chunk_dqk_kernel`: (dq, dk, dg), dq and dk in the input dtype, dg
    the per-token q . dq - k . dk, one partial per block of Dk ((NK, B, H, T)
    fp32, for `decay_grad`; None without a decay or unless need_dg).

    g: fp32 log-decay or None; r, e: from `chunk_bwd_prep` (None unnormalised);
    states (h, hz) and grads (dh, dhz): the forward's entry states and the state
    gradients (chunk_states, forward and reversed, with cfg's BT);
    layout: (cu, chunk_offsets, chunk_indices, NT) as `sequences.packed_layout`
    gives them; lengths: (B, H) int32 or None; kept: the states are the
    forward's, not recomputed with `lengths`; decays: `chunk_decays` of a
    per-token g with these chunks and lengths, its ka, kr and prefix sums
    (None: launched here). dv_config: chunk_dv's config (`fused_dqkv`): dv
    too, in the same launch (`chunk_dqkv_kernel`), returned fourth."""
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    cu, offsets, indices, NT = layout
    states, grads = (checked_states("chunk_dqk", x, (B, H, NT, Dk, Dv),
                                    r is not None) for x in (states, grads))
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    NK = cdiv(Dk, cfg["BK"])
    dg = (torch.empty(NK, B, H, T, dtype=torch.float32, device=q.device)
          if g is not None and need_dg else None)
    outs = [dq, dk, dg]
    kernel, grid, extra = chunk_dqk_kernel, (NK, NT, B * H), {}
    widths = [(Dk, cfg["BK"]), (Dv, cfg["BV"])]
    if dv_config is not None:
        outs.insert(2, torch.empty(do.shape, dtype=q.dtype, device=q.device))
        kernel, grid = chunk_dqkv_kernel, (1, NT, B * H)
        extra = dict(BKV=dv_config["BK"], BVO=dv_config["BV"], zero=0,
                     NVO=cdiv(Dv, dv_config["BV"]))
        widths += [(Dk, dv_config["BK"]), (Dv, dv_config["BV"])]
    ptrs = [*_decay_tables(g, decays, cfg["BT"], layout, lengths), r, e,
            *states, *grads, *outs, cu, offsets, indices, lengths]
    launchable(kernel, q.device)[checked_grid("chunk_dqk", *grid)](
        q, k, v, do, *(p if p is not None else dq for p in ptrs),
        T, H, Dk, Dv, NT, B * H * T,
        BT=cfg["BT"], BK=cfg["BK"], BV=cfg["BV"], **extra,
        DECAY=0 if g is None else (1 if g.dim() == 1 else 2),
        DG=dg is not None, NORMALIZE=r is not None,
        HAS_LEN=lengths is not None, IS_VARLEN=cu is not None,
        DOT_PREC=dot_precision(q.dtype), KEPT=kept,
        ROUND=rounds_operands(cfg, q.dtype),
        # the 4-warp (A100) configs keep their masks: without, sm_80 compiles
        # chunk_dqk to 158 registers, not 128 (3 CTAs per SM, not 4)
        EVEN_D=cfg["num_warps"] == 8 and even_dims(*widths),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        maxnreg=max_registers(cfg, Dk, Dv))
    return (dq, dk, dg) if dv_config is None else (dq, dk, dg, outs[2])


def fused_dqkv(cfg_dqk: dict, cfg_dv: dict) -> bool:
    """Whether the backward runs chunk_dqk's and chunk_dv's programs in one
    kernel (`chunk_dqkv_kernel`): where chunk_dqk's config says so
    ("fused_dqkv", the GPU check's candidate) and both configs share their
    chunk length, warps and rounding (the fused launch takes chunk_dqk's)."""
    same = ("BT", "num_warps", "round_operands")
    return bool(cfg_dqk.get("fused_dqkv")) and all(
        cfg_dqk.get(key) == cfg_dv.get(key) for key in same)


def chunk_dv(q: torch.Tensor, k: torch.Tensor, do: torch.Tensor,
             g: torch.Tensor | None, r: torch.Tensor | None,
             dh: torch.Tensor, layout: tuple, lengths: torch.Tensor | None,
             cfg: dict, decays: ChunkDecays | None = None) -> torch.Tensor:
    """Launch `chunk_dv_kernel`: dv in the input dtype (arguments as for
    `chunk_dqk`)."""
    B, H, T, Dk = q.shape
    Dv = do.shape[-1]
    cu, offsets, indices, NT = layout
    dh = checked_states("chunk_dv", (dh, None), (B, H, NT, Dk, Dv), False)[0]
    dv = torch.empty(do.shape, dtype=q.dtype, device=q.device)
    ptrs = [*_decay_tables(g, decays, cfg["BT"], layout, lengths), r, dh, dv,
            cu, offsets, indices, lengths]
    launchable(chunk_dv_kernel, q.device)[
            checked_grid("chunk_dv", cdiv(Dv, cfg["BV"]), NT, B * H)](
        q, k, do, *(p if p is not None else dv for p in ptrs), T, H, Dk, Dv, NT,
        BT=cfg["BT"], BK=cfg["BK"], BV=cfg["BV"],
        DECAY=0 if g is None else (1 if g.dim() == 1 else 2),
        NORMALIZE=r is not None,
        HAS_LEN=lengths is not None, IS_VARLEN=cu is not None,
        DOT_PREC=dot_precision(q.dtype), ROUND=rounds_operands(cfg, q.dtype),
        EVEN_D=even_dims((Dk, cfg["BK"]), (Dv, cfg["BV"])),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        maxnreg=max_registers(cfg, Dk, Dv))
    return dv


def chunk_bwd_two_phase(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    *,
    o: torch.Tensor | None = None,
    den: torch.Tensor | None = None,
    log_decay: torch.Tensor | None = None,
    initial_state: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    final_state_grad: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    skip_dead_tail: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    need_initial_state_grad: bool = False,
    need_log_decay_grad: bool = True,
    log_decay_end: torch.Tensor | None = None,
    state_dtype: torch.dtype | None = None,
    entry_states: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> dict:
    """The causal backward in two phases. Returns {"dq", "dk", "dv", "dG",
    "dS0", "dz0"}.

    q, k, v, do: as the forward's inputs and its output cotangent (one dtype); o
    and den (the forward's output and d + eps) when the forward was normalised;
    log_decay None, (H,) or (B, H, T); initial_state (S0, z0 or None) as given
    to the forward; final_state_grad (dS_T, dz_T or None) fp32. dq, dk, dv come
    in the input dtype. dG (fp32, (B, H, T), None without a decay or unless
    need_log_decay_grad) is the gradient of the log-decay of each token, the sum
    of q_s . dq_s - k_s . dk_s over the tokens s from it to its sequence's end,
    plus log_decay_end ((sequences, H) fp32: <dS_T, S_T> + <dz_T, z_T>, the
    final state's term, or None); a decay per head is the sum over its tokens,
    taken by the caller. dS0 / dz0 (fp32, None unless asked) are the gradients
    of the initial state. state_dtype: the dtype the per-chunk entry states, and
    the state gradients unless dG is asked for, are stored in between the
    kernels (accumulated in fp32 either way); None: bf16 for bf16 inputs, fp32
    otherwise (as `chunk_fwd_two_phase`). skip_dead_tail: the tokens after the
    last nonzero cotangent of each (batch, head) are read as 0 and their
    gradients are exactly 0 -- right only without a final-state gradient, which
    every token reaches (whatever those tokens hold, padding, NaN or inf, then
    never meets a zero in a matmul). cu_seqlens: packed sequences (sequences.py;
    no dead tail). entry_states: (h, hz or None) as the forward computed them
    (`chunk_fwd_two_phase(..., return_entry_states=True)`, same inputs): then
    they are not recomputed, one pass over k and v fewer (a dead tail's tokens
    still get gradients of exactly 0: dq's rows past it are selected out).
    """
    check_backward("chunk_bwd_two_phase", q, k, v, do, o, den, log_decay,
                   initial_state, final_state_grad, log_decay_end, cu_seqlens)
    if skip_dead_tail and cu_seqlens is not None:  # its lengths are per row
        raise ValueError("chunk_bwd_two_phase: skip_dead_tail takes batched "
                         "rows, not packed sequences (cu_seqlens)")
    B, H, T, Dk = q.shape
    cfg_s = state_config(
        Dk, v.shape[-1],
        H * (B if cu_seqlens is None else cu_seqlens.numel() - 1),
        q.dtype, q.device, den is not None)
    cfg_dqk = launch_config("chunk_dqk", Dk, q.dtype, q.device)
    cfg_dv = launch_config("chunk_dv", Dk, q.dtype, q.device)
    if not cfg_s["BT"] == cfg_dqk["BT"] == cfg_dv["BT"]:  # (configs overridden)
        raise ValueError("chunk_bwd_two_phase: the state, dq/dk and dv "
                         "configs must share one chunk length BT")
    q, k, v, do = (x.contiguous() for x in (q, k, v, do))
    r, e, lengths = chunk_bwd_prep(do, o, den, find_lengths=skip_dead_tail)
    normalize = den is not None
    kw = dict(log_decay=log_decay, track_z=normalize, config=cfg_s,
              lengths=lengths, cu_seqlens=cu_seqlens)
    # The forward's entry states again, stored as the forward stored them
    # (bf16 for bf16 inputs): dq's inter-chunk term then sees the very state
    # the output was computed from. The state gradients are stored so too
    # unless the log-decay's gradient is asked for: dk and dv take less error
    # from their rounding than from their own (tests/test_kernels_two_phase.py),
    # but the suffix sums of q . dq - k . dk would take twice the error that
    # the rounded entry states give them.
    if state_dtype is None:
        state_dtype = (torch.bfloat16 if q.dtype == torch.bfloat16
                       else torch.float32)
    need_dg = log_decay is not None and need_log_decay_grad
    # once for every launch (no host sync)
    kw["layout"] = packed_layout(cu_seqlens, T, B, H, cfg_s["BT"])
    layout = kw["layout"][:4]
    g = as_f32(log_decay)
    if g is not None:  # both walks' decays in one launch
        kw["decays"] = chunk_decays(g, B, H, T, cfg_s["BT"], layout=layout,
                                    lengths=lengths, to_start=True,
                                    prefix=True)
    if entry_states is None:
        h, hz, _, _ = chunk_states(
            k, v, initial_state=initial_state, state_dtype=state_dtype, **kw)
    else:
        h, hz = checked_states("chunk_bwd_two_phase", entry_states,
                               (B, H, layout[3], Dk, v.shape[-1]), normalize)
    dh, dhz, dS0, dz0 = chunk_states(
        q, do, initial_state=final_state_grad, reverse=True, key_scale=r,
        z_weights=e, store_final_state=need_initial_state_grad,
        state_dtype=torch.float32 if need_dg else state_dtype, **kw)
    fused = fused_dqkv(cfg_dqk, cfg_dv)
    dq, dk, dg, *dv = chunk_dqk(
        q, k, v, do, g, r, e, (h, hz), (dh, dhz), layout, lengths, cfg_dqk,
        need_dg, kept=entry_states is not None, decays=kw.get("decays"),
        dv_config=cfg_dv if fused else None)
    dv = dv[0] if fused else chunk_dv(q, k, do, g, r, dh, layout, lengths,
                                      cfg_dv, decays=kw.get("decays"))
    dG = decay_grad(dg, log_decay_end, cu_seqlens) if dg is not None else None
    return {"dq": dq, "dk": dk, "dv": dv, "dG": dG, "dS0": dS0, "dz0": dz0}

