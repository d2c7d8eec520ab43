"""Where a program's tokens and states are: batches of equal length, or packed sequences.

The chunk kernels of the two-phase engine (chunk_state.py, chunk_output.py, chunk_grad.py)
run on either layout; only these helpers know the difference.

    batched   q: (B, H, T, D). Sequence b, head h owns rows (b H + h) T ... + T - 1 of the
              (B H T) x D row space; it has NT = ceil(T / BT) chunks, and its per-chunk
              states are rows (b H + h) NT ... of the (B H NT) x Dk x Dv state tensor.
    packed    q: (1, H, T_total, D) with `cu_seqlens` (N + 1,): sequence i is tokens
              cu[i] ... cu[i+1] - 1 (as in flash-attn's varlen functions and fla). Head h
              of sequence i owns rows h T_total + cu[i] ...; its chunks are counted from
              `chunk_offsets[i]` = sum_{j < i} ceil(len_j / BT) in the (H NT_total) x Dk x Dv
              state tensor, so that a chunk never holds tokens of two sequences.

Per-token vectors (log-decays, denominators) share the token rows, per-sequence states
(initial, final) are indexed by sequence * H + head in both layouts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def sequence_rows(i_seq, i_h, cu_ptr, T, H, IS_VARLEN: tl.constexpr):
    """(row of the sequence's first token, its length) for head i_h of sequence i_seq.

    T is the padded length (batched) or T_total (packed)."""
    if IS_VARLEN:
        bos = tl.load(cu_ptr + i_seq).to(tl.int64)
        eos = tl.load(cu_ptr + i_seq + 1).to(tl.int64)
        return i_h * T + bos, (eos - bos).to(tl.int32)
    else:
        return (i_seq * H + i_h) * T, T


@triton.jit
def first_chunk(i_seq, i_h, co_ptr, NT, H, IS_VARLEN: tl.constexpr):
    """Index of the sequence's first chunk in the per-chunk state tensors (NT: chunks per
    sequence when batched, chunks in all when packed)."""
    if IS_VARLEN:
        return i_h * NT + tl.load(co_ptr + i_seq).to(tl.int64)
    else:
        return (i_seq * H + i_h) * NT


@triton.jit
def chunk_of_program(i_c, i_hb, ci_ptr, H, IS_VARLEN: tl.constexpr):
    """(sequence, head, chunk within the sequence) of a parallel kernel's program
    (program_id(1) = i_c, program_id(2) = i_hb: b H + h when batched, h when packed)."""
    if IS_VARLEN:
        i_seq = tl.load(ci_ptr + 2 * i_c).to(tl.int64)
        n = tl.load(ci_ptr + 2 * i_c + 1)
        return i_seq, i_hb, n
    else:
        return i_hb // H, i_hb % H, i_c


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints: what `triton.cdiv` gives, without its constexpr wrapper (which
    costs a few microseconds a call on the launch path in Triton 3.6+)."""
    return -(-a // b)


def packed_layout(cu_seqlens: torch.Tensor | None, T: int, B: int, H: int, BT: int):
    """The chunk bookkeeping of a launch: (cu, chunk_offsets, chunk_indices, NT, n_seq).

    Batched (cu_seqlens None): (None, None, None, ceil(T / BT), B). Packed: cu as int32,
    chunk_offsets (N + 1,) int32, chunk_indices (NT_total, 2) int32 rows (sequence, chunk
    within it), NT_total and N. One host sync (NT_total sizes the state tensors).
    """
    if cu_seqlens is None:
        return None, None, None, cdiv(T, BT), B
    cu = cu_seqlens.to(torch.int32).contiguous()
    n_chunks = (cu[1:] - cu[:-1] + BT - 1) // BT
    offsets = torch.zeros(len(cu), dtype=torch.int32, device=cu.device)
    offsets[1:] = torch.cumsum(n_chunks, 0)
    NT = int(offsets[-1])
    seq = torch.repeat_interleave(torch.arange(len(cu) - 1, device=cu.device, dtype=torch.int32), n_chunks)
    local = torch.arange(NT, device=cu.device, dtype=torch.int32) - offsets[:-1].long()[seq.long()].int()
    return cu, offsets, torch.stack([seq, local], 1).contiguous(), NT, len(cu) - 1
