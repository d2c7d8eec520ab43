"""Two-phase causal forward, phase 1: the state on entry to every chunk.

Launched by `chunk_fwd_two_phase` (chunk_output.py; `chunk_output_kernel` next)
for the causal op of linattn_lib/core/triton_ops.py; tested against a float64
recurrence by tests/test_kernels_two_phase.py, the forward through it by
tests/test_kernels_interpret.py.

`chunk_fwd_kernel` (chunk_fwd.py) keeps the state in registers and walks the
chunks of a head one after another, doing all the work of a chunk
(scores, outputs, state) on the way: B * H programs per value tile, each as long
as the sequence. The two-phase forward of flash-linear-attention (`chunk_fwd_h`,
then `chunk_fwd_o`) splits that walk in two:

    phase 1 (here)   S_0 = S0 (or 0),   S_{n+1} = exp(g_last) S_n
                                                  + sum_j exp(a_j) k_j v_j^T
                     z_0 = z0 (or 0),   z_{n+1} = exp(g_last) z_n
                                                  + sum_j exp(a_j) k_j
                     storing every entry state S_n (Dk x Dv; `state_dtype`,
                     bf16 for bf16 inputs) and z_n (Dk, fp32)
    phase 2          every chunk on its own, in parallel (chunk_output.py)

with a_j = g_{j+1} + ... + g_last summed from its own terms and g_last the sum
over the chunk (`chunk_log_decays` of chunk_fwd.py: no difference of prefix
sums, every exponent <= 0). Phase 1 is still sequential over the chunks, but
light -- one (BK x BT) @ (BT x BV) product per chunk, no scores -- and its grid
also splits Dk: one program per (Dk tile, Dv tile, batch * head). The keys,
decayed in fp32 and rounded back to the input dtype, meet the values on the
tensor cores (input dtype in, fp32 accumulator: the state itself); z sums the
keys against their decays on the tensor cores too (in bf16 for bf16 inputs, tf32
for fp16; fp32 inputs sum in true fp32: `_walk_z`).

z. The normaliser state has programs of its own: the grid has one more column of
value tiles, and a program of that column walks z (the decayed keys summed per
chunk) while every other walks its state tile. When every program summed its
slice of z next to the product (and value tile 0 stored it), the row sums'
shuffles and adds were ~70 of the ~235 SASS instructions per chunk of the loop,
on the sequential chain; an extra column of ones in the value tile would make it
BV + 1 wide, the next power of two: twice the matmul. z's own walk sums on the
tensor cores too, against a narrow tile of weights (`_walk_z`).

Decays off the chain. What a chunk's decays are does not depend on the state:
the walk loads them from `chunk_decays` (chunk_decay.py), computed for every
chunk at once before it -- exp(a_j) of each key with its tiles, the decay across
the chunk exp(g_last) one chunk ahead (a scalar load that the software pipeliner
leaves alone would stall the chain for its latency). Taking the exp of g_last on
the chain cost 5 of the per-token walk's 112 SASS instructions per chunk
(sm_90, bf16), and forming the decayed bf16 keys through fp32 8 more
(`_decayed`).

The state gradient (reversed, keys scaled by r = 1 / den) multiplies in fp32
(tf32) for fp16 inputs, where dO / den may be below the smallest fp16; bf16 has
the range of fp32, so there the scaled keys are rounded to bf16 as the forward's
decayed keys are (the product on bf16 tensor cores: 163 instructions per chunk
where the tf32 product took 250, operands twice as wide in shared memory and
half as deep per MMA).

Non-finite input. Every token a chunk adds to the state comes before every token
that reads that state, so nothing needs masking here: a NaN or inf in k or v
makes the state (and thus every later output) non-finite, as the recurrence
would (0 * inf = NaN included). Padded tokens (t >= T) and padded head dims are
read as 0.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from . import configs
from .chunk_decay import ChunkDecays, _launch_config, chunk_decays
from .configs import dot_precision, launchable, multiprocessor_count
from .sequences import as_f32, cdiv, first_chunk, packed_layout, sequence_rows
from .shapes import check_causal, checked_grid


@triton.jit
def _keys_transposed(k_ptr, row0, t, m_t, o_k, m_k, Dk):
    """A chunk's key tile read as k^T (BK x BT), the product's operand: a load
    that feeds tl.dot directly is copied to shared memory asynchronously,
    num_stages - 1 chunks ahead. Loaded as (BT x BK) and transposed, it went
    through registers one chunk ahead (an LDG in the loop, sm_90): the H200
    timed such walks at 1.2-1.5 us a chunk at any tile or depth, fla's (both
    operands copied) at 0.73. Decayed walks read them so only as the GPU
    check's candidate (configs.walk_keys_t)."""
    return tl.load(k_ptr + (row0 + t)[None, :] * Dk + o_k[:, None],
                   mask=m_k[:, None] & m_t[None, :], other=0.0)


