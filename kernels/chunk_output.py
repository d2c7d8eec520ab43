"""Two-phase causal forward, phase 2: every chunk's outputs, all chunks in
parallel.

The autograd wrappers (`_CausalEager` in linattn_lib/core/triton_ops.py, and
the custom op of custom_ops.py under torch.compile) call `causal_forward`,
which calls `chunk_fwd_two_phase` below (phase 1, `chunk_states`, is in
chunk_state.py); the tests are
tests/test_kernels_two_phase.py and, through the forward,
tests/test_kernels_interpret.py.

With the entry state (S_n, z_n) of chunk n stored by phase 1, the chunks no
longer depend on one another: one program per (value tile, chunk, batch * head)
computes

    o_i = sum_{j <= i in chunk} exp(L_ij) (q_i . k_j) v_j + exp(gc_i) q_i S_n
    d_i = sum_{j <= i in chunk} exp(L_ij) (q_i . k_j)     + exp(gc_i) q_i . z_n

and stores o_i / (d_i + eps) and den_i = d_i + eps (fp32), exactly what
`chunk_fwd_kernel` stores: the backward pass reads den.
L_ij = g_{j+1} + ... + g_i and gc_i = g_start + ... + g_i come from
`chunk_log_decays` (chunk_fwd.py), each as precise as a sum of its own terms
(a compensated difference of prefix sums; a product for a decay per head),
all <= 0. The decay of the state's term is applied to the row after the
product (exp(gc_i) (q_i S_n) rather than (exp(gc_i) q_i) S_n: a row scale
commutes with the product).

Dk is walked in blocks of BK (the loop the software pipeliner overlaps): each
block adds its q k^T to the scores (input dtype on the tensor cores, fp32
accumulator) and its q S_n to the output, q in fp32 against the fp32 state (tf32
for 16-bit inputs, as chunk_fwd does: the state may be larger than fp16 can
hold). The scores stay fp32 into their product with the values (tf32): raw
scores above 65504 would be inf as fp16 even when the normalised output is not.

Masks select, they do not multiply (as in chunk_fwd.py): the scores are cut to
the causal triangle with tl.where, and a token whose values hold an inf or NaN
has them replaced by 0 in the product while NaN goes into its scores, so that
exactly the outputs that see it (in this program's BV value columns) are NaN.
A NaN in q reaches its own row only; one in k the rows from its token on, and
later chunks through the state.
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
from .shapes import check_causal, checked_grid, entry_states


@triton.jit
def _scores_and_state(
    q_ptr, k_ptr, h_ptr, hz_ptr, i_s, m_t, o_v, m_v, Dk, Dv,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NORMALIZE: tl.constexpr, DOT_PREC: tl.constexpr, EVEN_D: tl.constexpr,
):
    """Over the blocks of Dk: the raw scores q k^T (BT x BT), q S_n (BT x BV)
    and q . z_n (BT,); q_ptr and k_ptr point at the chunk's first row, i_s is
    the index of chunk n's entry state."""
    A = tl.zeros([BT, BT], dtype=tl.float32)
    o = tl.zeros([BT, BV], dtype=tl.float32)
    d = tl.zeros([BT], dtype=tl.float32)
    h_base = h_ptr + i_s * Dk * Dv
    o_t = tl.arange(0, BT)
    for i_k in range(0, tl.cdiv(Dk, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = dim_mask(o_k, Dk, BK, EVEN_D)
        m_tk = m_t[:, None] & m_k[None, :]
        qk_off = o_t[:, None] * Dk + o_k[None, :]
        q = tl.load(q_ptr + qk_off, mask=m_tk, other=0.0)
        k = tl.load(k_ptr + qk_off, mask=m_tk, other=0.0)
        S = tl.load(h_base + o_k[:, None] * Dv + o_v[None, :],
                    mask=m_k[:, None] & m_v[None, :], other=0.0)
        A = tl.dot(q, tl.trans(k), acc=A, input_precision=DOT_PREC)
        q32 = q.to(tl.float32)
        if h_ptr.dtype.element_ty == tl.float32:
            o = tl.dot(q32, S, acc=o, input_precision=DOT_PREC)
        else:
            # states stored in the input dtype (bf16):
            # the product on the tensor cores
            o = tl.dot(q, S.to(q.dtype), acc=o, input_precision=DOT_PREC)
        if NORMALIZE:
            z = tl.load(hz_ptr + i_s * Dk + o_k, mask=m_k, other=0.0)
            d += tl.sum(q32 * z[None, :], axis=1)
    return A, o, d


@triton.jit
def _poison_bad_values(A, v, visible):
    """A cut to the visible triangle, with NaN in the visible scores of every
    token whose values (v, fp32, this program's columns) hold an inf or NaN, and
    those tokens' values replaced by 0: every row that sees a bad value is NaN,
    no row that does not see it is. A token's flag is the sum of its values
    times 0 (0, or NaN: inf * 0 is NaN), added to its column of scores: in float
    arithmetic, where integer flags, a maximum and selects took 152 SASS
    instructions of the kernel's 1029 (sm_90, bf16), this took 77. The flag
    also selects the tokens' rows of v (a row that sees one of them is NaN
    whatever it holds): testing every value for inf took 104 more of 1032."""
    # (BT,): 0, or NaN for a bad token
    bad = tl.sum(v * 0.0, axis=1)
    return (tl.where(visible, A + bad[None, :], 0.0),
            tl.where(bad[:, None] == 0.0, v, 0.0))


@triton.jit
def chunk_output_kernel(
    q_ptr, k_ptr, v_ptr,      # (B, H, T, Dk), (B, H, T, Dk), (B, H, T, Dv);
                              # contiguous
    g_ptr,                    # log-decay per head (H,) fp32 (DECAY == 1)
    hi_ptr, lo_ptr,           # DECAY == 2: its compensated prefix sums per
                              # chunk (chunk_decays)
    h_ptr, hz_ptr,            # entry states (B, H, NT, Dk, Dv), (B, H, NT, Dk)
                              # fp32 (chunk_state_kernel)
    o_ptr,                    # (B, H, T, Dv) output, in the dtype of v
    den_ptr,                  # (B, H, T) fp32 d + eps (NORMALIZE)
    cu_ptr, co_ptr, ci_ptr,   # packed sequences (IS_VARLEN, sequences.py)
    T, H, Dk, Dv, NT, eps,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DECAY: tl.constexpr, NORMALIZE: tl.constexpr,
    IS_VARLEN: tl.constexpr, DOT_PREC: tl.constexpr,
    ROUND: tl.constexpr = False,  # scores rounded to v's dtype
                                  # (rounds_operands)
    EVEN_D: tl.constexpr = False,  # Dk, Dv multiples of BK, BV (dim_mask)
):
    i_v = tl.program_id(0)
    i_seq, i_h, i_n = chunk_of_program(
        tl.program_id(1), tl.program_id(2).to(tl.int64), ci_ptr, H, IS_VARLEN)
    row0, T_seq = sequence_rows(i_seq, i_h, cu_ptr, T, H, IS_VARLEN)
    if IS_VARLEN:
        # a slot past the last chunk (sequences.py)
        if is_padding_chunk(i_n, T_seq, BT):
            return
    i_s = first_chunk(i_seq, i_h, co_ptr, NT, H, IS_VARLEN) + i_n
    o_t = tl.arange(0, BT)
    t = i_n * BT + o_t
    m_t = t < T_seq
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = dim_mask(o_v, Dv, BV, EVEN_D)
    # the chunk's first row, 64-bit, once: the tiles' offsets from it are
    # 32-bit (int64 offsets of every element cost ~6% of the instructions)
    c_row = row0 + i_n * BT
    A, o, d = _scores_and_state(
        q_ptr + c_row * Dk, k_ptr + c_row * Dk, h_ptr, hz_ptr, i_s, m_t,
        o_v, m_v, Dk, Dv, BT, BK, BV, NORMALIZE, DOT_PREC, EVEN_D)
    tv_off = o_t[:, None] * Dv + o_v[None, :]
    m_tv = m_t[:, None] & m_v[None, :]
    v = tl.load(v_ptr + c_row * Dv + tv_off, mask=m_tv, other=0.0)
    if DECAY == 1:
        L, q_log, _, _ = chunk_decays_at(
            g_ptr, i_h, row0, i_n, t, T_seq, BT, False, DECAY)
    elif DECAY == 2:  # as chunk_log_decays forms them from the same prefix sums
        hi = tl.load(hi_ptr + i_s * BT + o_t)
        lo = tl.load(lo_ptr + i_s * BT + o_t)
        # (above the diagonal L > 0: cut to 0 here, the scores there are
        # selected out below; a minimum costs half a compare and a select)
        L = tl.minimum(
            _gap(hi[:, None], lo[:, None], hi[None, :], lo[None, :]), 0.0)
        q_log = hi
    if DECAY > 0:
        # L <= 0 (0 outside the causal triangle)
        A = A * tl.exp(L)
        q_decay = tl.exp(q_log)
        o = o * q_decay[:, None]
        d = d * q_decay
    visible = o_t[:, None] >= o_t[None, :]
    A, v = _poison_bad_values(A, v.to(tl.float32), visible)
    if ROUND:  # v's entries are still of its dtype: rounding them is exact
        in_dtype = v_ptr.dtype.element_ty
        o = tl.dot(A.to(in_dtype), v.to(in_dtype), acc=o)
    else:
        o = tl.dot(A, v, acc=o, input_precision=DOT_PREC)
    if NORMALIZE:
        # padded keys were read as 0: their scores are 0
        d = tl.sum(A, axis=1) + d + eps
        o = o / d[:, None]
        tl.store(den_ptr + c_row + o_t, d, mask=m_t & (i_v == 0))
    tl.store(o_ptr + c_row * Dv + tv_off, o.to(o_ptr.dtype.element_ty),
             mask=m_tv)


def chunk_output(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    h: torch.Tensor,
    hz: torch.Tensor | None,
    *,
    log_decay: torch.Tensor | None = None,
    normalize: bool = True,
    eps: float = 1e-6,
    config: dict | None = None,
    cu_seqlens: torch.Tensor | None = None,
    decays: ChunkDecays | None = None,
    layout: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch `chunk_output_kernel`. Returns (o, den): o in the dtype of v,
    den = d + eps (fp32, (B, H, T)) when normalize, else None.

    h, hz: the entry states from `chunk_states` (hz needed when normalize),
    computed with the chunk length of `config` (h's shape is checked against
    it: NT = h.shape[2] must be ceil(T / BT)). cu_seqlens: packed sequences
    (sequences.py), h from `chunk_states` with the same cu_seqlens
    (NT = ceil(T / BT) + N - 1, the bound on the chunk count). decays:
    `chunk_decays` of a per-token log_decay with these chunks, its prefix sums
    included, if already computed; layout: `sequences.packed_layout` of these
    chunks, if already computed (by a caller that has checked the shapes).
    """
    if layout is None:
        check_causal("chunk_output", q, k, v, log_decay=log_decay,
                     cu_seqlens=cu_seqlens)
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    cfg = config or launch_config("chunk_output", Dk, q.dtype, q.device)
    cu, offsets, indices, NT, _ = (
        layout or packed_layout(cu_seqlens, T, B, H, cfg["BT"]))
    h, hz = entry_states("chunk_output", (h, hz), (B, H, NT, Dk, Dv), normalize)
    o = torch.empty(B, H, T, Dv, dtype=v.dtype, device=q.device)
    den = (torch.empty(B, H, T, dtype=torch.float32, device=q.device)
           if normalize else None)
    g = as_f32(log_decay)
    if B * H * NT == 0:
        return o, den
    prefix = (None, None)
    if g is not None and g.dim() > 1:
        if decays is None:
            decays = chunk_decays(g, B, H, T, cfg["BT"],
                                  layout=(cu, offsets, indices, NT),
                                  to_end=False, prefix=True)
        prefix, g = (decays.hi, decays.lo), None
    dummy = o
    grid = checked_grid("chunk_output", cdiv(Dv, cfg["BV"]), NT, B * H)
    ptrs = [g, *prefix, h, hz, o, den, cu, offsets, indices]
    launchable(chunk_output_kernel, q.device)[grid](
        q, k, v, *(p if p is not None else dummy for p in ptrs),
        T, H, Dk, Dv, NT, float(eps),
        BT=cfg["BT"], BK=cfg["BK"], BV=cfg["BV"],
        DECAY=0 if log_decay is None else (1 if log_decay.dim() == 1 else 2),
        NORMALIZE=normalize, IS_VARLEN=cu is not None,
        DOT_PREC=dot_precision(q.dtype), ROUND=rounds_operands(cfg, q.dtype),
        EVEN_D=even_dims((Dk, cfg["BK"]), (Dv, cfg["BV"])),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        maxnreg=max_registers(cfg, Dk, Dv),
    )
    return o, den


def chunk_fwd_two_phase(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    log_decay: torch.Tensor | None = None,
    normalize: bool = True,
    eps: float = 1e-6,
    initial_state: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    store_final_state: bool = False,
    configs: tuple[dict, dict] | None = None,
    cu_seqlens: torch.Tensor | None = None,
    state_dtype: torch.dtype | None = None,
    return_entry_states: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """The causal forward in two phases. Returns (o, den, S_final, z_final), as
    `chunk_fwd`; with return_entry_states also (h, hz), every chunk's entry
    state as `chunk_states` returns it, for `chunk_bwd_two_phase(...,
    entry_states=(h, hz))` to use instead of recomputing them.

    Same contract as `chunk_fwd(q, k, v, log_decay=..., normalize=..., eps=...,
    initial_state=..., store_final_state=...)`: q, k (B, H, T, Dk), v
    (B, H, T, Dv), one dtype; log_decay None, (H,) or (B, H, T); initial_state
    (S0, z0 or None). o has the dtype of v; den = d + eps (fp32) when normalize,
    else None; S_final, z_final fp32 when store_final_state (z_final only when
    normalize), else None. configs: (chunk_state's, chunk_output's), default
    `state_config`'s and `select_config`'s; their chunk lengths BT must agree.
    cu_seqlens: packed sequences (sequences.py; B = 1, states one per sequence).
    state_dtype: the dtype the entry states are stored in between the phases;
    None: bf16 for bf16 inputs (as fla stores them: half the traffic of the
    largest tensor, and an inter-chunk term rounded as the inputs are; the
    backward recomputes its states in fp32), fp32 otherwise (fp16 has too little
    range for a state summed over thousands of tokens).
    """
    n_seq = check_causal("chunk_fwd_two_phase", q, k, v, log_decay=log_decay,
                         initial_state=initial_state, cu_seqlens=cu_seqlens)
    B, H, _, Dk = q.shape
    if configs is None:
        rows = H * n_seq
        configs = (
            state_config(Dk, v.shape[-1], rows, q.dtype, q.device, normalize),
            launch_config("chunk_output", Dk, q.dtype, q.device))
    cfg_state, cfg_out = configs
    if cfg_state["BT"] != cfg_out["BT"]:
        raise ValueError(
            f"chunk_fwd_two_phase: the two phases need one chunk length, "
            f"got {cfg_state['BT']} and {cfg_out['BT']}")
    if state_dtype is None:
        state_dtype = (torch.bfloat16 if q.dtype == torch.bfloat16
                       else torch.float32)
    decays = None
    # once for the three launches
    layout = packed_layout(cu_seqlens, q.shape[2], B, H, cfg_out["BT"])
    # the state walk's decays and the outputs' prefix sums in one launch
    if log_decay is not None:
        decays = chunk_decays(as_f32(log_decay),
                              B, H, q.shape[2], cfg_out["BT"],
                              layout=layout, prefix=True)
    h, hz, S_T, z_T = chunk_states(
        k, v, log_decay=log_decay, track_z=normalize,
        initial_state=initial_state, store_final_state=store_final_state,
        config=cfg_state, cu_seqlens=cu_seqlens, state_dtype=state_dtype,
        decays=decays, layout=layout)
    o, den = chunk_output(
        q, k, v, h, hz, log_decay=log_decay, normalize=normalize, eps=eps,
        config=cfg_out, cu_seqlens=cu_seqlens, decays=decays, layout=layout)
    if return_entry_states:
        return o, den, S_T, z_T, h, hz
    return o, den, S_T, z_T


def compile_spec(cfg: dict, dtype: str) -> tuple[dict, dict]:
    """Signature and constexprs of `chunk_output_kernel`'s heaviest variant
    (per-token decay, normaliser)."""
    signature = {
        "q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}",
        "g_ptr": "*fp32", "hi_ptr": "*fp32", "lo_ptr": "*fp32",
        # bf16 inputs read bf16 states (chunk_fwd_two_phase's default),
        # the others fp32
        "h_ptr": "*bf16" if dtype == "bf16" else "*fp32", "hz_ptr": "*fp32",
        "o_ptr": f"*{dtype}", "den_ptr": "*fp32",
        "cu_ptr": "*i32", "co_ptr": "*i32", "ci_ptr": "*i32",
        "T": "i32", "H": "i32", "Dk": "i32", "Dv": "i32", "NT": "i32",
        "eps": "fp32",
    }
    constexprs = {"BT": cfg["BT"], "BK": cfg["BK"], "BV": cfg["BV"], "DECAY": 2,
                  "NORMALIZE": True, "IS_VARLEN": False,
                  "DOT_PREC": dot_precision(dtype),
                  "ROUND": rounds_operands(cfg, dtype), "EVEN_D": False}
    for name in constexprs:
        signature[name] = "constexpr"
    return signature, constexprs
