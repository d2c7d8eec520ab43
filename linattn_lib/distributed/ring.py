"""Ring attention: the softmax baseline of chapter 9, forward only.

Exact causal softmax attention over a sequence split across the ranks of a process group, the
keys and values passed around a ring (Liu et al. 2023): every rank ends up receiving (W-1)
key/value slices, O(T d) bytes, where sequence-parallel linear attention (`sequence_parallel.py`)
moves (W-1) states whatever T is. It is here to run and measure that traffic, not to train
with: it has no backward. `ring_attention_bytes_per_rank` is its byte count, computed.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _validate as V
from ..core.state import compute_dtype
from .comm import (
    CommLog,
    _Arg,
    _check_same_on_every_rank,
    _group_info,
    _layout_args,
    _send_recv,
)
from .sequence_parallel import split_sequence

__all__ = ["ring_attention", "ring_attention_bytes_per_rank"]

_RING = "ring_attention"


def _check_ring_arguments(q: Tensor, k: Tensor, v: Tensor, *, seq_len: int, causal: bool, scale: float | None,
                          group: dist.ProcessGroup | None) -> tuple[float, list[tuple[int, int]]]:
    """Every check, in the order the errors are reported: this rank's own arguments, then the
    descriptor all-gather (the same on every rank), then this rank's share of the tokens.
    Returns the scale (1/sqrt(Dk) for None) and the slices of `split_sequence(seq_len, W)`."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        V.check_tensor(_RING, name, x, ndim=4)
    rank, world = _group_info(group)
    bounds = split_sequence(seq_len, world)
    V.check_same(_RING, [("q", q), ("k", k), ("v", v)])
    B, H, T, Dk = q.shape
    if tuple(k.shape) != (B, H, T, Dk) or tuple(v.shape[:3]) != (B, H, T):
        raise ValueError(f"{_RING}: this rank's k {tuple(k.shape)} and v {tuple(v.shape)} must match q "
                         f"{tuple(q.shape)} in (B, H, T_r), and k must match q's Dk")
    V.check_flag(_RING, "causal", causal)
    scale = 1.0 / math.sqrt(Dk) if scale is None else V.check_number(_RING, "scale", scale)
    _check_same_on_every_rank(_RING, [
        *_layout_args(q, v),
        _Arg("`causal`={}", "`causal`={}", bool(causal)),
        _Arg("`seq_len`={}", "`seq_len`={}", int(seq_len)),
        _Arg("`scale`={!r}", "`scale`={!r}", float(scale)),
    ], group, q)
    if T != bounds[rank][1] - bounds[rank][0]:
        raise ValueError(f"{_RING}: rank {rank} holds T_r={T} tokens, but split_sequence({seq_len}, {world}) "
                         f"gives it {bounds[rank][1] - bounds[rank][0]}")
    return scale, bounds


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, seq_len: int, causal: bool = True,
                   scale: float | None = None, group: dist.ProcessGroup | None = None,
                   comm: CommLog | None = None) -> Tensor:
    """Exact softmax attention over a sequence split across ranks, keys and values passed in a ring.

    Each rank keeps its queries and, for W steps, attends to the key/value block it holds,
    merging the partial results with the online-softmax rule (running max m, sum l); between
    steps every rank sends its block to rank r+1 and receives one from rank r-1, so each block
    visits every rank (Liu et al. 2023). Here each exchange completes before the next block
    is used (no overlap of transfer and compute, which the paper's implementation adds).

    Forward only (no autograd): it is here to run and measure the traffic that softmax
    attention needs, (W-1) key/value slices per rank, against linear attention's states.

    Args:
        q, k: (B, H, T_r, Dk), v: (B, H, T_r, Dv): this rank's slice of a sequence of length
            `seq_len` split by `split_sequence(seq_len, W)`.
        causal: mask keys after the query (blocks of later ranks are skipped, but still forwarded).

    Raises:
        ValueError on every rank if the ranks disagree on B, H, Dk, Dv, the dtype or device type
        of q, `causal`, `seq_len` or `scale` (None counts as 1/sqrt(Dk)), naming the argument and
        each rank's value (one all-gather of a few numbers first, not recorded in `comm`).
    """
    scale, bounds = _check_ring_arguments(q, k, v, seq_len=seq_len, causal=causal, scale=scale, group=group)
    with torch.no_grad():
        out = _ring_forward(q, k, v, scale=scale, causal=bool(causal), bounds=bounds, group=group, comm=comm)
    return out.to(v.dtype)


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, *, scale: float, causal: bool, bounds: list[tuple[int, int]],
                  group: dist.ProcessGroup | None, comm: CommLog | None) -> Tensor:
    """The W steps of the ring: at step s this rank holds the key/value block of rank r - s,
    receives the next one (from rank r - 1) while passing this one on (to rank r + 1), and
    merges this block into its running softmax. Returns o in the compute dtype."""
    rank, world = _group_info(group)
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    dtype = compute_dtype(q)
    qs = q.to(dtype) * scale
    m = torch.full((B, H, T), float("-inf"), dtype=dtype, device=q.device)
    l = torch.zeros(B, H, T, dtype=dtype, device=q.device)
    acc = torch.zeros(B, H, T, Dv, dtype=dtype, device=q.device)
    block = torch.cat([k, v.to(k.dtype)], dim=-1).contiguous()  # one message per step
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for step in range(world):
        src = (rank - step) % world  # the rank whose keys this block holds
        incoming = None
        if step < world - 1:  # post the transfer of the next block before computing
            n_in = bounds[(rank - step - 1) % world][1] - bounds[(rank - step - 1) % world][0]
            incoming = block.new_empty(B, H, n_in, Dk + Dv)
            _send_recv(block if block.shape[2] else None, nxt, incoming if n_in else None, prv,
                       group, comm, "key/value block")
        if block.shape[2] and T and not (causal and src > rank):
            m, l, acc = _merge_block(qs, block, m, l, acc, diagonal=causal and src == rank)
        if incoming is not None:
            block = incoming
    return acc / l.unsqueeze(-1) if T else acc


