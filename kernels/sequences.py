"""Where a program's tokens and states are: batches of equal length, or packed sequences.

The chunk kernels of the two-phase engine (chunk_state.py, chunk_output.py, chunk_grad.py)
run on either layout; only these helpers know the difference.

    batched   q: (B, H, T, D). Sequence b, head h owns rows (b H + h) T ... + T - 1 of the
              (B H T) x D row space; it has NT = ceil(T / BT) chunks, and its per-chunk
              states are rows (b H + h) NT ... of the (B H NT) x Dk x Dv state tensor.
    packed    q: (1, H, T_total, D) with `cu_seqlens` (N + 1,): sequence i is tokens
              cu[i] ... cu[i+1] - 1 (as in flash-attn's varlen functions and fla). Head h
              of sequence i owns rows h T_total + cu[i] ...; its chunks are counted from
              `chunk_offsets[i]` = sum_{j < i} ceil(len_j / BT) in the (H NT) x Dk x Dv
              state tensor, so that a chunk never holds tokens of two sequences.

No host sync. The chunk count sum_i ceil(len_i / BT) lives on the device; reading it back to
size the buffers would stall the host on every call. So NT is its bound, known from shapes
alone: NT = ceil(T_total / BT) + N - 1. (With len_i = a_i BT + r_i, 0 <= r_i < BT, the count
is sum_i a_i + #{r_i > 0} and ceil(T_total / BT) = sum_i a_i + ceil(sum_i r_i / BT); the
partial chunks #{r_i > 0} are at most N, and when there is one, ceil(sum_i r_i / BT) >= 1.)
Per-chunk buffers have NT slots and the parallel grids NT programs per head; the
slots past the last real chunk (at most N - 1) belong to a padding "sequence" N of length 0
(`packed_layout`: cu has an extra entry cu[N + 1] = cu[N]), and their programs return at
once: a chunk whose first token is at or past its sequence's end (`is_padding_chunk`).

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


@triton.jit
def is_padding_chunk(i_n, T_seq, BT: tl.constexpr):
    """Whether a parallel program's chunk i_n has no tokens (its sequence has T_seq): only the
    padding slots of packed sequences, whose sequence N has length 0. Their programs return
    before they read or write anything else."""
    return i_n * BT >= T_seq


@triton.jit
def dim_mask(o, D, N: tl.constexpr, EVEN: tl.constexpr):
    """Which of a tile's N head-dim indices o are below the head dim D; all of
    them when EVEN (the launcher has checked that D is a multiple of the
    tile's width, `even_dims`). Then the compiler drops the compares and ANDs
    of every element's mask: 2-16% of a parallel kernel's SASS (sm_90)."""
    if EVEN:
        return tl.full([N], 1, tl.int1)
    return o < D


def even_dims(*pairs: tuple[int, int]) -> bool:
    """Whether every head dim is a multiple of its tile width: pairs (D, width)."""
    return all(D % width == 0 for D, width in pairs)


def as_f32(x: torch.Tensor | None) -> torch.Tensor | None:
    """x as the kernels read it, float32 and contiguous; x itself when it already
    is. `x.to(torch.float32)` would return x too, but only after torch's argument
    parsing, about a microsecond a call on the launch path (None stays None)."""
    if x is None or (x.dtype == torch.float32 and x.is_contiguous()):
        return x
    return x.to(torch.float32).contiguous()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints: what `triton.cdiv` gives, without its constexpr wrapper (which
    costs a few microseconds a call on the launch path in Triton 3.6+)."""
    return -(-a // b)


def packed_starts(cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """cu_seqlens as the kernels read it: int32, clamped into [0, T] and made non-decreasing
    (a running max), on the device, no sync. A valid cu_seqlens is unchanged; an unchecked
    bad one (linear_attention checks values on CUDA only when asked to) then gives wrong
    outputs but never a read or write outside the tensors."""
    cu = cu_seqlens.to(torch.int32).clamp(0, T)
    return torch.cummax(cu, 0).values.contiguous()


def packed_layout(cu_seqlens: torch.Tensor | None, T: int, B: int, H: int, BT: int):
    """The chunk bookkeeping of a launch: (cu, chunk_offsets, chunk_indices, NT, n_seq).

    Batched (cu_seqlens None): (None, None, None, ceil(T / BT), B). Packed, N sequences:
    cu (N + 2,) int32, `packed_starts` and then cu[N] again (the padding sequence N, of length
    0); chunk_offsets (N + 1,) int32, chunk_offsets[i] the first chunk of sequence i and
    chunk_offsets[N] the number of real chunks; chunk_indices (NT, 2) int32 rows (sequence,
    chunk within it), the slots past the real chunks (N, 0), (N, 1), ...; NT = ceil(T / BT)
    + N - 1, the bound on the chunk count (module docstring); n_seq = N. No host sync: NT
    comes from shapes, and `repeat_interleave` is told its output size.
    """
    if cu_seqlens is None:
        return None, None, None, cdiv(T, BT), B
    N = cu_seqlens.numel() - 1
    NT = cdiv(T, BT) + max(N - 1, 0)
    starts = packed_starts(cu_seqlens, T)
    cu = torch.cat([starts, starts[-1:]])
    n_chunks = (starts[1:] - starts[:-1] + BT - 1) // BT
    offsets = torch.zeros(N + 1, dtype=torch.int32, device=cu.device)
    offsets[1:] = torch.cumsum(n_chunks, 0)
    counts = torch.cat([n_chunks, NT - offsets[-1:]])      # the padding sequence takes the rest
    seq = torch.repeat_interleave(torch.arange(N + 1, device=cu.device, dtype=torch.int32), counts,
                                  output_size=NT)
    local = torch.arange(NT, device=cu.device, dtype=torch.int32) - offsets[seq.long()]
    return cu, offsets, torch.stack([seq, local], 1).contiguous(), NT, N
