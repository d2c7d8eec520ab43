"""The decays of every chunk, for the two-phase kernels, before they run.

What a chunk's decays are does not depend on any state, only on the log-decays
of its own tokens, so `chunk_decay_kernel` computes them for every chunk at
once, one program per chunk, and the kernels that would otherwise take them on
their chains load them instead:

    ka    exp(a_j), a_j = g_{j+1} + ... + g_last, of each key: carried to
          the chunk's end (the forward state walk, and the backward's
          recompute of it)
    kr    exp(c_j), c_j = g_start + ... + g_j, of each key: carried to the
          chunk's start (the state gradient's walk, reversed)
    gl    exp(g_last), the decay across the chunk (both walks)
    hi,   the compensated prefix sums P_j = hi_j + lo_j = g_start + ... + g_j
    lo    (fp32 pairs, `_compensated_cumsum` in chunk_fwd.py) from which the
          output kernel takes every decay it needs by differences (a decay
          per token)

each a sum of its own tokens' terms (the decay-reset case included: no
difference of two large prefix sums that are not compensated), every
exponent <= 0. Done in the state walk, the scans and exps of a per-token decay
were ~75 of its ~248 SASS instructions per chunk (sm_90, bf16: 173 without
them), and a per-head decay cost as much (its counts are reductions too); the
scans of the output kernel were 60 of its 1029. The pass costs a launch and a
few bytes per token: B H T (4 + 4 + 8) at most, ~4 MiB at the benchmark shape.
The backward asks for ka and kr in one launch (its two walks), the forward for
ka and the prefix sums.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import configs
from .chunk_fwd import _compensated_cumsum, chunk_log_decays, head_log_decays
from .configs import launchable, select_config
from .sequences import (
    chunk_of_program,
    first_chunk,
    is_padding_chunk,
    packed_layout,
    sequence_rows,
)
from .shapes import check_decay, checked_grid


@triton.jit
def load_log_decay(g_ptr, i_h, row0, t, m_t, DECAY: tl.constexpr):
    """The fp32 log-decays of tokens t (rows row0 + t) of head i_h; 0 for padded
    tokens (they decay nothing)."""
    if DECAY == 1:
        g = tl.where(m_t, tl.load(g_ptr + i_h).to(tl.float32), 0.0)
    else:
        g = tl.load(g_ptr + row0 + t, mask=m_t, other=0.0).to(tl.float32)
    return g


@triton.jit
def chunk_decays_at(g_ptr, i_h, row0, i_n, t, T_live, BT: tl.constexpr,
                    REVERSE: tl.constexpr, DECAY: tl.constexpr):
    """`chunk_log_decays` of chunk i_n (tokens t = i_n BT + arange(BT), rows
    row0 + t) of head i_h, the tokens from T_live on read as padding. A decay
    per head is one scalar load, its count of real tokens from T_live: no
    reduction over the chunk."""
    if DECAY == 1:
        n = tl.minimum(tl.maximum(T_live - i_n * BT, 0), BT).to(tl.float32)
        return head_log_decays(tl.load(g_ptr + i_h).to(tl.float32), n,
                               t - i_n * BT, REVERSE)
    else:
        g = load_log_decay(g_ptr, i_h, row0, t, t < T_live, DECAY)
        return chunk_log_decays(g, t - i_n * BT, BT, REVERSE, False)


@triton.jit
def chunk_decay_kernel(
    g_ptr, len_ptr,
    ka_ptr, kr_ptr, gl_ptr, hi_ptr, lo_ptr,
    cu_ptr, co_ptr, ci_ptr,
    T, H, NT,
    BT: tl.constexpr, DECAY: tl.constexpr, KA: tl.constexpr, KR: tl.constexpr,
    PREFIX: tl.constexpr, HAS_LEN: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    """Program (chunk, b H + h) stores its chunk's ka (KA), kr (KR), gl and,
    with a decay per token, hi and lo (PREFIX): entry c BT + j for key j
    (c for gl), c the chunk's index in the per-chunk states. Its tokens are read
    as `chunk_state_kernel` reads them (HAS_LEN: from len on as padding,
    g = 0)."""
    i_hb = tl.program_id(1).to(tl.int64)
    i_seq, i_h, i_n = chunk_of_program(
        tl.program_id(0), i_hb, ci_ptr, H, IS_VARLEN)
    row0, T_seq = sequence_rows(i_seq, i_h, cu_ptr, T, H, IS_VARLEN)
    if IS_VARLEN:
        # a slot past the last chunk (sequences.py)
        if is_padding_chunk(i_n, T_seq, BT):
            return
    if HAS_LEN:
        T_seq = tl.minimum(T_seq, tl.load(len_ptr + i_hb))
    c = first_chunk(i_seq, i_h, co_ptr, NT, H, IS_VARLEN) + i_n
    o_t = tl.arange(0, BT)
    t = i_n * BT + o_t
    # in the forward direction, q_log is c_j:
    # from the chunk's start to each token
    if DECAY == 1:
        _, c_log, a_log, g_last = chunk_decays_at(
            g_ptr, i_h, row0, i_n, t, T_seq, BT, False, DECAY)
    else:
        g = load_log_decay(g_ptr, i_h, row0, t, t < T_seq, DECAY)
        _, c_log, a_log, g_last = chunk_log_decays(g, o_t, BT, False, False)
    if KA:
        tl.store(ka_ptr + c * BT + o_t, tl.exp(a_log))     # every exponent <= 0
    if KR:
        tl.store(kr_ptr + c * BT + o_t, tl.exp(c_log))
    tl.store(gl_ptr + c, tl.exp(g_last))
    if PREFIX and DECAY == 2:
        hi, lo = _compensated_cumsum(tl.cumsum(g, axis=0), g, o_t, BT)
        tl.store(hi_ptr + c * BT + o_t, hi)
        tl.store(lo_ptr + c * BT + o_t, lo)


class ChunkDecays(NamedTuple):
    """`chunk_decays`' tensors (fp32, flat: entry c BT + j, c for gl); None
    where not asked for."""

    ka: torch.Tensor | None
    kr: torch.Tensor | None
    gl: torch.Tensor
    hi: torch.Tensor | None
    lo: torch.Tensor | None


def launch_config(kernel: str, d_whole: int, dtype: torch.dtype,
                  device) -> dict:
    """`select_config(kernel, d_whole, dtype, device)`, looked up once per
    (kernel, head dim, dtype, compute capability): a launcher's config costs a
    dict lookup, not a search (and one more while an experiment overrides
    configs: `configs.overridden`)."""
    cfg = _launch_config(kernel, d_whole, dtype,
                         configs.device_capability(device))
    if configs.OVERRIDES and kernel in configs.OVERRIDES:
        return {**cfg, **configs.OVERRIDES[kernel]}
    return cfg


@functools.lru_cache(maxsize=512)
def _launch_config(kernel: str, d_whole: int, dtype: torch.dtype,
                   capability) -> dict:
    return select_config(kernel, d_whole, dtype, capability)


def chunk_decays(
    g: torch.Tensor, B: int, H: int, T: int, BT: int, *,
    layout: tuple | None = None, lengths: torch.Tensor | None = None,
    to_end: bool = True, to_start: bool = False, prefix: bool = False,
) -> ChunkDecays:
    """Launch `chunk_decay_kernel` on the log-decay g ((H,) or (B, H, T)): ka
    when to_end, kr when to_start, gl, and hi / lo when prefix (a decay per
    token only), for the chunks of BT tokens of every (batch, head) row. layout:
    `sequences.packed_layout` of packed sequences (B = 1), None when batched.
    lengths: (B, H) int32, tokens from there on read as padding."""
    check_decay("chunk_decays", g, B, H, T, g.device)
    cu, offsets, indices, NT = (layout or packed_layout(None, T, B, H, BT))[:4]
    f32 = dict(dtype=torch.float32, device=g.device)
    n = B * H * NT
    prefix = prefix and g.dim() > 1
    per_key = lambda asked: torch.empty(n * BT, **f32) if asked else None
    out = ChunkDecays(per_key(to_end), per_key(to_start), torch.empty(n, **f32),
                      per_key(prefix), per_key(prefix))
    if n:
        ptrs = [lengths, *out, cu, offsets, indices]
        cfg = launch_config("chunk_decay", BT, g.dtype, g.device)
        launchable(chunk_decay_kernel, g.device)[
            checked_grid("chunk_decays", NT, B * H)](
            g, *(p if p is not None else out.gl for p in ptrs), T, H, NT,
            BT=BT, DECAY=1 if g.dim() == 1 else 2,
            KA=to_end, KR=to_start, PREFIX=prefix,
            HAS_LEN=lengths is not None, IS_VARLEN=cu is not None,
            num_warps=cfg["num_warps"], num_stages=1)
    return out


def compile_spec(cfg: dict, dtype: str) -> tuple[dict, dict]:
    """Signature and constexprs of `chunk_decay_kernel`'s heaviest variant
    (a log-decay per token, every output, the backward's dead tail); its inputs
    are fp32 whatever `dtype`."""
    signature = {
        "g_ptr": "*fp32", "len_ptr": "*i32",
        **dict.fromkeys(("ka_ptr", "kr_ptr", "gl_ptr", "hi_ptr", "lo_ptr"),
                        "*fp32"),
        "cu_ptr": "*i32", "co_ptr": "*i32", "ci_ptr": "*i32",
        "T": "i32", "H": "i32", "NT": "i32",
    }
    constexprs = {"BT": cfg["BT"], "DECAY": 2, "KA": True, "KR": True,
                  "PREFIX": True, "HAS_LEN": True, "IS_VARLEN": False}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    return signature, constexprs