def _merge_block(qs: Tensor, block: Tensor, m: Tensor, l: Tensor, acc: Tensor, *,
                 diagonal: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The online-softmax rule: fold one key/value block into the running max m, sum l and
    unnormalised output acc of the scaled queries qs. `diagonal`: the block is this rank's own
    (mask the keys after each query)."""
    T, Dk = qs.shape[2], qs.shape[3]
    kb, vb = block[..., :Dk].to(qs.dtype), block[..., Dk:].to(qs.dtype)
    s = qs @ kb.transpose(-1, -2)
    if diagonal:
        s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=qs.device).tril(), float("-inf"))
    m_new = torch.maximum(m, s.amax(-1))
    p = torch.exp(s - m_new.unsqueeze(-1))
    corr = torch.exp(m - m_new)  # exp(-inf) = 0 on the first block
    return m_new, l * corr + p.sum(-1), acc * corr.unsqueeze(-1) + p @ vb


def ring_attention_bytes_per_rank(seq_len: int, world_size: int, *, batch: int, heads: int, dk: int, dv: int,
                                  bytes_per_element: int = 4, rank: int | None = None) -> int:
    """Bytes one rank sends in `ring_attention`'s forward: W-1 key/value blocks.

    Rank r forwards every block except the one that reaches it last (from rank r+1); with T
    divisible by W this is (W-1) * (T/W) * B * H * (Dk + Dv) * bytes for every rank. `rank`
    picks one rank for uneven splits (default: the largest over ranks).
    """
    bounds = split_sequence(seq_len, world_size)
    per_token = batch * heads * (dk + dv) * bytes_per_element

    def one(r: int) -> int:
        if world_size == 1:
            return 0
        return sum(b - a for i, (a, b) in enumerate(bounds) if i != (r + 1) % world_size) * per_token

    return one(rank) if rank is not None else max(one(r) for r in range(world_size))
