"""Causal chunked linear attention: the forward kernel (and, run backwards in time, dV).

The recurrence (see linattn_lib/attention.py) with log-decay g_t <= 0 is

    S_t = exp(g_t) S_{t-1} + k_t v_t^T        o_t = q_t S_t            (numerator)
    z_t = exp(g_t) z_{t-1} + k_t              d_t = q_t . z_t          (denominator)

and the normalised output is o_t / (d_t + eps). A token loop is sequential; the chunked form
cuts T into chunks of BT tokens and, inside one chunk, replaces the loop by matmuls. With
gc_i = g_{start} + ... + g_i (the decay from the chunk start to token i, a cumulative sum
inside the chunk) and S the state on entry to the chunk:

    o_i = sum_{j <= i in chunk} exp(gc_i - gc_j) (q_i . k_j) v_j     <- intra-chunk, masked matmul
        + exp(gc_i) q_i S                                              <- inter-chunk, via the state
    S  <- exp(gc_last) S + sum_j exp(gc_last - gc_j) k_j v_j^T       <- pass the state on

Every exponent is a sum of log-decays over a forward interval, hence <= 0: nothing overflows,
however strong the decay. (Writing exp(gc_i) * exp(-gc_j) instead would overflow.)

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
pass of linear attention is linear attention again, run from the end.

The normaliser is fused: z (Dk, fp32) travels with S, and d_i is computed from the same
masked score matrix as the numerator, so no second pass over the sequence is needed.
With HAS_W the keys' contribution to z is weighted per token (z = sum_j w_j k_j, decayed):
the backward pass uses this to accumulate the gradient of the initial z.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import dot_precision, launchable, select_config


@triton.jit
def chunk_fwd_kernel(
    q_ptr, k_ptr, v_ptr,      # (B, H, T, Dk), (B, H, T, Dk), (B, H, T, Dv); contiguous
    w_ptr,                    # (B, H, T) fp32 weights of the keys in z (HAS_W), else unused
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
        q = tl.load(q_base + t[:, None] * Dk + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        k = tl.load(k_base + t[:, None] * Dk + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        v = tl.load(v_base + t[:, None] * Dv + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)

        # Log-decay of each token; padded tokens get g = 0 so that they do not decay anything.
        if DECAY == 1:
            g = tl.where(m_t, tl.load(g_ptr + i_bh % H).to(tl.float32), 0.0)
        elif DECAY == 2:
            g = tl.load(g_ptr + i_bh * T + t, mask=m_t, other=0.0).to(tl.float32)
        else:
            g = tl.zeros([BT], dtype=tl.float32)
        gc = tl.cumsum(g, axis=0)                              # decay from the chunk start, <= 0
        g_last = tl.sum(tl.where(o_t == BT - 1, gc, 0.0), axis=0)  # decay across the whole chunk

        # Decay factors, all exp(<= 0). In forward mode a query at i sees the entry state
        # decayed by gc_i and a key at j reaches the chunk end decayed by g_last - gc_j;
        # reverse mode swaps the two ends of the chunk.
        if REVERSE:
            log_w = gc[None, :] - gc[:, None]   # log of the decay from i to j >= i
            q_decay = tl.exp(g_last - gc)
            k_decay = tl.exp(gc)
        else:
            log_w = gc[:, None] - gc[None, :]   # log of the decay from j to i >= j
            q_decay = tl.exp(gc)
            k_decay = tl.exp(g_last - gc)
        # exp(-inf) = 0 outside the visible triangle: masked before exponentiating, so an
        # invisible pair can never produce exp(+large) = inf and then inf * 0 = NaN.
        decay = tl.exp(tl.where(visible, log_w, float("-inf")))

        # Intra-chunk: scores (q k^T) * decay, a (BT x BT) masked matmul, fp32 accumulator.
        # Their product with v stays in fp32 (tf32 on tensor cores for 16-bit inputs): raw
        # scores above 65504 would be inf as fp16 even when the normalised output is ordinary.
        A = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * decay
        o = tl.dot(A, v.to(tl.float32), input_precision=DOT_PREC)
        # Inter-chunk: the state carries everything before the chunk. q * q_decay is fp32, so
        # this product runs in fp32 too: the state keeps its range even when it grows past what
        # fp16 can hold.
        q_s = q.to(tl.float32) * q_decay[:, None]
        o += tl.dot(q_s, S, input_precision=DOT_PREC)

        if HAS_W:
            w = tl.load(w_ptr + i_bh * T + t, mask=m_t, other=0.0).to(tl.float32)
        else:
            w = tl.where(m_t, 1.0, 0.0)
        if NORMALIZE:
            # d_i = sum_j A_ij w_j + q_decay_i (q_i . z): the same scores, one more "value"
            # column of ones. Every value tile computes it; tile 0 stores it.
            d = tl.sum(A * w[None, :], axis=1) + tl.sum(q_s * z[None, :], axis=1)
            d = d + eps
            o = o / d[:, None]
            tl.store(den_ptr + i_bh * T + t, d, mask=m_t & (i_v == 0))
        tl.store(o_base + t[:, None] * Dv + o_v[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])

        # Pass the state to the next chunk: decay it across the chunk, add this chunk's keys.
        k_s = k.to(tl.float32) * k_decay[:, None]
        S = S * tl.exp(g_last) + tl.dot(tl.trans(k_s), v.to(tl.float32), input_precision=DOT_PREC)
        if HAS_Z:
            z = z * tl.exp(g_last) + tl.sum(k_s * w[:, None], axis=0)

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
    out_dtype: torch.dtype | None = None,
    config: dict | None = None,
):
    """Launch `chunk_fwd_kernel`. Returns (o, den, S_final, z_final).

    q, k: (B, H, T, Dk) and v: (B, H, T, Dv), one dtype (fp32, fp16 or bf16), any device the
    kernel can run on (CUDA, or CPU through the Triton interpreter). log_decay: None, (H,) or
    (B, H, T). initial_state: (S0 (B, H, Dk, Dv), z0 (B, H, Dk) or None). den is the fp32
    (B, H, T) tensor d + eps when normalize, else None; S_final/z_final are fp32 or None.
    track_z (default: normalize) carries z without normalising (used by the backward pass).
    o has dtype `out_dtype` (default: the dtype of v).
    """
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
        if track_z:
            z0 = initial_state[1].to(torch.float32).contiguous()
    w = weights.to(torch.float32).contiguous() if weights is not None else None

    dummy = o  # stands in for pointers a constexpr flag says are never read
    grid = (triton.cdiv(Dv, cfg["BV"]), B * H)
    launchable(chunk_fwd_kernel, q.device)[grid](
        q, k, v, w if w is not None else dummy, g if g is not None else dummy,
        o, den if den is not None else dummy,
        S0 if S0 is not None else dummy, z0 if z0 is not None else dummy,
        S_T if S_T is not None else dummy, z_T if z_T is not None else dummy,
        T, H, Dk, Dv, float(eps),
        BT=cfg["BT"], BK=cfg["BK"], BV=cfg["BV"],
        DECAY=decay_kind, HAS_Z=track_z, HAS_W=w is not None, NORMALIZE=normalize,
        HAS_S0=S0 is not None, STORE_ST=store_final_state, REVERSE=reverse,
        DOT_PREC=dot_precision(q.dtype),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return o, den, S_T, z_T


def compile_spec(cfg: dict, dtype: str) -> tuple[dict, dict]:
    """Signature and constexprs for ahead-of-time compilation of the heaviest variant.

    Every feature switched on (normaliser, per-token decay, initial and final state): the
    variant with the most live values, hence the largest shared-memory and register needs.
    """
    signature = {
        "q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}",
        "w_ptr": "*fp32", "g_ptr": "*fp32", "o_ptr": f"*{dtype}", "den_ptr": "*fp32",
        "s0_ptr": "*fp32", "z0_ptr": "*fp32", "st_ptr": "*fp32", "zt_ptr": "*fp32",
        "T": "i32", "H": "i32", "Dk": "i32", "Dv": "i32", "eps": "fp32",
    }
    constexprs = {
        "BT": cfg["BT"], "BK": cfg["BK"], "BV": cfg["BV"], "DECAY": 2, "HAS_Z": True,
        "HAS_W": True, "NORMALIZE": True, "HAS_S0": True, "STORE_ST": True, "REVERSE": False,
        "DOT_PREC": dot_precision(dtype),
    }
    for name in constexprs:
        signature[name] = "constexpr"
    return signature, constexprs
