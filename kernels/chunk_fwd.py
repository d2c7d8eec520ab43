"""Causal chunked linear attention: the forward kernel (and, run backwards in time, dV).

The recurrence (see linattn_lib/core/state.py) with log-decay g_t <= 0 is

    S_t = exp(g_t) S_{t-1} + k_t v_t^T        o_t = q_t S_t            (numerator)
    z_t = exp(g_t) z_{t-1} + k_t              d_t = q_t . z_t          (denominator)

and the normalised output is o_t / (d_t + eps). A token loop is sequential; the chunked form
cuts T into chunks of BT tokens and, inside one chunk, replaces the loop by matmuls. With
gc_i = g_{start} + ... + g_i (the decay from the chunk start to token i, a cumulative sum
inside the chunk), L_ij = g_{j+1} + ... + g_i (from key j to query i) and
a_j = g_{j+1} + ... + g_last (from key j to the chunk end), and S the state on entry:

    o_i = sum_{j <= i in chunk} exp(L_ij) (q_i . k_j) v_j            <- intra-chunk, masked matmul
        + exp(gc_i) q_i S                                              <- inter-chunk, via the state
    S  <- exp(gc_last) S + sum_j exp(a_j) k_j v_j^T                  <- pass the state on

Every exponent is a sum of log-decays over a forward interval, hence <= 0: nothing overflows,
however strong the decay. (Writing exp(gc_i) * exp(-gc_j) instead would overflow.) And none is a
plain difference of fp32 prefix sums, gc_i - gc_j or gc_last - gc_j: after a reset
(g = -1e5) both are ~ -1e5 and their difference keeps ~1e-2 of absolute precision (outputs
were off by 0.16 where the torch forms gave 1.5e-6). `chunk_log_decays` takes the
differences of compensated prefix sums (TwoSum), accurate to the rounding of the result, and
for a decay per head the products n g_h (a sum over n tokens, one rounding).

Masks select, they do not multiply. A future key or value that is inf or NaN (garbage in
right-padding, a score that overflowed) meets the zeros of the causal mask: 0 * inf = NaN
would reach the outputs *before* it. So the score matrix is cut with tl.where, and a
non-finite value is replaced by 0 in the matmul while NaN goes into the scores of its token
(and into the state), so that the outputs that do see it are NaN -- in the program's whole tile
of BV value columns, where the recurrence would spoil only the value's own column. Outputs
before position t never depend on the inputs at t. (Finding the first bad row per column
instead cost the tensor-core configs 20-40 spill instructions.)

With HAS_LEN (reverse mode, below) the tokens from len[b, h] on are read as zeros and their
outputs are exactly 0: the tail of a sequence that no loss term depends on is left out.

One program owns one (batch, head) and one tile of BV value columns. It keeps its slice of
the state, S[:, tile] (Dk x BV, fp32), in registers and walks the chunks in order, so the
state never touches global memory: simple and exact. The price is that the chunks of one
head are processed one after another; kernels such as flash-linear-attention first write
every chunk's state to memory so that all chunks can then be processed in parallel, which
pays off when B * H is small. The intra-chunk work is repeated for every value tile.

Reverse mode. Run backwards in time (REVERSE=True), the same kernel computes

    out_j = sum_{i >= j} exp(G_i - G_j) (a_j . b_i) c_i + exp(G_end - G_j) a_j R

which is exactly dV of linear attention with (a, b, c) = (k, q, dO) and R the gradient of the
final state; its own final state is then the gradient of the initial state. So the backward
pass of linear attention is linear attention again, run from the end. (The library's backward
is now two-phase, chunk_grad.py; reverse mode, HAS_LEN and HAS_W stay here for the book and
the tests, which check them against float64.)

The normaliser is fused: z (Dk, fp32) travels with S, and d_i is computed from the same
masked score matrix as the numerator, so no second pass over the sequence is needed.
With HAS_W the keys' contribution to z is weighted per token (z = sum_j w_j k_j, decayed):
reverse mode uses this to accumulate the gradient of the initial z.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import dot_precision, launchable, select_config
from .shapes import check_causal, checked_grid


@triton.jit
def _shifted_gather(g, o_t, BT: tl.constexpr):
    """(g_1, ..., g_{BT-1}, 0): a shift in registers, no second load of g."""
    return tl.where(o_t < BT - 1, tl.gather(g, tl.minimum(o_t + 1, BT - 1), 0), 0.0)


@triton.jit
def _shifted_sum(g, o_t, BT: tl.constexpr):
    """The same shift where tl.gather does not exist (Triton < 3.2): a masked row sum."""
    return tl.sum(tl.where(o_t[None, :] == o_t[:, None] + 1, g[None, :], 0.0), axis=1)


# tl.gather compiles to fewer registers (sm_90 bf16: no stack, where the row sum spills 32 B)
_shifted = _shifted_gather if hasattr(tl, "gather") else _shifted_sum


@triton.jit
def _two_sum(a_hi, a_lo, b_hi, b_lo):
    """(a_hi + a_lo) + (b_hi + b_lo) as an unevaluated pair: hi the rounded sum of the two his,
    lo the other parts plus what that rounding dropped (Knuth's TwoSum: with a_lo = b_lo = 0
    exact in IEEE fp32)."""
    s = a_hi + b_hi
    b_virtual = s - a_hi
    dropped = (a_hi - (s - b_virtual)) + (b_hi - b_virtual)
    return s, a_lo + b_lo + dropped


@triton.jit
def _shifted_back_gather(x, o_t, BT: tl.constexpr):
    """(0, x_0, ..., x_{BT-2}): the previous entry of each, in registers."""
    return tl.where(o_t > 0, tl.gather(x, tl.maximum(o_t - 1, 0), 0), 0.0)


@triton.jit
def _shifted_back_sum(x, o_t, BT: tl.constexpr):
    """The same shift where tl.gather does not exist (Triton < 3.2): a masked row sum."""
    return tl.sum(tl.where(o_t[None, :] == o_t[:, None] - 1, x[None, :], 0.0), axis=1)


_shifted_back = _shifted_back_gather if hasattr(tl, "gather") else _shifted_back_sum


@triton.jit
def _compensated_cumsum(hi, g, o_t, BT: tl.constexpr):
    """(hi, lo) with hi + lo = g_start + ... + g_i to ~1e-13 relative, from hi = cumsum(g) in
    fp32: lo is the cumsum of what each step of hi rounded away, d_i = hi_{i-1} + g_i - hi_i,
    which TwoSum gives exactly (s - hi_i is exact: s and hi_i are two roundings of one sum, so
    within a factor of 2 of each other). Two plain scans, however the compiler orders them."""
    s, dropped = _two_sum(_shifted_back(hi, o_t, BT), 0.0, g, 0.0)
    return hi, tl.cumsum((s - hi) + dropped, axis=0)


@triton.jit
def _gap(hi_a, lo_a, hi_b, lo_b):
    """P_a - P_b for two compensated prefix sums, clamped to <= 0 (the exact value is)."""
    return tl.minimum((hi_a - hi_b) + (lo_a - lo_b), 0.0)


@triton.jit
def head_log_decays(g_h, n, o_t, REVERSE: tl.constexpr):
    """chunk_log_decays when every token decays by the same g_h (a scalar): a sum over m tokens
    is m g_h (one rounding, no scan). The first n tokens of the chunk are real, the rest
    padding (n a scalar, 0 <= n <= BT); with g_h = 0 every decay is 0, whatever n."""
    i = o_t.to(tl.float32)
    gc = tl.minimum(i + 1.0, n) * g_h                   # g_start + ... + g_i
    after = tl.maximum(n - 1.0 - i, 0.0) * g_h          # g_{j+1} + ... + g_last
    real = tl.minimum(i, n - 1.0)                       # padding adds nothing: a pair counts
    lag = real[:, None] - real[None, :]                 # only the real tokens between them
    if REVERSE:
        L = tl.where(o_t[None, :] > o_t[:, None], -lag * g_h, 0.0)  # (j - i) g_h for j > i
        return L, after, gc, n * g_h
    else:
        L = tl.where(o_t[None, :] < o_t[:, None], lag * g_h, 0.0)   # (i - j) g_h for i > j
        return L, gc, after, n * g_h


@triton.jit
def chunk_log_decays(g, o_t, BT: tl.constexpr, REVERSE: tl.constexpr, PER_HEAD: tl.constexpr = False,
                     ROW_SCANS: tl.constexpr = False):
    """The log-decays one chunk needs, each accurate to the rounding of its own value.

    g: (BT,) log-decays of the chunk's tokens (<= 0; 0 for padding), o_t = arange(BT);
    PER_HEAD: all of them are one value (a decay per head), whose sums are products;
    ROW_SCANS: L from a scan along each row of the chunk's pairs, each summed from its own
    terms (more instructions, fewer registers: the one-pass kernel, whose state takes many).
    Returns (L, q_log, k_log, g_last): L (BT x BT) holds, inside the visible triangle, the log
    of the decay between the two tokens of a pair (0 outside it); q_log the decay from the
    end of the chunk the state comes from to each query; k_log from each key to the end the
    state goes to; g_last the decay across the whole chunk.

    The 1-d decays are sums over their own tokens: gc_i = g_start + ... + g_i a scan from the
    chunk start, a_j = g_{j+1} + ... + g_last a reversed scan from the end, g_last the total.
    L_ij = P_i - P_j is a difference of the prefix sums P_i = g_start + ... + g_i, which in
    plain fp32 fails after a reset (g = -1e5): both are ~ -1e5 and their difference keeps
    ~1e-2 of absolute precision however close i and j are. So these prefix sums are
    compensated (`_compensated_cumsum`): lo keeps what each addition of hi rounded away,
    P_i = hi_i + lo_i to ~1e-13 relative, and (hi_i - hi_j) + (lo_i - lo_j) is then as
    accurate as a sum over exactly the tokens between i and j (what `segsum` in
    linattn_lib/core/masks.py computes), for two 1-d scans of BT terms and an elementwise
    difference -- where a sum of each pair's own terms is a scan along every row of a BT x BT
    matrix, about a third of the instructions of the parallel kernels with a decay. (The
    sequential state kernel uses only the 1-d decays: lo is not compiled there.) All are
    <= 0 (L is clamped: its exact value is), so exp never overflows.
    """
    if PER_HEAD:  # the real tokens are those with g < 0 (with g_h = 0 the count does not matter)
        n = tl.sum(tl.where(g < 0, 1.0, 0.0), axis=0)
        return head_log_decays(tl.min(g, axis=0), n, o_t, REVERSE)
    g_last = tl.sum(g, axis=0)
    gc = tl.cumsum(g, axis=0)                           # g_start + ... + g_i
    g_next = _shifted(g, o_t, BT)                       # g_next[j] = g_{j+1}, 0 at the end
    after = tl.cumsum(g_next, axis=0, reverse=True)     # g_{j+1} + ... + g_last
    if ROW_SCANS:
        if REVERSE:  # L[i, j] = g_{i+1} + ... + g_j for j > i: a running sum along the row
            L = tl.cumsum(tl.where(o_t[None, :] > o_t[:, None], g[None, :], 0.0), axis=1)
            return L, after, gc, g_last
        else:  # L[i, j] = g_{j+1} + ... + g_i for i > j: the row's running sum from the right
            L = tl.cumsum(tl.where(o_t[None, :] < o_t[:, None], g_next[None, :], 0.0), axis=1, reverse=True)
            return L, gc, after, g_last
    hi, lo = _compensated_cumsum(gc, g, o_t, BT)
    if REVERSE:
        # L[i, j] = g_{i+1} + ... + g_j = P_j - P_i for j > i
        L = tl.where(o_t[None, :] > o_t[:, None], _gap(hi[None, :], lo[None, :], hi[:, None], lo[:, None]), 0.0)
        q_log = after                                   # a query reads the state from the chunk end
        k_log = gc                                      # a key is carried to the chunk start
    else:
        # L[i, j] = g_{j+1} + ... + g_i = P_i - P_j for i > j
        L = tl.where(o_t[None, :] < o_t[:, None], _gap(hi[:, None], lo[:, None], hi[None, :], lo[None, :]), 0.0)
        q_log = gc
        k_log = after
    return L, q_log, k_log, g_last


@triton.jit
def chunk_fwd_kernel(
    q_ptr, k_ptr, v_ptr,      # (B, H, T, Dk), (B, H, T, Dk), (B, H, T, Dv); contiguous
    w_ptr,                    # (B, H, T) fp32 weights of the keys in z (HAS_W), else unused
    len_ptr,                  # (B, H) int32: tokens t >= len[b, h] are left out (HAS_LEN), else unused
    g_ptr,                    # log-decay: (H,) if DECAY == 1, (B, H, T) if DECAY == 2 (fp32)
    o_ptr,                    # (B, H, T, Dv) output, in the dtype of v
    den_ptr,                  # (B, H, T) fp32 denominators d_t + eps (stored when NORMALIZE)
    s0_ptr, z0_ptr,           # initial state (B, H, Dk, Dv), (B, H, Dk) fp32 (HAS_S0)
    st_ptr, zt_ptr,           # final state, same shapes (STORE_ST)
    T, H, Dk, Dv,             # sizes; Dk <= BK, any Dv
    eps,
    BT: tl.constexpr,         # chunk length
    BK: tl.constexpr,         # Dk rounded up to a power of two (>= 16 for tl.dot)
    BV: tl.constexpr,         # value columns per program
    DECAY: tl.constexpr,      # 0: no decay, 1: one log-decay per head, 2: one per token
    HAS_Z: tl.constexpr,      # carry the normaliser state z
    HAS_W: tl.constexpr,      # weight the keys in z by w (else weight 1)
    NORMALIZE: tl.constexpr,  # divide the output by d + eps and store d + eps
    HAS_S0: tl.constexpr,     # start from (s0, z0) instead of zeros
    STORE_ST: tl.constexpr,   # write the final state (st, zt)
    REVERSE: tl.constexpr,    # walk the chunks from the end (anti-causal: j >= i)
    HAS_LEN: tl.constexpr,    # read tokens t < len[b, h] only, write exactly 0 at the others
    DOT_PREC: tl.constexpr,   # "ieee" for fp32 inputs; "tf32" for the fp32 state products otherwise
):
    i_v = tl.program_id(0)                  # which tile of value columns
    i_bh = tl.program_id(1).to(tl.int64)    # which (batch, head); int64: offsets can pass 2^31

    o_t = tl.arange(0, BT)                  # token index inside a chunk
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k = o_k < Dk                          # padded head dims are masked, never read or written
    m_v = o_v < Dv
    m_kv = m_k[:, None] & m_v[None, :]

    q_base = q_ptr + i_bh * T * Dk
    k_base = k_ptr + i_bh * T * Dk
    v_base = v_ptr + i_bh * T * Dv
    o_base = o_ptr + i_bh * T * Dv
    s_off = i_bh * Dk * Dv + o_k[:, None] * Dv + o_v[None, :]

    # The state slice this program owns, in fp32 registers for the whole sequence.
    S = tl.zeros([BK, BV], dtype=tl.float32)
    z = tl.zeros([BK], dtype=tl.float32)
    if HAS_S0:
        S = tl.load(s0_ptr + s_off, mask=m_kv, other=0.0).to(tl.float32)
        if HAS_Z:
            z = tl.load(z0_ptr + i_bh * Dk + o_k, mask=m_k, other=0.0).to(tl.float32)

    # Causal: token i sees j <= i. Reverse: token i sees j >= i.
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
        m_t = t < T                         # the last chunk may be partial: mask its tail
        # With HAS_LEN the tokens from len[b, h] on are read as zeros and their outputs are 0:
        # reverse mode (a backward) leaves out the tail of a sequence that no loss term depends on, so
        # that garbage there (right-padding, NaN) cannot reach the gradients before it. (Loaded
        # here rather than once before the loop: one scalar, and fewer registers held.)
        if HAS_LEN:
            m_l = t < tl.load(len_ptr + i_bh)
        else:
            m_l = m_t
        q = tl.load(q_base + t[:, None] * Dk + o_k[None, :], mask=m_l[:, None] & m_k[None, :], other=0.0)
        k = tl.load(k_base + t[:, None] * Dk + o_k[None, :], mask=m_l[:, None] & m_k[None, :], other=0.0)
        v = tl.load(v_base + t[:, None] * Dv + o_v[None, :], mask=m_l[:, None] & m_v[None, :], other=0.0)

        # Intra-chunk scores (q k^T) * decay, a (BT x BT) matmul with an fp32 accumulator.
        A = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
        if DECAY > 0:
            # Log-decay of each token; padded tokens get g = 0 so that they do not decay anything.
            if DECAY == 1:
                g = tl.where(m_t, tl.load(g_ptr + i_bh % H).to(tl.float32), 0.0)
            else:
                g = tl.load(g_ptr + i_bh * T + t, mask=m_t, other=0.0).to(tl.float32)
            L, q_log, k_log, g_last = chunk_log_decays(g, o_t, BT, REVERSE, DECAY == 1, True)
            A = A * tl.exp(L)                   # L <= 0 everywhere (0 outside the visible triangle)
        # Select, do not multiply: an invisible pair is 0 even when its score is inf or NaN
        # (a garbage future key), where inf * 0 would be NaN in an earlier row.
        A = tl.where(visible, A, 0.0)

        # A value that is inf or NaN would meet the zeros of A in the matmul (0 * inf = NaN) and
        # reach rows that do not see it. It is replaced by 0, and NaN goes into the scores of
        # its token instead: every row that sees the token (and, through the state, every later
        # token) becomes NaN in this tile of value columns, as the recurrence would make it.
        v_ok = tl.abs(v) < float("inf")
        v = tl.where(v_ok, v, 0.0)
        v_bad = tl.max(tl.where(v_ok, 0, 1), axis=1) > 0      # (BT,): a token with a bad value
        A = tl.where(visible & v_bad[None, :], float("nan"), A)
        # Their product with v stays in fp32 (tf32 on tensor cores for 16-bit inputs): raw
        # scores above 65504 would be inf as fp16 even when the normalised output is ordinary.
        o = tl.dot(A, v.to(tl.float32), input_precision=DOT_PREC)
        # Inter-chunk: the state carries everything before the chunk. q * q_decay is fp32, so
        # this product runs in fp32 too: the state keeps its range even when it grows past what
        # fp16 can hold.
        q_s = q.to(tl.float32)
        if DECAY > 0:
            q_s = q_s * tl.exp(q_log)[:, None]
        o += tl.dot(q_s, S, input_precision=DOT_PREC)

        if HAS_W:
            w = tl.load(w_ptr + i_bh * T + t, mask=m_l, other=0.0).to(tl.float32)
        else:
            w = tl.where(m_l, 1.0, 0.0)
        if NORMALIZE:
            # d_i = sum_j A_ij w_j + q_decay_i (q_i . z): the same scores, one more "value"
            # column of ones. Every value tile computes it; tile 0 stores it.
            d = tl.sum(A * w[None, :], axis=1) + tl.sum(q_s * z[None, :], axis=1)
            d = d + eps
            o = o / d[:, None]
            tl.store(den_ptr + i_bh * T + t, d, mask=m_t & (i_v == 0))
        if HAS_LEN:
            o = tl.where(m_l[:, None], o, 0.0)  # tokens left out get exactly 0
        tl.store(o_base + t[:, None] * Dv + o_v[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])

        # Pass the state to the next chunk: decay it across the chunk, add this chunk's keys.
        k_s = k.to(tl.float32)
        if DECAY > 0:
            k_s = k_s * tl.exp(k_log)[:, None]
            S = S * tl.exp(g_last)
            if HAS_Z:
                z = z * tl.exp(g_last)
        # (a token with a bad value makes the state NaN: it is NaN again here, not 0)
        S += tl.dot(tl.trans(k_s), tl.where(v_bad[:, None], float("nan"), v.to(tl.float32)),
                    input_precision=DOT_PREC)
        if HAS_Z:
            z += tl.sum(k_s * w[:, None], axis=0)

    if STORE_ST:
        tl.store(st_ptr + s_off, S, mask=m_kv)
        if HAS_Z:
            tl.store(zt_ptr + i_bh * Dk + o_k, z, mask=m_k & (i_v == 0))


def chunk_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_decay: torch.Tensor | None = None,
    normalize: bool = True,
    eps: float = 1e-6,
    initial_state: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    store_final_state: bool = False,
    weights: torch.Tensor | None = None,
    track_z: bool | None = None,
    reverse: bool = False,
    lengths: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    config: dict | None = None,
):
    """Launch `chunk_fwd_kernel`. Returns (o, den, S_final, z_final).

    q, k: (B, H, T, Dk) and v: (B, H, T, Dv), one dtype (fp32, fp16 or bf16), any device the
    kernel can run on (CUDA, or CPU through the Triton interpreter). log_decay: None, (H,) or
    (B, H, T). initial_state: (S0 (B, H, Dk, Dv), z0 (B, H, Dk) or None). den is the fp32
    (B, H, T) tensor d + eps when normalize, else None; S_final/z_final are fp32 or None.
    track_z (default: normalize) carries z without normalising (for reverse mode).
    o has dtype `out_dtype` (default: the dtype of v). lengths: None or (B, H) integers: the
    tokens from lengths[b, h] on are read as zeros and get o = 0 (reverse mode uses it to leave
    out a tail that no loss term depends on).
    """
    check_causal("chunk_fwd", q, k, v, log_decay=log_decay, initial_state=initial_state,
                 per_token={"weights": weights}, lengths=lengths)
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    track_z = normalize if track_z is None else track_z
    cfg = config or select_config("chunk_fwd", Dk, q.dtype, q.device)
    f32 = dict(dtype=torch.float32, device=q.device)

    o = torch.empty(B, H, T, Dv, dtype=out_dtype or v.dtype, device=q.device)
    den = torch.empty(B, H, T, **f32) if normalize else None
    S_T = torch.empty(B, H, Dk, Dv, **f32) if store_final_state else None
    z_T = torch.empty(B, H, Dk, **f32) if (store_final_state and track_z) else None
    decay_kind = 0 if log_decay is None else (1 if log_decay.dim() == 1 else 2)
    g = log_decay.to(torch.float32).contiguous() if log_decay is not None else None
    S0 = z0 = None
    if initial_state is not None:
        S0 = initial_state[0].to(torch.float32).contiguous()
        if track_z:  # no z0 given: the keys before summed to 0
            z0 = (initial_state[1].to(torch.float32).contiguous()
                  if initial_state[1] is not None
                  else torch.zeros(B, H, Dk, **f32))
    w = weights.to(torch.float32).contiguous() if weights is not None else None
    lens = lengths.to(device=q.device, dtype=torch.int32).contiguous() if lengths is not None else None

    dummy = o  # stands in for pointers a constexpr flag says are never read
    grid = checked_grid("chunk_fwd", triton.cdiv(Dv, cfg["BV"]), B * H)
    launchable(chunk_fwd_kernel, q.device)[grid](
        q, k, v, w if w is not None else dummy, lens if lens is not None else dummy,
        g if g is not None else dummy, o, den if den is not None else dummy,
        S0 if S0 is not None else dummy, z0 if z0 is not None else dummy,
        S_T if S_T is not None else dummy, z_T if z_T is not None else dummy,
        T, H, Dk, Dv, float(eps),
        BT=cfg["BT"], BK=cfg["BK"], BV=cfg["BV"],
        DECAY=decay_kind, HAS_Z=track_z, HAS_W=w is not None, NORMALIZE=normalize,
        HAS_S0=S0 is not None, STORE_ST=store_final_state, REVERSE=reverse, HAS_LEN=lens is not None,
        DOT_PREC=dot_precision(q.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return o, den, S_T, z_T


def compile_spec(cfg: dict, dtype: str) -> tuple[dict, dict]:
    """Signature and constexprs for ahead-of-time compilation of the heaviest variant.

    Every feature of the forward pass switched on (normaliser, per-token decay, initial and
    final state): the variant with the most live values, hence the largest shared-memory and
    register needs. (REVERSE and HAS_LEN are reverse mode's dv, which has no normaliser.)
    """
    signature = {
        "q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}",
        "w_ptr": "*fp32", "len_ptr": "*i32", "g_ptr": "*fp32", "o_ptr": f"*{dtype}", "den_ptr": "*fp32",
        "s0_ptr": "*fp32", "z0_ptr": "*fp32", "st_ptr": "*fp32", "zt_ptr": "*fp32",
        "T": "i32", "H": "i32", "Dk": "i32", "Dv": "i32", "eps": "fp32",
    }
    constexprs = {
        "BT": cfg["BT"], "BK": cfg["BK"], "BV": cfg["BV"], "DECAY": 2, "HAS_Z": True,
        "HAS_W": True, "NORMALIZE": True, "HAS_S0": True, "STORE_ST": True, "REVERSE": False,
        "HAS_LEN": False, "DOT_PREC": dot_precision(dtype),
    }
    for name in constexprs:
        signature[name] = "constexpr"
    return signature, constexprs
