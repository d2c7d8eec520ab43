"""Sequence parallelism for causal linear attention on `torch.distributed`: the algorithm.

The sequence (length T) is cut into W contiguous slices, one per rank of a process group.
Softmax attention would need every earlier key and value on every rank (ring attention passes
all of them around: O(T d) bytes per rank; see `ring.py`). Causal linear attention needs only
the *state* entering the slice, a Dk x Dv matrix (plus the Dk normaliser and one decay number)
per head, whatever T is. With the per-token log-decay g (zero without decay):

    rank r, alone:   S_r = sum_{j in slice r} exp(g_{j+1} + ... + g_end) k_j v_j^T   (z_r likewise)
                     G_r = sum_{j in slice r} g_j                      (log decay across the slice)
    the scan:        S_in_0 = 0,   S_in_{r+1} = exp(G_r) S_in_r + S_r
    rank r, output:  linear attention over its slice, resumed from the state S_in_r

**All-gather by default; a chain of sends for comparison** (`scan="all_gather"` / `"ring"`).
Each rank packs (S_r, z_r, G_r) into one buffer of B*H*(Dk*Dv + Dk + 1) numbers, one
`all_gather` gives every rank every buffer, and each rank combines the prefix of the ranks
before it locally (O(W Dk Dv) flops). A chain of point-to-point sends (rank r waits for S_in_r
from rank r-1, then sends exp(G_r) S_in_r + S_r to rank r+1) moves fewer bytes -- one state
per rank instead of W-1 -- but each of its W-1 steps needs the result of the step before: the
last rank cannot start until every other rank has done its step, and one slow rank delays all
ranks after it. What goes into the all-gather depends only on each rank's own tokens, so it is
one collective that the communication library schedules with its best algorithm and that can
overlap the local attention; its (W-1) states per rank do not depend on T and are tiny next to
the activations. LASP (Sun et al. 2024) passes the state along a ring of sends; LASP-2 (Sun et
al. 2025) replaced that with one all-gather of the states.

**Backward: the reverse scan.** The gradient with respect to the state entering rank r,
dS_in_r, comes out of rank r's local backward. It must flow to the earlier ranks whose local
states built S_in_r: with D_r = dL/d(state leaving rank r),

    D_{W-1} = 0,   D_{r-1} = dS_in_r + exp(G_r) D_r,   dL/dS_r = D_r,
    dL/dG_r = exp(G_r) <D_r, S_in_r>   (+ the same with z)

One all-gather of the dS_in (and dz_in) gives every rank what it needs (`_StateScan`); the chain
passes D_r from rank r+1 to rank r instead (`_RingStateScan`).

Every collective goes through `comm.py`, which counts the bytes into an optional `CommLog`,
turns a failure of a peer into a `PeerFailureError`, and checks, before the states move, that
every rank was called with the same arguments. This module holds the algorithm only: it starts
no processes (`launcher.py`) and compares nothing with a reference (`harness.py`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _validate as V
from ..core.linear import linear_attention
from ..core.once import once_differentiable
from ..core.state import (
    DEFAULT_EPS,
    LinearAttentionState,
    compute_dtype,
    expand_log_decay,
    sum_after,
)
from .comm import (
    _DECAY_KINDS,
    CommLog,
    _all_gather,
    _Arg,
    _check_same_on_every_rank,
    _group_info,
    _layout_args,
    _send_recv,
)

__all__ = [
    "linear_sp_bytes_per_rank",
    "local_state",
    "prefix_states",
    "prefix_states_backward",
    "sequence_parallel_linear_attention",
    "shard_sequence",
    "split_sequence",
]


# --------------------------------------------------------------------------------------
# splitting the sequence
# --------------------------------------------------------------------------------------


def split_sequence(seq_len: int, world_size: int) -> list[tuple[int, int]]:
    """Contiguous [start, stop) slices of range(seq_len), one per rank, sizes differing by <= 1.

    The first seq_len % world_size ranks get one extra token (as `torch.tensor_split`). With
    seq_len < world_size the last ranks get empty slices; the scan handles them.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"split_sequence: `seq_len` must be a non-negative int, got {seq_len!r}")
    V.check_positive_int("split_sequence", "world_size", world_size)
    base, extra = divmod(seq_len, world_size)
    bounds, start = [], 0
    for r in range(world_size):
        stop = start + base + (1 if r < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def shard_sequence(x: Tensor, rank: int, world_size: int, dim: int = 2) -> Tensor:
    """Rank `rank`'s contiguous slice of `x` along `dim` (the T axis of (B, H, T, D) by default)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"shard_sequence: `rank` must be in [0, {world_size}), got {rank}")
    start, stop = split_sequence(x.shape[dim], world_size)[rank]
    return x.narrow(dim, start, stop - start)


# --------------------------------------------------------------------------------------
# the scan over ranks: pure functions (no communication), shared by the autograd Function
# --------------------------------------------------------------------------------------


def local_state(k: Tensor, v: Tensor, log_decay: Tensor | None = None, *,
                normalize: bool = True) -> tuple[Tensor, Tensor | None, Tensor]:
    """The state one slice builds from zero, and the log-decay across it (differentiable).

    Args:
        k: (B, H, T, Dk) key features of the slice; v: (B, H, T, Dv).
        log_decay: None, (H,) or (B, H, T) log-decay of the slice's tokens (<= 0).
    Returns:
        (S, z, G): S = sum_j exp(g_{j+1} + ... + g_T) k_j v_j^T of shape (B, H, Dk, Dv)
        (= exp(c_T - c_j) with c the cumulative log-decay, but summed from j + 1 on, never
        taken as that difference); z the same sum over k_j (B, H, Dk), or None when
        normalize=False; G = c_T (B, H), the log of the factor by which the slice decays an
        incoming state.
        Float32 (float64 for float64 input).
    """
    B, H, T, _ = k.shape
    dtype = compute_dtype(k)
    kk, vv = k.to(dtype), v.to(dtype)
    if log_decay is None:
        S = kk.transpose(-1, -2) @ vv
        z = kk.sum(-2) if normalize else None
        return S, z, torch.zeros(B, H, dtype=dtype, device=k.device)
    g = expand_log_decay(log_decay, B, H, T, dtype=dtype, device=k.device)
    G = g.sum(-1)  # the decay across the whole slice (0 for an empty one)
    # exp(g_{j+1} + ... + g_T) <= 1, summed from j + 1 on, not c_T - c_j (see core/state.py)
    kw = kk * torch.exp(sum_after(g)).unsqueeze(-1)
    S = kw.transpose(-1, -2) @ vv
    z = kw.sum(-2) if normalize else None
    return S, z, G


def prefix_states(S_loc: Tensor, G: Tensor, z_loc: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """The scan over ranks: the state entering every rank from the ranks' own states.

    Args:
        S_loc: (W, ..., Dk, Dv) the local states S_r of the W ranks (rank order).
        G: (W, ...) their log-decays G_r (<= 0).
        z_loc: optional (W, ..., Dk) local normaliser states.
    Returns:
        (S_in, z_in) of the same shapes, with S_in_0 = 0 and S_in_{r+1} = exp(G_r) S_in_r + S_r
        (z_in is None when z_loc is None). The state leaving the last rank -- the state of the
        whole sequence -- is exp(G_{W-1}) S_in_{W-1} + S_{W-1}.
    """
    W = S_loc.shape[0]
    a = torch.exp(G)
    S_in, z_in = [torch.zeros_like(S_loc[0])], [torch.zeros_like(z_loc[0])] if z_loc is not None else None
    for r in range(W - 1):
        S_in.append(a[r][..., None, None] * S_in[r] + S_loc[r])
        if z_loc is not None:
            z_in.append(a[r][..., None] * z_in[r] + z_loc[r])
    return torch.stack(S_in), (torch.stack(z_in) if z_loc is not None else None)


def prefix_states_backward(dS_in: Tensor, S_in: Tensor, G: Tensor,
                           dz_in: Tensor | None = None,
                           z_in: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """The reverse scan: gradients of the local states and log-decays from dL/dS_in of every rank.

    With D_r = dL/d(state leaving rank r): D_{W-1} = 0, D_{r-1} = dS_in_r + exp(G_r) D_r. Then
    dL/dS_r = D_r and dL/dG_r = exp(G_r) (<D_r, S_in_r> + <Dz_r, z_in_r>).

    Returns:
        (dS_loc, dG, dz_loc) shaped like S_in, G and z_in (dz_loc None without z).
    """
    W = S_in.shape[0]
    a = torch.exp(G)
    D = [None] * W
    D[W - 1] = torch.zeros_like(dS_in[0])
    Dz = [None] * W if dz_in is not None else None
    if Dz is not None:
        Dz[W - 1] = torch.zeros_like(dz_in[0])
    for r in range(W - 1, 0, -1):
        D[r - 1] = dS_in[r] + a[r][..., None, None] * D[r]
        if Dz is not None:
            Dz[r - 1] = dz_in[r] + a[r][..., None] * Dz[r]
    dS_loc = torch.stack(D)
    dG = a * (dS_loc * S_in).sum((-2, -1))
    dz_loc = None
    if Dz is not None:
        dz_loc = torch.stack(Dz)
        dG = dG + a * (dz_loc * z_in).sum(-1)
    return dS_loc, dG, dz_loc


def _pack(*parts: Tensor | None) -> Tensor:
    return torch.cat([p.reshape(-1) for p in parts if p is not None])


def _unpack(flat: Tensor, shapes: Sequence[torch.Size | None]) -> list[Tensor | None]:
    out, i = [], 0
    for s in shapes:
        if s is None:
            out.append(None)
            continue
        n = math.prod(s)
        out.append(flat[i:i + n].view(s))
        i += n
    return out


class _StateScan(torch.autograd.Function):
    """(S_r, z_r, G_r) of this rank -> (S_in_r, z_in_r): one all-gather forward, one backward."""

    @staticmethod
    def forward(ctx, S, z, G, group, comm):
        rank, world = _group_info(group)
        shapes = (S.shape, None if z is None else z.shape, G.shape)
        gathered = _all_gather(_pack(S, z, G), group, comm, "local states (S, z, G)")
        parts = [_unpack(buf, shapes) for buf in gathered]
        S_all = torch.stack([p[0] for p in parts])
        z_all = torch.stack([p[1] for p in parts]) if z is not None else None
        G_all = torch.stack([p[2] for p in parts])
        S_in, z_in = prefix_states(S_all, G_all, z_all)
        ctx.save_for_backward(S_in, G_all, z_in)
        ctx.group, ctx.comm, ctx.rank, ctx.has_z = group, comm, rank, z is not None
        S_r = S_in[rank].clone()
        z_r = z_in[rank].clone() if z is not None else None
        return S_r, z_r

    @staticmethod
    @once_differentiable("sequence_parallel_linear_attention", "On one device, linear_attention with "
                         "form='quadratic' or form='recurrent' has them.")
    def backward(ctx, dS_r, dz_r):
        S_in, G_all, z_in = ctx.saved_tensors
        rank = ctx.rank
        if dS_r is None:
            dS_r = torch.zeros_like(S_in[rank])
        if ctx.has_z and dz_r is None:
            dz_r = torch.zeros_like(z_in[rank])
        shapes = (dS_r.shape, dz_r.shape if ctx.has_z else None)
        gathered = _all_gather(_pack(dS_r, dz_r if ctx.has_z else None), ctx.group, ctx.comm,
                               "incoming-state gradients (dS_in, dz_in)")
        parts = [_unpack(buf, shapes) for buf in gathered]
        dS_in = torch.stack([p[0] for p in parts])
        dz_in = torch.stack([p[1] for p in parts]) if ctx.has_z else None
        dS_loc, dG, dz_loc = prefix_states_backward(dS_in, S_in, G_all, dz_in, z_in)
        return dS_loc[rank], (dz_loc[rank] if ctx.has_z else None), dG[rank], None, None


class _RingStateScan(torch.autograd.Function):
    """The same map as `_StateScan` by a chain of sends: rank r waits for S_in_r from rank r-1,
    sends exp(G_r) S_in_r + S_r to rank r+1; the backward passes D_r from rank r+1 to rank r."""

    @staticmethod
    def forward(ctx, S, z, G, group, comm):
        rank, world = _group_info(group)
        has_z = z is not None
        shapes = (S.shape, z.shape if has_z else None)
        buf = _pack(torch.zeros_like(S), torch.zeros_like(z) if has_z else None)
        if rank > 0:
            _send_recv(None, rank + 1, buf, rank - 1, group, comm, "incoming state (S_in, z_in)")
        S_in, z_in = (t.clone() if t is not None else None for t in _unpack(buf, shapes))
        if rank < world - 1:
            a = torch.exp(G)
            out = _pack(a[..., None, None] * S_in + S, (a[..., None] * z_in + z) if has_z else None)
            _send_recv(out, rank + 1, None, rank - 1, group, comm, "outgoing state (S_out, z_out)")
        ctx.save_for_backward(S_in, G, z_in)
        ctx.group, ctx.comm, ctx.rank, ctx.world, ctx.has_z = group, comm, rank, world, has_z
        return S_in, z_in

    @staticmethod
    @once_differentiable("sequence_parallel_linear_attention", "On one device, linear_attention with "
                         "form='quadratic' or form='recurrent' has them.")
    def backward(ctx, dS_in, dz_in):
        S_in, G, z_in = ctx.saved_tensors
        rank, world, has_z, group, comm = ctx.rank, ctx.world, ctx.has_z, ctx.group, ctx.comm
        dS_in = torch.zeros_like(S_in) if dS_in is None else dS_in
        if has_z and dz_in is None:
            dz_in = torch.zeros_like(z_in)
        shapes = (S_in.shape, z_in.shape if has_z else None)
        buf = _pack(torch.zeros_like(S_in), torch.zeros_like(z_in) if has_z else None)
        if rank < world - 1:  # D_r = dL/d(state leaving this rank), from rank r+1
            _send_recv(None, rank - 1, buf, rank + 1, group, comm, "outgoing-state gradient")
        D, Dz = _unpack(buf, shapes)
        a = torch.exp(G)
        dG = a * (D * S_in).sum((-2, -1)) + (a * (Dz * z_in).sum(-1) if has_z else 0)
        if rank > 0:
            prev = _pack(dS_in + a[..., None, None] * D, (dz_in + a[..., None] * Dz) if has_z else None)
            _send_recv(prev, rank - 1, None, rank + 1, group, comm, "incoming-state gradient")
        return D.clone(), (Dz.clone() if has_z else None), dG, None, None


# --------------------------------------------------------------------------------------
# sequence-parallel linear attention
# --------------------------------------------------------------------------------------

_SP = "sequence_parallel_linear_attention"


def _check_local_arguments(q: Tensor, k: Tensor, v: Tensor, log_decay: Tensor | None, *, normalize: bool,
                           eps: float, chunk_size: int, scan: str) -> float:
    """The checks one rank can make alone, in the order the errors are reported; returns eps.

    They run on every rank before the collectives, also on a rank that holds no tokens (which
    never reaches linear_attention's own checks).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        V.check_tensor(_SP, name, x, ndim=4)
    V.check_same(_SP, [("q", q), ("k", k), ("v", v)])
    B, H, T, Dk = q.shape
    if tuple(k.shape[:3]) != (B, H, T) or tuple(v.shape[:3]) != (B, H, T) or k.shape[-1] != Dk:
        raise ValueError(f"{_SP}: q {V.describe(q)}, k {V.describe(k)} and v {V.describe(v)} must share "
                         "(B, H, T), and q and k their feature size Dk")
    if log_decay is not None:
        V.check_tensor(_SP, "log_decay", log_decay)
        if tuple(log_decay.shape) not in ((H,), (B, H, T)):
            raise ValueError(f"{_SP}: `log_decay` has shape {tuple(log_decay.shape)}; expected (H,) = ({H},) "
                             f"or this rank's (B, H, T_r) = {(B, H, T)}")
        if log_decay.numel() and (not bool(torch.isfinite(log_decay).all()) or bool((log_decay > 0).any())):
            raise ValueError(f"{_SP}: `log_decay` must be finite and <= 0")
    V.check_choice(_SP, "scan", scan, ("all_gather", "ring"))
    eps = V.check_eps(_SP, eps)
    V.check_positive_int(_SP, "chunk_size", chunk_size)
    V.check_flag(_SP, "normalize", normalize)
    return eps


def _descriptor(q: Tensor, v: Tensor, log_decay: Tensor | None, *, normalize: bool, eps: float,
                chunk_size: int, scan: str) -> list[_Arg]:
    """What every rank must agree on before the states move (see `_check_same_on_every_rank`)."""
    decay_kind = _DECAY_KINDS[0 if log_decay is None else 1 if log_decay.dim() == 1 else 2]
    return [
        *_layout_args(q, v),
        _Arg("`normalize`={}", "`normalize`={}", bool(normalize)),
        _Arg("`log_decay` is {}", "{}", decay_kind, _DECAY_KINDS),
        _Arg("`eps`={!r}", "`eps`={!r}", float(eps)),
        _Arg("`chunk_size`={}", "`chunk_size`={}", int(chunk_size)),
        _Arg("`scan`={!r}", "`scan`={!r}", scan, ("all_gather", "ring")),
    ]


def sequence_parallel_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    normalize: bool = True,
    log_decay: Tensor | None = None,
    eps: float = DEFAULT_EPS,
    chunk_size: int = 64,
    backend: str = "auto",
    scan: str = "all_gather",
    group: dist.ProcessGroup | None = None,
    comm: CommLog | None = None,
) -> Tensor:
    """Causal linear attention over a sequence split across the ranks of a process group.

    Call it on every rank of `group` with that rank's contiguous slice of the sequence, in rank
    order (rank 0 holds the first tokens; `shard_sequence` cuts them). The result is this
    rank's slice of what `linear_attention(q, k, v, causal=True, ...)` returns on the whole
    sequence, and gradients flow to q, k, v and log_decay as they would there.

    Args:
        q, k: (B, H, T_r, Dk) *features* of this rank's tokens; v: (B, H, T_r, Dv). T_r may
            differ between ranks and may be 0.
        normalize, eps, chunk_size, backend: as in `linear_attention`.
        log_decay: None, (H,) per head (the same on every rank) or (B, H, T_r) for this rank's
            tokens, <= 0. A (H,) log-decay is a parameter shared by all ranks: its gradient on
            each rank covers that rank's tokens only, so all-reduce (sum) it across the group,
            as for any parameter replicated over a sequence-parallel group.
        scan: how the states cross the ranks: "all_gather" (default; one collective, then a
            local combination) or "ring" (a chain of sends, W-1 sequential steps; for comparison).
        group: the process group (default: the world).
        comm: an optional `CommLog` that records the bytes this rank sends.

    Communication with scan="all_gather": one all-gather of B*H*(Dk*Dv + Dk + 1) numbers per
    rank forward (of B*H*(Dk*Dv + Dk) in the backward); with scan="ring": one send of
    B*H*(Dk*Dv + Dk) numbers per rank and direction. Neither depends on T. Every rank must call the backward
    as well (it contains a collective): compute the loss on every rank and call backward on it.

    Raises:
        ValueError on every rank if the ranks disagree on B, H, Dk, Dv, the dtype or device type
        of q, `normalize`, the kind of `log_decay` (None, per head, per token), `eps`,
        `chunk_size` or `scan`, naming the argument and each rank's value. The check is one
        all-gather of a few numbers before the states move (not recorded in `comm`).
    """
    opts = dict(normalize=normalize, chunk_size=chunk_size, scan=scan)
    eps = _check_local_arguments(q, k, v, log_decay, eps=eps, **opts)
    _group_info(group)
    _check_same_on_every_rank(_SP, _descriptor(q, v, log_decay, eps=eps, **opts), group, q)

    S, z, G = local_state(k, v, log_decay, normalize=normalize)
    S_in, z_in = (_StateScan if scan == "all_gather" else _RingStateScan).apply(S, z, G, group, comm)
    if q.shape[2] == 0:  # nothing to compute; keep S_in in the graph so this rank joins the backward
        return (q.to(S_in.dtype) @ S_in).to(v.dtype)
    return linear_attention(
        q, k, v, causal=True, normalize=normalize, log_decay=log_decay, eps=eps, chunk_size=chunk_size,
        backend=backend, initial_state=LinearAttentionState(S_in, z_in),
    )


# --------------------------------------------------------------------------------------
# communication volume, computed
# --------------------------------------------------------------------------------------


def linear_sp_bytes_per_rank(world_size: int, *, batch: int, heads: int, dk: int, dv: int, normalize: bool = True,
                             backward: bool = False, bytes_per_element: int = 4, scan: str = "all_gather",
                             rank: int | None = None) -> int:
    """Bytes one rank sends in `sequence_parallel_linear_attention`. Independent of T.

    scan="all_gather" (every rank alike): forward (W-1) * B*H*(Dk*Dv + Dk + 1)
    numbers (S, z and the log-decay G); the backward adds (W-1) * B*H*(Dk*Dv + Dk).
    scan="ring": one state B*H*(Dk*Dv + Dk) forward (not the last rank) and one backward (not
    rank 0); `rank` picks one rank (default: the largest over ranks).
    Numbers are float32 (4 bytes) for float32/16 inputs, float64 for float64 inputs.
    """
    zk = dk if normalize else 0
    state = batch * heads * (dk * dv + zk)
    if scan == "ring":
        def one(r: int) -> int:
            return ((r < world_size - 1) + (backward and r > 0)) * state * bytes_per_element

        return one(rank) if rank is not None else max(one(r) for r in range(world_size))
    if scan != "all_gather":
        raise ValueError(f"linear_sp_bytes_per_rank: `scan` must be 'all_gather' or 'ring', got {scan!r}")
    fwd = state + batch * heads
    bwd = state if backward else 0
    return (world_size - 1) * (fwd + bwd) * bytes_per_element