@triton.jit
def _chunk_inputs(
    k_ptr, v_ptr, ka_ptr, r_ptr, w_ptr, row0, t, m_t, c,
    o_k, m_k, o_v, m_v, Dk, Dv,
    BT: tl.constexpr, DECAY: tl.constexpr, HAS_R: tl.constexpr,
    HAS_W: tl.constexpr, LOAD_V: tl.constexpr, KEYS_T: tl.constexpr,
):
    """One chunk's key tile (KEYS_T: transposed, `_keys_transposed`), value
    tile (LOAD_V), key decays exp(a) (of chunk c, from chunk_decay_kernel), key
    scales and z weights."""
    if KEYS_T:
        k = _keys_transposed(k_ptr, row0, t, m_t, o_k, m_k, Dk)
    else:
        k = tl.load(k_ptr + (row0 + t)[:, None] * Dk + o_k[None, :],
                    mask=m_t[:, None] & m_k[None, :], other=0.0)
    v = k
    if LOAD_V:
        v = tl.load(v_ptr + (row0 + t)[:, None] * Dv + o_v[None, :],
                    mask=m_t[:, None] & m_v[None, :], other=0.0)
    ea = tl.zeros([BT], dtype=tl.float32)
    if DECAY > 0:
        ea = tl.load(ka_ptr + c * BT + tl.arange(0, BT))
    r = tl.zeros([BT], dtype=tl.float32)
    if HAS_R:
        r = tl.load(r_ptr + row0 + t, mask=m_t, other=0.0)
    w = tl.zeros([BT], dtype=tl.float32)
    if HAS_W:
        w = tl.load(w_ptr + row0 + t, mask=m_t, other=0.0)
    return k, v, ea, r, w


@triton.jit
def _chunk_decay(gl_ptr, c, i, n_chunks, step, DECAY: tl.constexpr):
    """The decay exp(g_last) of chunk c + step, the walk's chunk after c, when
    its step i + 1 of n_chunks exists (else 1; 1 without a decay). The walk
    loads it one step ahead: a scalar load the software pipeliner leaves alone
    would stall the chain for its latency every chunk."""
    if DECAY > 0:
        return tl.load(gl_ptr + c + step, mask=i + 1 < n_chunks, other=1.0)
    return 1.0


@triton.jit
def _decayed(k, ea):
    """k ea in k's dtype, for fp32 decays ea broadcast along the keys' tokens
    (ea[:, None]; ea[None, :] for keys read transposed). bf16 keys in bf16
    pairs (HMUL2, HFMA2; through fp32: 113 SASS a chunk, not 105): ea = hi + lo
    and k hi + (k lo) rounded once by a fused multiply-add
    (test_decayed_bf16_keys_are_rounded_once)."""
    if k.dtype != tl.bfloat16:
        # |exp(a_j) k_j| <= |k_j|: fits the input dtype
        return (k.to(tl.float32) * ea).to(k.dtype)
    hi = ea.to(tl.bfloat16)
    lo = (ea - hi.to(tl.float32)).to(tl.bfloat16)
    return tl.fma(k, hi, k * lo)


@triton.jit
def _first_step(n_lo, n_hi, REVERSE: tl.constexpr):
    """The chunk a walk over n_lo ... n_hi - 1 starts from, and its step."""
    if REVERSE:
        return n_hi - 1, -1
    else:
        return n_lo, 1


