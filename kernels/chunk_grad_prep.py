"""The backward's per-token passes around its two phases (chunk_grad.py): before
them, 1 / den, dL/dden and the live lengths from dO; after them, the
log-decay's gradient as a suffix sum of the parallel kernels' partials.

Tested by tests/test_kernels_two_phase.py; launched by `chunk_bwd_two_phase`
(chunk_grad.py) and the non-causal backward (noncausal.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk_decay import launch_config
from .configs import launchable
from .sequences import cdiv, packed_starts, sequence_rows
from .shapes import checked_grid, expect, sequences


@triton.jit
def chunk_bwd_prep_kernel(do_ptr, o_ptr, den_ptr, r_ptr, e_ptr, len_ptr, T, Dv,
                          BT: tl.constexpr, BV: tl.constexpr,
                          NORMALIZE: tl.constexpr, FIND_LEN: tl.constexpr):
    """Per row of dO (one program: BT tokens of one (batch, head) row, the
    whole Dv):

    NORMALIZE  r = 1 / den and e = -(dO . o) / den (fp32), 0 for a row whose dO
               is all zero: a zero cotangent selects zero, for an output no loss
               term depends on (padding, one after a NaN) may be inf or NaN, and
               0 * NaN would carry it into every earlier gradient;
    FIND_LEN   len[b, h] = 1 + the last token whose dO is not all zero
               (atomic max; len must start at 0): the tokens after it are the
               dead tail the other kernels skip.
    """
    i_t = tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    t = i_t * BT + tl.arange(0, BT)
    m_t = t < T
    rows = i_bh * T + t
    cols = tl.arange(0, BV)
    m = m_t[:, None] & (cols < Dv)[None, :]
    do = tl.load(do_ptr + rows[:, None] * Dv + cols[None, :], mask=m,
                 other=0.0).to(tl.float32)
    used = do != 0
    row_used = tl.max(used.to(tl.int32), axis=1) > 0
    if NORMALIZE:
        o = tl.load(o_ptr + rows[:, None] * Dv + cols[None, :], mask=m,
                    other=0.0).to(tl.float32)
        dot = tl.sum(tl.where(used, do * o, 0.0), axis=1)
        den = tl.load(den_ptr + rows, mask=m_t & row_used, other=1.0)
        tl.store(r_ptr + rows, tl.where(row_used, 1.0 / den, 0.0), mask=m_t)
        tl.store(e_ptr + rows, tl.where(dot != 0, -dot / den, 0.0), mask=m_t)
    if FIND_LEN:
        tl.atomic_max(len_ptr + i_bh,
                      tl.max(tl.where(row_used, t + 1, 0), axis=0))


@triton.jit
def live_length_kernel(do_ptr, len_ptr, T, Dv, P,
                       BT: tl.constexpr, BV: tl.constexpr):
    """len[b, h] = 1 + the last token whose dO is not all zero (atomic max; len
    must start at 0), as chunk_bwd_prep_kernel's FIND_LEN finds it but read from
    the end: program p of a row's P reads its blocks of BT tokens p,
    p + P, ... counted from the last one, and stops at the first that holds a
    nonzero row. A row with no dead tail is read P blocks deep, not all of it
    (where r and e are not needed: the unnormalised backward)."""
    i_bh = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BV)
    n = tl.cdiv(T, BT) - 1 - tl.program_id(0)
    last = -1
    while (last < 0) & (n >= 0):
        t = n * BT + tl.arange(0, BT)
        m = (t < T)[:, None] & (cols < Dv)[None, :]
        do = tl.load(do_ptr + (i_bh * T + t)[:, None] * Dv + cols[None, :],
                     mask=m, other=0.0)
        used = tl.max((do != 0).to(tl.int32), axis=1) > 0
        last = tl.max(tl.where(used, t, -1), axis=0)
        n -= P
    tl.atomic_max(len_ptr + i_bh, last + 1)


@triton.jit
def decay_grad_kernel(part_ptr, end_ptr, dg_ptr, cu_ptr, T, H, n_rows, NK,
                      BT: tl.constexpr, HAS_END: tl.constexpr,
                      IS_VARLEN: tl.constexpr):
    """The log-decay's gradient for the tokens of one (sequence, head) (program
    (sequence, head)): dL/dG_t = the sum over s >= t in the sequence of
    r_s = q_s . dq_s - k_s . dk_s, the NK key blocks' partials of
    chunk_dqk_kernel ((NK, rows) fp32) added here, plus the final state's
    term end[sequence H + head] (HAS_END). Walked from the sequence's end in
    blocks of BT tokens: each a reversed scan plus the sum of the blocks after
    it, so that every entry is a sum of exactly its own terms (no difference of
    larger sums)."""
    i_seq = tl.program_id(0).to(tl.int64)
    i_h = tl.program_id(1).to(tl.int64)
    row0, T_seq = sequence_rows(i_seq, i_h, cu_ptr, T, H, IS_VARLEN)
    after = 0.0
    if HAS_END:
        after = tl.load(end_ptr + i_seq * H + i_h)
    for i in range(0, tl.cdiv(T_seq, BT)):
        t = T_seq - (i + 1) * BT + tl.arange(0, BT)
        r = tl.zeros([BT], dtype=tl.float32)
        part = part_ptr + row0 + t
        # the pointer steps by n_rows: 64-bit addresses
        for _ in range(0, NK):
            r += tl.load(part, mask=t >= 0, other=0.0)
            part += n_rows
        tl.store(dg_ptr + row0 + t,
                 tl.cumsum(r, axis=0, reverse=True) + after, mask=t >= 0)
        after += tl.sum(r, axis=0)


def decay_grad(parts: torch.Tensor, end: torch.Tensor | None,
               cu_seqlens: torch.Tensor | None = None,
               config: dict | None = None) -> torch.Tensor:
    """Launch `decay_grad_kernel`: dL/dG (B, H, T) fp32 from the per-block
    partials (NK, B, H, T) of q . dq - k . dk, summed after each token within
    its sequence; end (sequences, H) fp32 or None: the final state's term, added
    to every token of its sequence."""
    if parts.dim() != 4:
        raise ValueError(f"decay_grad: `parts` must be (NK, B, H, T), got "
                         f"shape {tuple(parts.shape)}")
    NK, B, H, T = parts.shape
    rows = sequences("decay_grad", cu_seqlens, B, parts.device)
    expect("decay_grad", "end", end, (rows, H), parts.device)
    cfg = config or launch_config("decay_grad", 1, torch.float32, parts.device)
    dg = torch.empty(B, H, T, dtype=torch.float32, device=parts.device)
    cu = None if cu_seqlens is None else packed_starts(cu_seqlens, T)
    if dg.numel() and rows:
        launchable(decay_grad_kernel, parts.device)[(rows, H)](
            parts.contiguous(), end.contiguous() if end is not None else dg,
            dg, cu if cu is not None else dg, T, H, B * H * T, NK,
            BT=cfg["BT"], HAS_END=end is not None, IS_VARLEN=cu is not None,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return dg


LIVE_LENGTH_PROGRAMS = 16


def chunk_bwd_prep(do: torch.Tensor, o: torch.Tensor | None,
                   den: torch.Tensor | None, *, find_lengths: bool = False,
                   config: dict | None = None) -> tuple:
    """Launch `chunk_bwd_prep_kernel`: (r, e, lengths).

    r, e: 1 / den and dL/dden = -(dO . o) / den, fp32 (B, H, T), when den is
    given (else None). lengths: (B, H) int32, 1 + the last position whose
    cotangent is not zero (0 if none), when find_lengths (else None). dO is read
    once for both; for the lengths alone, from the end of each row
    (`live_length_kernel`, LIVE_LENGTH_PROGRAMS programs a row)."""
    B, H, T, Dv = do.shape
    expect("chunk_bwd_prep", "o", o, do.shape, do.device)
    expect("chunk_bwd_prep", "den", den, (B, H, T), do.device)
    normalize = den is not None
    cfg = config or launch_config(
        "chunk_bwd_prep" if normalize else "live_length",
        Dv, do.dtype, do.device)
    r = e = lengths = None
    if normalize:
        r = torch.empty(B, H, T, dtype=torch.float32, device=do.device)
        e = torch.empty_like(r)
    if find_lengths:
        lengths = torch.zeros(B, H, dtype=torch.int32, device=do.device)
    if B * H * T and normalize:
        dummy = do
        launchable(chunk_bwd_prep_kernel, do.device)[
            checked_grid("chunk_bwd_prep", cdiv(T, cfg["BT"]), B * H)
        ](
            do.contiguous(),
            *(x.contiguous() if x is not None else dummy
              for x in (o, den, r, e, lengths)),
            T, Dv, BT=cfg["BT"], BV=cfg["BV"],
            NORMALIZE=normalize, FIND_LEN=find_lengths,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    elif B * H * T and find_lengths:
        P = min(cdiv(T, cfg["BT"]), LIVE_LENGTH_PROGRAMS)
        launchable(live_length_kernel, do.device)[
            checked_grid("chunk_bwd_prep", P, B * H)](
            do.contiguous(), lengths, T, Dv, P, BT=cfg["BT"], BV=cfg["BV"],
            num_warps=cfg["num_warps"], num_stages=1)
    return r, e, lengths