@triton.jit
def _walk_S(
    k_ptr, v_ptr, ka_ptr, gl_ptr, r_ptr, h_ptr, s0_ptr, st_ptr, lg_ptr, lr_ptr,
    i_nh, i_st, row0, T_seq, n_lo, n_hi, c0, first, lead,
    o_k, o_v, m_k, m_v, Dk, Dv,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DECAY: tl.constexpr,
    HAS_S0: tl.constexpr, STORE_ST: tl.constexpr, REVERSE: tl.constexpr,
    HAS_R: tl.constexpr, IS_SPLIT: tl.constexpr, DOT_PREC: tl.constexpr,
    KEYS_T: tl.constexpr,
):
    """The (BK x BV) state tile across chunks n_lo ... n_hi - 1:
    S <- exp(g_last) S + (exp(a) k)^T v, stored on entry to every chunk; it
    starts from S0 (HAS_S0, when `first`) or 0 and ends in row i_st of st.
    Reversed (the state gradient) the keys are scaled by r (1 / den) and the
    product is fp32 (tf32) for fp16 inputs: dO / den may be below the smallest
    fp16 (bf16, with fp32's range, rounds them to bf16).
    Split (IS_SPLIT, with a decay), the `lead` program of the run also stores
    the decay walked before each chunk (lg) and the run's total (row i_st of
    lr), for the merge.
    KEYS_T (no key scales): the keys read transposed (`_keys_transposed`),
    decayed, if at all, along their columns."""
    m_kv = m_k[:, None] & m_v[None, :]
    kv_off = o_k[:, None] * Dv + o_v[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_S0:
        S = tl.load(s0_ptr + i_nh * Dk * Dv + kv_off, mask=m_kv & first,
                    other=0.0).to(tl.float32)
    # decay since the start of the walk (split)
    walked = 1.0
    o_t = tl.arange(0, BT)
    n, step = _first_step(n_lo, n_hi, REVERSE)
    g_next = _chunk_decay(gl_ptr, c0 + n - step, -1, n_hi - n_lo, step, DECAY)
    for i in range(0, n_hi - n_lo):
        d_last = g_next
        g_next = _chunk_decay(gl_ptr, c0 + n, i, n_hi - n_lo, step, DECAY)
        tl.store(h_ptr + (c0 + n) * Dk * Dv + kv_off,
                 S.to(h_ptr.dtype.element_ty), mask=m_kv)
        t = n * BT + o_t
        k, v, ea, r, _ = _chunk_inputs(
            k_ptr, v_ptr, ka_ptr, r_ptr, r_ptr, row0, t, t < T_seq, c0 + n,
            o_k, m_k, o_v, m_v, Dk, Dv, BT, DECAY, HAS_R, False, True,
            KEYS_T)
        if DECAY > 0:
            S = S * d_last
        if IS_SPLIT and DECAY > 0:
            tl.store(lg_ptr + c0 + n, walked, mask=lead)
            walked *= d_last
        n += step
        if HAS_R:
            k_s = k.to(tl.float32) * (ea[:, None] if DECAY > 0 else 1.0)
            k_s = k_s * r[:, None]
            if k.dtype != tl.bfloat16:
                S = tl.dot(tl.trans(k_s), v.to(tl.float32), acc=S,
                           input_precision=DOT_PREC)
            else:
                S = tl.dot(tl.trans(k_s.to(k.dtype)), v, acc=S,
                           input_precision=DOT_PREC)
        elif DECAY > 0:
            kd = _decayed(k, ea[None, :] if KEYS_T else ea[:, None])
            S = tl.dot(kd if KEYS_T else tl.trans(kd), v, acc=S,
                       input_precision=DOT_PREC)
        else:  # plain keys, read transposed (KEYS_T)
            S = tl.dot(k, v, acc=S, input_precision=DOT_PREC)
    if STORE_ST:
        tl.store(st_ptr + i_st * Dk * Dv + kv_off, S, mask=m_kv)
    if IS_SPLIT and DECAY > 0:
        tl.store(lr_ptr + i_st, walked, mask=lead)


@triton.jit
def _walk_z(
    k_ptr, ka_ptr, gl_ptr, w_ptr, hz_ptr, z0_ptr, zt_ptr,
    i_nh, i_st, row0, T_seq, n_lo, n_hi, c0, first, o_k, m_k, Dk,
    BT: tl.constexpr, BK: tl.constexpr, DECAY: tl.constexpr,
    HAS_S0: tl.constexpr, STORE_ST: tl.constexpr, REVERSE: tl.constexpr,
    HAS_W: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """The (BK,) normaliser state across chunks n_lo ... n_hi - 1,
    z <- exp(g_last) z + sum_j exp(a_j) w_j k_j (w = 1 forward, dL/dden
    reversed), fp32, stored on entry to every chunk; started and ended as
    _walk_S's.

    For 16-bit inputs the sum over the chunk's keys is a product on the tensor
    cores, k^T (BK x BT) times a (BT x ZW) matrix whose every column holds the
    weights exp(a_j) w_j, into a (BK x ZW) fp32 accumulator of ZW equal columns,
    the first of which is stored. (The weights meet bf16 keys in bf16, as
    _walk_S's decayed keys are rounded, and fp16 keys in tf32: w may be below
    fp16's range.) Summed with tl.sum, the keys' rows, spread over the warps,
    took shuffles and two barriers per chunk on the walk's chain, and z's walk
    was the longer of the two: sm_90 bf16 SASS per chunk 156 (the state
    tile's 140) with a per-head decay, 125 (94) without; 104 and 49 as a
    product. fp32 inputs keep the sum (true fp32)."""
    # the narrowest product the tensor cores take
    ZW: tl.constexpr = 16
    col = tl.arange(0, ZW)
    z_off = o_k[:, None] + 0 * col[None, :]
    m_z = m_k[:, None] & (col[None, :] == 0)
    Z = tl.zeros([BK, ZW], dtype=tl.float32)
    if HAS_S0:
        z0 = tl.load(z0_ptr + i_nh * Dk + o_k, mask=m_k & first,
                     other=0.0).to(tl.float32)
        Z += z0[:, None]
    o_t = tl.arange(0, BT)
    n, step = _first_step(n_lo, n_hi, REVERSE)
    g_next = _chunk_decay(gl_ptr, c0 + n - step, -1, n_hi - n_lo, step, DECAY)
    for i in range(0, n_hi - n_lo):
        d_last = g_next
        g_next = _chunk_decay(gl_ptr, c0 + n, i, n_hi - n_lo, step, DECAY)
        tl.store(hz_ptr + (c0 + n) * Dk + z_off, Z, mask=m_z)
        t = n * BT + o_t
        k, _, ea, _, w = _chunk_inputs(
            k_ptr, k_ptr, ka_ptr, w_ptr, w_ptr, row0, t, t < T_seq, c0 + n,
            o_k, m_k, o_k, m_k, Dk, Dk, BT, DECAY, False, HAS_W, False,
            k_ptr.dtype.element_ty == tl.bfloat16)
        weight = tl.full([BT], 1.0, dtype=tl.float32)
        if DECAY > 0:
            weight = ea
            Z = Z * d_last
        if HAS_W:
            weight = weight * w
        E = weight[:, None] + tl.zeros([BT, ZW], dtype=tl.float32)
        if k.dtype == tl.bfloat16:
            # the weights rounded to bf16, as _walk_S rounds its decayed keys
            Z = tl.dot(k, E.to(tl.bfloat16), acc=Z)  # k transposed (KEYS_T)
        elif k.dtype == tl.float16:
            # e (HAS_W) may be below fp16's range: tf32
            Z = tl.dot(tl.trans(k.to(tl.float32)), E, acc=Z,
                       input_precision=DOT_PREC)
        else:
            # true fp32: on CUDA cores,
            # where the reduction costs less than a product would
            Z += tl.sum(k * weight[:, None], axis=0)[:, None]
        n += step
    if STORE_ST:
        tl.store(zt_ptr + i_st * Dk + z_off, Z, mask=m_z)


@triton.jit
def chunk_state_kernel(
    k_ptr, v_ptr,             # (B, H, T, Dk), (B, H, T, Dv) contiguous
    ka_ptr, gl_ptr,           # DECAY: every chunk's exp(a) of its keys and
                              # exp(g_last) (chunk_decay_kernel)
    r_ptr, w_ptr,             # (B, H, T) fp32 key scales (HAS_R) and
                              # z weights (HAS_W)
    h_ptr, hz_ptr,            # out: per-chunk states (B, H, NT, Dk, Dv)
                              # and (B, H, NT, Dk)
    s0_ptr, z0_ptr,           # initial state (B, H, Dk, Dv), (B, H, Dk)
                              # fp32 (HAS_S0)
    st_ptr, zt_ptr,           # final state, same shapes, fp32 (STORE_ST);
                              # split: each run's end
    lg_ptr, lr_ptr,           # split, with a decay: decay walked before
                              # each chunk, per run
    cu_ptr, co_ptr, len_ptr,  # packed sequences (IS_VARLEN, sequences.py);
                              # live lengths (HAS_LEN)
    T, H, Dk, Dv, NT,
    NS, n_splits,             # split-T (IS_SPLIT): chunks per run,
                              # runs per sequence
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DECAY: tl.constexpr,      # 0: none, 1: one log-decay per head,
                              # 2: one per token
    HAS_Z: tl.constexpr, HAS_S0: tl.constexpr, STORE_ST: tl.constexpr,
    REVERSE: tl.constexpr, HAS_R: tl.constexpr, HAS_W: tl.constexpr,
    HAS_LEN: tl.constexpr, IS_VARLEN: tl.constexpr,
    IS_SPLIT: tl.constexpr, DOT_PREC: tl.constexpr, KEYS_T: tl.constexpr,
    EVEN_D: tl.constexpr = False,  # Dk, Dv multiples of BK, BV (dim_mask)
):
    i_k = tl.program_id(0)
    i_v = tl.program_id(1)  # value tile; with HAS_Z the last one is z's
    # int64: the offsets into h pass 2^31 quickly
    i_st = tl.program_id(2).to(tl.int64)
    i_nh = i_st
    if IS_SPLIT:  # program (b H + h) n_splits + s walks split s of the sequence
        i_nh = i_st // n_splits
    i_seq, i_h = i_nh // H, i_nh % H
    row0, T_seq = sequence_rows(i_seq, i_h, cu_ptr, T, H, IS_VARLEN)
    c0 = first_chunk(i_seq, i_h, co_ptr, NT, H, IS_VARLEN)
    n_lo = 0
    n_hi = tl.cdiv(T_seq, BT)
    first = True  # the walk starts from the initial state
    if IS_SPLIT:
        i_s = (i_st % n_splits).to(tl.int32)
        n_lo = tl.minimum(i_s * NS, n_hi)
        n_hi = tl.minimum(n_lo + NS, n_hi)
        if REVERSE:
            first = i_s == n_splits - 1
        else:
            first = i_s == 0
    if HAS_LEN:  # tokens from len on are read as 0 (the backward's dead tail)
        T_seq = tl.minimum(T_seq, tl.load(len_ptr + i_nh))
    o_k = i_k * BK + tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = (o_k < Dk) | EVEN_D  # all true when EVEN_D (sequences.dim_mask)
    m_v = (o_v < Dv) | EVEN_D
    if HAS_Z and i_v == tl.cdiv(Dv, BV):
        _walk_z(k_ptr, ka_ptr, gl_ptr, w_ptr, hz_ptr, z0_ptr, zt_ptr,
                i_nh, i_st, row0, T_seq, n_lo, n_hi, c0, first, o_k, m_k, Dk,
                BT, BK, DECAY, HAS_S0, STORE_ST, REVERSE, HAS_W, DOT_PREC)
    else:
        _walk_S(k_ptr, v_ptr, ka_ptr, gl_ptr, r_ptr, h_ptr, s0_ptr, st_ptr,
                lg_ptr, lr_ptr, i_nh, i_st, row0, T_seq, n_lo, n_hi, c0, first,
                (i_k == 0) & (i_v == 0), o_k, o_v, m_k, m_v, Dk, Dv,
                BT, BK, BV, DECAY, HAS_S0, STORE_ST,
                REVERSE, HAS_R, IS_SPLIT, DOT_PREC, KEYS_T)


@triton.jit
def _merge_tile(
    h_ptr, e_ptr, lg_ptr, lr_ptr, st_ptr, i_nh, i_s, p, n_splits, NT, NS,
    Dk, Dv, o_k, o_v,
    DECAY: tl.constexpr, STORE_ST: tl.constexpr, REVERSE: tl.constexpr,
):
    """Run i_s (walked p-th) of one tile of a state (Dv = 1, one live column,
    for z)."""
    m = (o_k < Dk)[:, None] & (o_v < Dv)[None, :]
    off = o_k[:, None] * Dv + o_v[None, :]
    row = i_nh * n_splits
    E = tl.zeros([o_k.shape[0], o_v.shape[0]], dtype=tl.float32)
    # E_{j+1} = D_j E_j + L_j over the runs walked before
    for j in range(0, p):
        if REVERSE:
            q = n_splits - 1 - j
        else:
            q = j
        if DECAY > 0:
            E = E * tl.load(lr_ptr + row + q)
        E += tl.load(e_ptr + (row + q) * Dk * Dv + off, mask=m, other=0.0)
    lo = i_s * NS
    # the run walked first is right already
    hi = tl.where(p > 0, tl.minimum(lo + NS, NT), lo)
    # independent steps: nothing is carried
    for n in range(lo, hi):
        c = i_nh * NT + n
        a = 1.0
        if DECAY > 0:
            a = tl.load(lg_ptr + c)
        x = tl.load(h_ptr + c * Dk * Dv + off, mask=m, other=0.0).to(tl.float32)
        tl.store(h_ptr + c * Dk * Dv + off,
                 (x + a * E).to(h_ptr.dtype.element_ty), mask=m)
    # the last run walked ends in the final state
    if STORE_ST:
        if DECAY > 0:
            E = E * tl.load(lr_ptr + row + i_s)
        E += tl.load(e_ptr + (row + i_s) * Dk * Dv + off, mask=m, other=0.0)
        tl.store(st_ptr + i_nh * Dk * Dv + off, E, mask=m & (p == n_splits - 1))


@triton.jit
def chunk_state_merge_kernel(
    h_ptr, hz_ptr,            # in/out: per-chunk states (B, H, NT, Dk, Dv),
                              # (B, H, NT, Dk), run-local
    e_ptr, ez_ptr,            # each run's end state, (B H n_splits, Dk, Dv)
                              # and (.., Dk), fp32
    lg_ptr, lr_ptr,           # decay walked before each chunk (B H NT),
                              # per run (B H n_splits)
    st_ptr, zt_ptr,           # out: final state (B H, Dk, Dv), (B H, Dk),
                              # fp32 (STORE_ST)
    H, Dk, Dv, NT, NS, n_splits,
    BK: tl.constexpr, BV: tl.constexpr, DECAY: tl.constexpr,
    HAS_Z: tl.constexpr, STORE_ST: tl.constexpr, REVERSE: tl.constexpr,
):
    """Split-T's merge (chunk_states): program (Dk tile, Dv tile or z, (b H + h)
    n_splits + run) forms the state carried into its run from the runs walked
    before (at most n_splits - 1 steps of a tile) and adds it to the run's
    stored states."""
    i_k = tl.program_id(0)
    i_v = tl.program_id(1)
    i_r = tl.program_id(2).to(tl.int64)
    i_nh, i_s = i_r // n_splits, (i_r % n_splits).to(tl.int32)
    if REVERSE:
        p = n_splits - 1 - i_s
    else:
        p = i_s
    o_k = i_k * BK + tl.arange(0, BK)
    if HAS_Z and i_v == tl.cdiv(Dv, BV):    # z as a state of one column
        _merge_tile(hz_ptr, ez_ptr, lg_ptr, lr_ptr, zt_ptr, i_nh, i_s, p,
                    n_splits, NT, NS, Dk, 1, o_k, tl.arange(0, 1),
                    DECAY, STORE_ST, REVERSE)
    else:
        _merge_tile(h_ptr, e_ptr, lg_ptr, lr_ptr, st_ptr, i_nh, i_s, p,
                    n_splits, NT, NS, Dk, Dv, o_k, i_v * BV + tl.arange(0, BV),
                    DECAY, STORE_ST, REVERSE)


def chunk_states(
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_decay: torch.Tensor | None = None,
    track_z: bool = True,
    initial_state: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    store_final_state: bool = False,
    config: dict | None = None,
    reverse: bool = False,
    key_scale: torch.Tensor | None = None,
    z_weights: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    state_dtype: torch.dtype = torch.float32,
    splits: int | None = None,
    decays: ChunkDecays | None = None,
    layout: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
           torch.Tensor | None]:
    """Launch `chunk_state_kernel`. Returns (h, hz, S_final, z_final), fp32 but
    for h, which has `state_dtype` (the state itself is accumulated in fp32
    either way).

    k: (B, H, T, Dk), v: (B, H, T, Dv), one dtype. The chunk length is the
    config's BT; the output kernel that reads these states must use the same
    (`chunk_fwd_two_phase` checks). h: (B, H, NT, Dk, Dv) with
    NT = ceil(T / BT), h[:, :, n] the state before chunk n's tokens (h[:, :, 0]
    the initial state or 0); hz: (B, H, NT, Dk) likewise for z when track_z,
    else None. S_final, z_final: the state after the last token when
    store_final_state (z_final only with track_z), else None. log_decay: None,
    (H,) or (B, H, T); initial_state: (S0, z0 or None).

    reverse: walk from the last chunk to the first, h[:, :, n] then being the
    state *after* chunk n seen from the end -- with key_scale = 1 / den and
    z_weights = dL/dden (fp32, (B, H, T)) and (k, v) = (q, dO) this is the
    state gradient of the backward pass. lengths: (B, H) int32, tokens from
    lengths[b, h] on read as 0. cu_seqlens: packed sequences (sequences.py;
    B = 1): NT counts the chunks of all sequences, and the initial and final
    states have one row per sequence, (N, H, ...). splits: walk the chunks in
    this many runs in parallel and merge them (split-T, below; batched only);
    None: as many as `split_count` says the GPU needs, 1 off a GPU. decays:
    `chunk_decays` of log_decay with this pass's chunks and lengths (its kr
    reversed, else its ka), if already computed. layout: the config's BT's
    `sequences.packed_layout(cu_seqlens, T, B, H, BT)`, if already computed
    (packed: NT is then the bound on the chunk count, sequences.py), by a
    caller that has checked the shapes.
    """
    n_seq = layout[4] if layout else check_causal(
        "chunk_states", k, k, v, log_decay=log_decay,
        initial_state=initial_state, cu_seqlens=cu_seqlens, lengths=lengths,
        per_token={"key_scale": key_scale, "z_weights": z_weights})
    (B, H, T, Dk), Dv = k.shape, v.shape[-1]
    k, v = k.contiguous(), v.contiguous()
    cfg = config or state_config(Dk, Dv, H * n_seq, k.dtype, k.device, track_z)
    cu, offsets, indices, NT, n_seq = (
        layout or packed_layout(cu_seqlens, T, B, H, cfg["BT"]))
    f32 = dict(dtype=torch.float32, device=k.device)
    h = torch.empty(B, H, NT, Dk, Dv, dtype=state_dtype, device=k.device)
    hz = torch.empty(B, H, NT, Dk, **f32) if track_z else None
    S0 = z0 = None
    if initial_state is not None:
        S0 = as_f32(initial_state[0])
        if track_z:
            z0 = (as_f32(initial_state[1]) if initial_state[1] is not None
                  else torch.zeros(n_seq, H, Dk, **f32))
    # one more column of programs for z: a program walks a state tile or z
    tiles = (cdiv(Dk, cfg["BK"]), cdiv(Dv, cfg["BV"]) + int(track_z))
    NS, splits = _runs(splits, cu is not None,
                       tiles[0] * tiles[1] * n_seq * H, NT, k.device)
    split = splits > 1
    ends = store_final_state or split  # each run's end goes where S_T would
    S_T = torch.empty(n_seq * splits, H, Dk, Dv, **f32) if ends else None
    z_T = (torch.empty(n_seq * splits, H, Dk, **f32)
           if (ends and track_z) else None)
    if n_seq * H == 0:
        return h, hz, S_T, z_T
    g, r, w = as_f32(log_decay), as_f32(key_scale), as_f32(z_weights)
    walked = ((torch.empty(B * H * NT, **f32),
               torch.empty(B * H * splits, **f32))
              if split and g is not None else (None, None))
    decay = 0 if g is None else (1 if g.dim() == 1 else 2)
    decays = decays or (decay and chunk_decays(
        g, B, H, T, cfg["BT"], layout=(cu, offsets, indices, NT),
        lengths=lengths, to_end=not reverse, to_start=reverse))
    decays = (((decays.kr if reverse else decays.ka), decays.gl)
              if decay else (None, None))
    ptrs = [*decays, r, w, h, hz, S0, z0, S_T, z_T, *walked,
            cu, offsets, lengths]
    keys_t = configs.walk_keys_t(cfg, decay, r)
    launchable(chunk_state_kernel, k.device)[
        checked_grid("chunk_states", *tiles, n_seq * H * splits)](
        # h stands in for pointers never touched
        k, v, *(p if p is not None else h for p in ptrs),
        T, H, Dk, Dv, NT, NS, splits,
        BT=cfg["BT"], BK=cfg["BK"], BV=cfg["BV"], DECAY=decay, HAS_Z=track_z,
        HAS_S0=S0 is not None, STORE_ST=ends, REVERSE=reverse,
        HAS_R=r is not None, HAS_W=w is not None,
        HAS_LEN=lengths is not None, IS_VARLEN=cu is not None, IS_SPLIT=split,
        DOT_PREC=dot_precision(k.dtype), KEYS_T=keys_t,
        EVEN_D=Dk % cfg["BK"] == 0 and Dv % cfg["BV"] == 0,
        num_warps=cfg["num_warps"], num_stages=configs.walk_stages(
            cfg, configs.plain_walk(k.dtype, decay, r, w, track_z), keys_t),
    )
    if not split:
        return h, hz, S_T, z_T
    return (h, hz, *_merge_runs(h, hz, (S_T, z_T), walked, tiles, NS, splits,
                                cfg, decay, store_final_state, reverse))


def _runs(splits: int | None, packed: bool, programs: int, NT: int,
          device) -> tuple[int, int]:
    """(chunks per run, runs) of a state pass asked for `splits` runs
    (None: `split_count`)."""
    if splits is None:
        splits = (1 if packed else
                  split_count(programs, NT, multiprocessor_count(device)))
    if packed and splits != 1:
        raise ValueError("chunk_states: split-T needs sequences of one length "
                         "(no cu_seqlens)")
    NS = cdiv(NT, max(1, min(splits, NT)))
    return NS, (cdiv(NT, NS) if NT else 1)


def _merge_runs(h, hz, ends, walked, tiles, NS, splits, cfg, decay,
                store_final_state, reverse):
    """Launch `chunk_state_merge_kernel` on the runs' states (in place); the
    final states."""
    B, H, NT, Dk, Dv = h.shape
    f32 = dict(dtype=torch.float32, device=h.device)
    final = (torch.empty(B, H, Dk, Dv, **f32) if store_final_state else None,
             torch.empty(B, H, Dk, **f32)
             if store_final_state and hz is not None else None)
    ptrs = [hz, *ends, *walked, *final]
    launchable(chunk_state_merge_kernel, h.device)[
        checked_grid("chunk_states", *tiles, B * H * splits)](
        h, *(p if p is not None else h for p in ptrs),
        H, Dk, Dv, NT, NS, splits, BK=cfg["BK"], BV=cfg["BV"],
        DECAY=decay, HAS_Z=hz is not None,
        STORE_ST=store_final_state, REVERSE=reverse,
        num_warps=cfg["num_warps"], num_stages=1,
    )
    return final


# Split-T. The state pass is sequential over the chunks; with few programs
# (B * H small) most SMs idle while each program walks its long chain. Split
# the chunks into `splits` runs of NS: every run is walked in parallel from
# a zero state (the first from the initial state), which gives each chunk's
# entry state up to the part carried in from earlier runs, and each run's
# end state L_s. The carried part is linear: with E_s the true state on
# entry to run s and D_s = exp(sum of the run's log-decays),
#
#     E_0 = 0 (the initial state is in run 0's walk),  E_{s+1} = D_s E_s + L_s,
#     h_n += exp(sum of the log-decays of run s's chunks before n) E_s
#            for n in run s,
#
# and the final state is E_splits: `chunk_state_merge_kernel`, one program per
# run (and tile), forms E_s from the ends of the runs before (s steps of a tile)
# and adds it to the run's stored states, chunk after chunk (independent steps:
# the loads can be in flight together). That is about twice the stored states'
# bytes more traffic, paid only when the parallelism it buys is missing.
# Reversed (the state gradient) the runs are walked from the last. Every
# exponent is a sum of log-decays <= 0, summed by the state kernel as it walks.


def split_count(programs: int, n_chunks: int, sms: int | None,
                min_chunks: int = 16) -> int:
    """Runs to split the state pass into: 1 when its `programs` already occupy
    the GPU's `sms` (None: not a GPU, e.g. the interpreter), else enough for
    about two per SM (a state program has 4 warps: up to 4 per SM issue at their
    full rate), with runs of at least `min_chunks` chunks."""
    if sms is None or programs >= sms:
        return 1
    return max(1, min(-(-2 * sms // programs), n_chunks // min_chunks))


def state_config(Dk: int, Dv: int, rows: int, dtype: torch.dtype, device,
                 track_z: bool = True) -> dict:
    """The config of a state pass over `rows` (batch, head) rows, by how many
    programs it launches per SM of `device` (z's column of programs counted when
    `track_z`):

    1 to 2    8 warps a program: "chunk_state_few" (the narrow tiles), else
              "chunk_state_few_wide" (wider value tiles, fewer programs) if
              that brings the count into this range. Each scheduler would
              otherwise hold 2 warps, each waiting on its own chain; 8 share
              a tile's loads, decays and stores;
    below 1   the narrow config: split-T makes about 2 per SM of those
              (`split_count`, whose rounding up can leave 3 on some SMs);
    above 4   "chunk_state_wide" (4 warps, wider value tiles, same BT):
              beyond 4 4-warp programs per SM they take turns on the
              schedulers, so the SM issues all their instructions and the
              wider tiles' fewer win;
    else      the narrow config, "chunk_state".

    configs.py has the numbers. Off a GPU (no SM count): the narrow config.
    Looked up once per (shape, dtype, device model): the launch path pays a dict
    lookup."""
    cfg = _state_config(Dk, Dv, rows, dtype, configs.device_capability(device),
                        multiprocessor_count(device), track_z)
    if configs.OVERRIDES and "chunk_state" in configs.OVERRIDES:  # experiments
        return {**cfg, **configs.OVERRIDES["chunk_state"]}
    return cfg


@functools.lru_cache(maxsize=512)
def _state_config(Dk: int, Dv: int, rows: int, dtype: torch.dtype, cap,
                  sms: int | None, track_z: bool) -> dict:
    narrow = _launch_config("chunk_state", Dk, dtype, cap)
    if sms is None:
        return narrow
    count = lambda cfg: (cdiv(Dk, cfg["BK"])
                         * (cdiv(Dv, cfg["BV"]) + int(track_z)) * rows)
    for name in ("chunk_state_few", "chunk_state_few_wide"):
        cfg = _launch_config(name, Dk, dtype, cap)
        if count(narrow) >= sms and sms <= count(cfg) <= 2 * sms:
            return cfg
    if count(narrow) > 4 * sms:
        return _launch_config("chunk_state_wide", Dk, dtype, cap)
    return narrow


def compile_spec(cfg: dict, dtype: str) -> tuple[dict, dict]:
    """Signature and constexprs of `chunk_state_kernel`'s heaviest variant: the
    state gradient (reversed, scaled keys, weighted z) with per-token decay,
    initial and final state, split."""
    signature = {
        "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}",
        **dict.fromkeys(("ka_ptr", "gl_ptr", "r_ptr", "w_ptr", "h_ptr",
                         "hz_ptr", "s0_ptr", "z0_ptr", "st_ptr", "zt_ptr",
                         "lg_ptr", "lr_ptr"), "*fp32"),
        "cu_ptr": "*i32", "co_ptr": "*i32", "len_ptr": "*i32",
        "T": "i32", "H": "i32", "Dk": "i32", "Dv": "i32", "NT": "i32",
        "NS": "i32", "n_splits": "i32",
    }
    constexprs = {"BT": cfg["BT"], "BK": cfg["BK"], "BV": cfg["BV"], "DECAY": 2,
                  "HAS_Z": True, "HAS_S0": True, "STORE_ST": True,
                  "REVERSE": True, "HAS_R": True, "HAS_W": True,
                  "HAS_LEN": False, "IS_VARLEN": False, "IS_SPLIT": True,
                  "KEYS_T": False, "EVEN_D": False,
                  "DOT_PREC": dot_precision(dtype)}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return signature, constexprs


def compile_spec_merge(cfg: dict, dtype: str) -> tuple[dict, dict]:
    """Signature and constexprs of `chunk_state_merge_kernel`'s heaviest variant
    (decay, z, final state; the states stored as `chunk_fwd_two_phase` stores
    them for `dtype`)."""
    signature = {"h_ptr": "*bf16" if dtype == "bf16" else "*fp32",
                 "hz_ptr": "*fp32", "e_ptr": "*fp32", "ez_ptr": "*fp32",
                 "lg_ptr": "*fp32", "lr_ptr": "*fp32",
                 "st_ptr": "*fp32", "zt_ptr": "*fp32",
                 "H": "i32", "Dk": "i32", "Dv": "i32", "NT": "i32", "NS": "i32",
                 "n_splits": "i32"}
    constexprs = {"BK": cfg["BK"], "BV": cfg["BV"], "DECAY": 2, "HAS_Z": True,
                  "STORE_ST": True, "REVERSE": False}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return signature, constexprs
