"""Sequence parallelism for causal linear attention on `torch.distributed`.

The sequence (length T) is cut into W contiguous slices, one per rank of a process group.
Softmax attention would need every earlier key and value on every rank (ring attention passes
all of them around: O(T d) bytes per rank). Causal linear attention needs only the *state*
entering the slice, a Dk x Dv matrix (plus the Dk normaliser and one decay number) per head,
whatever T is. With the per-token log-decay g (zero without decay):

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

Every collective goes through `_all_gather` / `_send_recv`, which (a) count the bytes this rank
sends into an optional `CommLog` and (b) turn a failure or time-out of a peer into a
`PeerFailureError` that says what happened. Before its first collective, each public function
all-gathers a descriptor of its arguments (shapes, dtype, device type, options: about ten
numbers), so that arguments that differ between ranks raise the same clear `ValueError` on
every rank instead of a mismatched collective that aborts, hangs or mixes up buffers.
`launch` starts W local processes on the loopback interface (gloo) for tests and notebooks;
`python -m linattn_lib.distributed` runs a check under `torchrun` (gloo on CPU, nccl on GPUs)
or launches one itself.
"""
from __future__ import annotations

import argparse
import io
import math
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _validate as V
from ..core.linear import linear_attention
from ..core.softmax import softmax_attention
from ..core.state import (
    DEFAULT_EPS, LinearAttentionState, compute_dtype, expand_log_decay, sum_after,
)

LOOPBACK = "127.0.0.1"  # the only address `launch` ever uses

__all__ = [
    "CommLog",
    "CommRecord",
    "DistributedRunError",
    "PeerFailureError",
    "check_rank",
    "compare_with_reference",
    "draw_rank_scan",
    "failing_rank",
    "free_port",
    "launch",
    "linear_sp_bytes_per_rank",
    "local_state",
    "loopback_interface",
    "make_inputs",
    "measure_rank",
    "os_bytes_written",
    "prefix_states",
    "prefix_states_backward",
    "ring_attention",
    "ring_attention_bytes_per_rank",
    "sequence_parallel_linear_attention",
    "shard_sequence",
    "single_process_reference",
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
# communication: counting bytes, clear errors
# --------------------------------------------------------------------------------------


def os_bytes_written() -> Optional[int]:
    """Bytes this process has written through write-like system calls (Linux /proc/self/io).

    gloo's TCP transport sends with writev(2), so the change of this counter around a gloo
    collective is the number of bytes the process actually handed to its sockets (payload plus
    gloo's small message headers). None where /proc is not available. It sees nothing of NCCL,
    whose transfers do not go through the CPU's sockets.
    """
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


@dataclass
class CommRecord:
    """One communication call as seen by one rank.

    op: "all_gather" or "send_recv"; what: what was communicated.
    payload: bytes of the tensor this rank contributes (all_gather) or sends (send_recv).
    sent: bytes this rank sends. In an all-gather that is (W - 1) * payload, whether it runs as
        a ring (each rank forwards every block it receives, once) or as direct sends of the
        block to the W - 1 other ranks. A send is its payload.
    received: bytes this rank receives.
    os_sent: bytes the operating system saw this process write during the call (gloo on Linux;
        None otherwise): the measured counterpart of `sent`, plus transport headers.
    seconds: wall time of the call.
    """

    op: str
    what: str
    payload: int
    sent: int
    received: int
    os_sent: Optional[int]
    seconds: float


@dataclass
class CommLog:
    """The communication of one rank, recorded by the functions of this module (pass comm=...)."""

    records: list = field(default_factory=list)

    def add(self, record: CommRecord) -> None:
        self.records.append(record)

    def clear(self) -> None:
        self.records.clear()

    @property
    def sent(self) -> int:
        """Bytes sent, counted from the tensors handed to the collectives."""
        return sum(r.sent for r in self.records)

    @property
    def received(self) -> int:
        return sum(r.received for r in self.records)

    @property
    def os_sent(self) -> Optional[int]:
        """Bytes the OS saw written during the calls (None if any call could not measure it)."""
        vals = [r.os_sent for r in self.records]
        return None if any(v is None for v in vals) else sum(vals)

    @property
    def calls(self) -> int:
        return len(self.records)

    def summary(self) -> dict:
        return {"calls": self.calls, "sent": self.sent, "received": self.received, "os_sent": self.os_sent}


class PeerFailureError(RuntimeError):
    """A collective failed on this rank because another rank failed, exited or stalled."""


def _group_info(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group first "
            "(or start the function with linattn_lib.distributed.launch, or under torchrun)"
        )
    return dist.get_rank(group), dist.get_world_size(group)


def _measures_os_bytes(group) -> bool:
    return dist.get_backend(group) == "gloo"


def _peer_error(what: str, op: str, rank: int, world: int, err: BaseException) -> PeerFailureError:
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return PeerFailureError(
        f"rank {rank} of {world}: {op} of {what} failed -- another rank of the process group "
        f"probably failed, exited or stalled past the collective timeout. Underlying error: {first}"
    )


def _all_gather(x: Tensor, group, comm: Optional[CommLog], what: str) -> list[Tensor]:
    rank, world = _group_info(group)
    x = x.contiguous()
    out = [torch.empty_like(x) for _ in range(world)]
    w0 = os_bytes_written() if _measures_os_bytes(group) else None
    t0 = time.perf_counter()
    try:
        dist.all_gather(out, x, group=group)
    except RuntimeError as e:  # gloo: "Connection closed by peer", "Timed out waiting ..."
        raise _peer_error(what, "all_gather", rank, world, e) from e
    seconds = time.perf_counter() - t0
    if comm is not None:
        w1 = os_bytes_written() if w0 is not None else None
        n = x.numel() * x.element_size()
        comm.add(CommRecord("all_gather", what, n, (world - 1) * n, (world - 1) * n,
                            None if w1 is None else w1 - w0, seconds))
    return out


def _send_recv(send: Optional[Tensor], dst: int, recv: Optional[Tensor], src: int, group,
               comm: Optional[CommLog], what: str) -> None:
    """Send `send` to rank dst while receiving `recv` from rank src (either may be None)."""
    rank, world = _group_info(group)
    ops = []
    if send is not None:
        ops.append(dist.P2POp(dist.isend, send.contiguous(), dist.get_global_rank(group, dst) if group else dst, group))
    if recv is not None:
        ops.append(dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, src) if group else src, group))
    if not ops:
        return
    w0 = os_bytes_written() if _measures_os_bytes(group) else None
    t0 = time.perf_counter()
    try:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    except RuntimeError as e:
        raise _peer_error(what, "send/recv", rank, world, e) from e
    seconds = time.perf_counter() - t0
    if comm is not None:
        w1 = os_bytes_written() if w0 is not None else None
        ns = 0 if send is None else send.numel() * send.element_size()
        nr = 0 if recv is None else recv.numel() * recv.element_size()
        comm.add(CommRecord("send_recv", what, ns, ns, nr, None if w1 is None else w1 - w0, seconds))


# --------------------------------------------------------------------------------------
# the same arguments on every rank: one small all-gather before the real collectives
# --------------------------------------------------------------------------------------

# Categorical arguments travel as their index in these tuples (the same on every rank of one
# installation). Sorted by name, so that the order does not depend on how torch lists them.
_FLOAT_DTYPES = tuple(sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype) and d.is_floating_point},
                             key=str))
_DEVICE_TYPES = ("cpu", "cuda", "mps", "xpu", "hpu", "meta")
_DECAY_KINDS = ("None", "per-head (H,)", "per-token (B, H, T_r)")


@dataclass(frozen=True)
class _Arg:
    """One entry of the descriptor: its value, and how to say it -- `first` for the first value
    in the error message, `rest` for the others, each a format string with one field. `choices`
    encodes a categorical value as its index (-1: none of them)."""

    first: str
    rest: str
    value: Any
    choices: Optional[tuple] = None

    def code(self) -> float:
        if self.choices is not None:
            return float(self.choices.index(self.value)) if self.value in self.choices else -1.0
        return float(self.value)

    def show(self, code: float, template: str) -> str:
        if self.choices is not None:
            value = self.choices[int(code)] if code >= 0 else "(unlisted)"
        elif isinstance(self.value, bool):
            value = bool(code)
        elif isinstance(self.value, int):
            value = int(code)
        else:
            value = code
        return template.format(value)


def _rank_list(ranks: Sequence[int]) -> str:
    """"rank 3", "ranks 0, 2", "ranks 0-5, 7": consecutive ranks as ranges."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def _descriptor_device(group, x: Tensor) -> torch.device:
    backend = str(dist.get_backend(group))
    if "gloo" in backend or backend == "mpi":  # CPU collectives ("cpu:gloo,cuda:nccl" too)
        return torch.device("cpu")
    if "nccl" in backend:  # the GPU of this rank, whatever device the caller's tensors are on
        return torch.device("cuda", torch.cuda.current_device())
    return x.device


def _check_same_on_every_rank(fn: str, args: Sequence[_Arg], group, x: Tensor) -> None:
    """Raise on every rank if any argument differs between the ranks of `group`.

    The collectives that follow exchange buffers whose sizes and meaning follow from these
    arguments; a rank that disagrees would abort the process (gloo: "Received data size
    doesn't match expected size"), hang, or -- when the byte counts happen to agree -- return
    a finite, wrong result. One all-gather of len(args) float64 numbers (exact for these ints
    and floats) lets every rank see every rank's values, so all of them raise the same error.
    It is not recorded in a `CommLog`: it is a check, not part of the algorithm's traffic.
    """
    rank, world = _group_info(group)
    if world == 1:
        return
    mine = torch.tensor([a.code() for a in args], dtype=torch.float64, device=_descriptor_device(group, x))
    table = torch.stack(_all_gather(mine, group, None, "argument descriptor (shapes, dtype, options)")).cpu()
    problems = []
    for i, a in enumerate(args):
        column = table[:, i].tolist()
        values = list(dict.fromkeys(column))  # in order of first appearance
        if len(values) == 1:
            continue
        parts = [a.show(v, a.first if j == 0 else a.rest) + " on "
                 + _rank_list([r for r, c in enumerate(column) if c == v]) for j, v in enumerate(values)]
        problems.append(parts[0] + " but " + " and ".join(parts[1:]))
    if problems:
        raise ValueError(f"{fn}: {'; '.join(problems)}; expected the same on every rank of the process group "
                         f"(this is rank {rank} of {world})")


# --------------------------------------------------------------------------------------
# the scan over ranks: pure functions (no communication), shared by the autograd Function
# --------------------------------------------------------------------------------------


def local_state(k: Tensor, v: Tensor, log_decay: Optional[Tensor] = None, *, normalize: bool = True):
    """The state one slice builds from zero, and the log-decay across it (differentiable).

    Args:
        k: (B, H, T, Dk) key features of the slice; v: (B, H, T, Dv).
        log_decay: None, (H,) or (B, H, T) log-decay of the slice's tokens (<= 0).
    Returns:
        (S, z, G): S = sum_j exp(c_T - c_j) k_j v_j^T of shape (B, H, Dk, Dv) with c the
        cumulative log-decay; z the same sum over k_j (B, H, Dk), or None when normalize=False;
        G = c_T (B, H), the log of the factor by which the slice decays an incoming state.
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


def prefix_states(S_loc: Tensor, G: Tensor, z_loc: Optional[Tensor] = None):
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
                           dz_in: Optional[Tensor] = None, z_in: Optional[Tensor] = None):
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


def _pack(*parts: Optional[Tensor]) -> Tensor:
    return torch.cat([p.reshape(-1) for p in parts if p is not None])


def _unpack(flat: Tensor, shapes: Sequence[Optional[torch.Size]]) -> list[Optional[Tensor]]:
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
    @torch.autograd.function.once_differentiable
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
    @torch.autograd.function.once_differentiable
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


def _layout_args(q: Tensor, v: Tensor) -> list:
    """The descriptor entries every rank must share for q, k, v: B, H, Dk, Dv, dtype, device type."""
    B, H, _, Dk = q.shape
    return [
        _Arg("`q` has B={}", "B={}", B), _Arg("`q` has H={}", "H={}", H),
        _Arg("`q` has Dk={}", "Dk={}", Dk), _Arg("`v` has Dv={}", "Dv={}", v.shape[-1]),
        _Arg("`q` has dtype {}", "{}", q.dtype, _FLOAT_DTYPES),
        _Arg("`q` has device type {}", "{}", q.device.type, _DEVICE_TYPES),
    ]


def sequence_parallel_linear_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    normalize: bool = True,
    log_decay: Optional[Tensor] = None,
    eps: float = DEFAULT_EPS,
    chunk_size: int = 64,
    backend: str = "auto",
    scan: str = "all_gather",
    group=None,
    comm: Optional[CommLog] = None,
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
    fn = "sequence_parallel_linear_attention"
    for name, x in (("q", q), ("k", k), ("v", v)):
        V.check_tensor(fn, name, x, ndim=4)
    V.check_same(fn, [("q", q), ("k", k), ("v", v)])
    B, H, T, Dk = q.shape
    if tuple(k.shape[:3]) != (B, H, T) or tuple(v.shape[:3]) != (B, H, T) or k.shape[-1] != Dk:
        raise ValueError(f"{fn}: q {V.describe(q)}, k {V.describe(k)} and v {V.describe(v)} must share "
                         "(B, H, T), and q and k their feature size Dk")
    if log_decay is not None:
        V.check_tensor(fn, "log_decay", log_decay)
        if tuple(log_decay.shape) not in ((H,), (B, H, T)):
            raise ValueError(f"{fn}: `log_decay` has shape {tuple(log_decay.shape)}; expected (H,) = ({H},) "
                             f"or this rank's (B, H, T_r) = {(B, H, T)}")
        if log_decay.numel() and (not bool(torch.isfinite(log_decay).all()) or bool((log_decay > 0).any())):
            raise ValueError(f"{fn}: `log_decay` must be finite and <= 0")
    V.check_choice(fn, "scan", scan, ("all_gather", "ring"))
    # checked on every rank before the collectives, also on a rank that holds no tokens (which
    # never reaches linear_attention's own checks)
    eps = V.check_eps(fn, eps)
    V.check_positive_int(fn, "chunk_size", chunk_size)
    V.check_flag(fn, "normalize", normalize)
    _group_info(group)
    Dv = v.shape[-1]
    decay_kind = _DECAY_KINDS[0 if log_decay is None else 1 if log_decay.dim() == 1 else 2]
    _check_same_on_every_rank(fn, [
        *_layout_args(q, v),
        _Arg("`normalize`={}", "`normalize`={}", bool(normalize)),
        _Arg("`log_decay` is {}", "{}", decay_kind, _DECAY_KINDS),
        _Arg("`eps`={!r}", "`eps`={!r}", float(eps)),
        _Arg("`chunk_size`={}", "`chunk_size`={}", int(chunk_size)),
        _Arg("`scan`={!r}", "`scan`={!r}", scan, ("all_gather", "ring")),
    ], group, q)

    S, z, G = local_state(k, v, log_decay, normalize=normalize)
    S_in, z_in = (_StateScan if scan == "all_gather" else _RingStateScan).apply(S, z, G, group, comm)
    if T == 0:  # nothing to compute, but keep S_in in the graph so this rank joins the backward
        return (q.to(S_in.dtype) @ S_in).to(v.dtype)
    return linear_attention(
        q, k, v, causal=True, normalize=normalize, log_decay=log_decay, eps=eps, chunk_size=chunk_size,
        backend=backend, initial_state=LinearAttentionState(S_in, z_in),
    )


# --------------------------------------------------------------------------------------
# the softmax baseline: ring attention (forward only)
# --------------------------------------------------------------------------------------


def ring_attention(q: Tensor, k: Tensor, v: Tensor, *, seq_len: int, causal: bool = True,
                   scale: Optional[float] = None, group=None, comm: Optional[CommLog] = None) -> Tensor:
    """Exact softmax attention over a sequence split across ranks, keys and values passed in a ring.

    Each rank keeps its queries and, for W steps, attends to the key/value block it holds,
    merging the partial results with the online-softmax rule (running max m, sum l); between
    steps every rank sends its block to rank r+1 and receives one from rank r-1, so each block
    visits every rank (Liu et al. 2023). Sends are posted before the block is used, so the
    transfer of the next block overlaps the current one's compute.

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
    fn = "ring_attention"
    for name, x in (("q", q), ("k", k), ("v", v)):
        V.check_tensor(fn, name, x, ndim=4)
    rank, world = _group_info(group)
    bounds = split_sequence(seq_len, world)
    V.check_same(fn, [("q", q), ("k", k), ("v", v)])
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    if tuple(k.shape) != (B, H, T, Dk) or tuple(v.shape[:3]) != (B, H, T):
        raise ValueError(f"{fn}: this rank's k {tuple(k.shape)} and v {tuple(v.shape)} must match q {tuple(q.shape)} "
                         "in (B, H, T_r), and k must match q's Dk")
    V.check_flag(fn, "causal", causal)
    scale = 1.0 / math.sqrt(Dk) if scale is None else V.check_number(fn, "scale", scale)
    _check_same_on_every_rank(fn, [
        *_layout_args(q, v),
        _Arg("`causal`={}", "`causal`={}", bool(causal)),
        _Arg("`seq_len`={}", "`seq_len`={}", int(seq_len)),
        _Arg("`scale`={!r}", "`scale`={!r}", float(scale)),
    ], group, q)
    if T != bounds[rank][1] - bounds[rank][0]:
        raise ValueError(f"{fn}: rank {rank} holds T_r={T} tokens, but split_sequence({seq_len}, {world}) "
                         f"gives it {bounds[rank][1] - bounds[rank][0]}")
    dtype = compute_dtype(q)
    with torch.no_grad():
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
                kb, vb = block[..., :Dk].to(dtype), block[..., Dk:].to(dtype)
                s = qs @ kb.transpose(-1, -2)
                if causal and src == rank:
                    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
                m_new = torch.maximum(m, s.amax(-1))
                p = torch.exp(s - m_new.unsqueeze(-1))
                corr = torch.exp(m - m_new)  # exp(-inf) = 0 on the first block
                l = l * corr + p.sum(-1)
                acc = acc * corr.unsqueeze(-1) + p @ vb
                m = m_new
            if incoming is not None:
                block = incoming
        out = acc / l.unsqueeze(-1) if T else acc
    return out.to(v.dtype)


# --------------------------------------------------------------------------------------
# communication volumes, computed
# --------------------------------------------------------------------------------------


def ring_attention_bytes_per_rank(seq_len: int, world_size: int, *, batch: int, heads: int, dk: int, dv: int,
                                  bytes_per_element: int = 4, rank: Optional[int] = None) -> int:
    """Bytes one rank sends in `ring_attention`'s forward: W-1 key/value blocks.

    Rank r forwards every block except the one that reaches it last (from rank r+1); with T
    divisible by W this is (W-1) * (T/W) * B * H * (Dk + Dv) * bytes for every rank. `rank`
    picks one rank for uneven splits (default: the largest over ranks).
    """
    bounds = split_sequence(seq_len, world_size)
    per_token = batch * heads * (dk + dv) * bytes_per_element

    def one(r):
        if world_size == 1:
            return 0
        return sum(b - a for i, (a, b) in enumerate(bounds) if i != (r + 1) % world_size) * per_token

    return one(rank) if rank is not None else max(one(r) for r in range(world_size))


def linear_sp_bytes_per_rank(world_size: int, *, batch: int, heads: int, dk: int, dv: int, normalize: bool = True,
                             backward: bool = False, bytes_per_element: int = 4, scan: str = "all_gather",
                             rank: Optional[int] = None) -> int:
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
        def one(r):
            return ((r < world_size - 1) + (backward and r > 0)) * state * bytes_per_element

        return one(rank) if rank is not None else max(one(r) for r in range(world_size))
    if scan != "all_gather":
        raise ValueError(f"linear_sp_bytes_per_rank: `scan` must be 'all_gather' or 'ring', got {scan!r}")
    fwd = state + batch * heads
    bwd = state if backward else 0
    return (world_size - 1) * (fwd + bwd) * bytes_per_element


# --------------------------------------------------------------------------------------
# launching local process groups
# --------------------------------------------------------------------------------------


class DistributedRunError(RuntimeError):
    """Raised by `launch` when a rank failed; `.errors` maps rank -> one-line reason,
    `.exitcodes` lists the exit code of every rank, `.tracebacks` maps rank -> traceback."""

    def __init__(self, message: str, errors: dict, exitcodes: list, tracebacks: dict):
        super().__init__(message)
        self.errors, self.exitcodes, self.tracebacks = errors, exitcodes, tracebacks


def free_port() -> int:
    """A TCP port that is free on the loopback interface right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def loopback_interface() -> str:
    """Name of the loopback network interface ("lo" on Linux, "lo0" on macOS)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        names = []
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return next((n for n in names if n.startswith("lo")), "lo")


def _start_method() -> str:
    import multiprocessing as mp

    # forkserver: one interpreter imports torch once, every rank is a fork of it (fast and safe:
    # that interpreter never ran a torch op, so no thread pool is copied half-initialised).
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def _exit_with_launcher(launcher_pid: int) -> None:
    """Daemon thread of a rank: exit if the launching process is gone (killed, not interrupted),
    instead of waiting for a collective timeout with nobody left to report to."""
    import threading

    def watch():
        while True:
            time.sleep(1.0)
            try:
                os.kill(launcher_pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:  # the pid was reused by another user's process
                os._exit(1)

    threading.Thread(target=watch, name="linattn-launcher-watch", daemon=True).start()


def _worker(fn, rank: int, world_size: int, port: int, backend: str, timeout: float, args: tuple, conn,
            launcher_pid: Optional[int] = None) -> None:
    if launcher_pid is not None:
        _exit_with_launcher(launcher_pid)
    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    if backend == "gloo":
        os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()  # never any address but loopback
    torch.set_num_threads(1)  # W processes share the machine's cores
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://{LOOPBACK}:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(result, buf)
        conn.send(("ok", buf.getvalue()))
    except BaseException as e:  # report, then exit at once: the peers see the closed sockets
        try:
            conn.send(("error", f"{type(e).__name__}: {e}".splitlines()[0], traceback.format_exc(), time.time()))
            conn.close()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
    try:
        dist.destroy_process_group()
    finally:
        conn.close()


def _exit_reason(code, terminated: bool, grace: float) -> str:
    if terminated:
        return (f"terminated by the launcher: still running {grace:g} s after the first failure "
                f"(stalled or busy; exit code {code})")
    return f"exited with code {code} without reporting an error"


def launch(fn: Callable[..., Any], world_size: int, *args, backend: str = "gloo", timeout: float = 60.0,
           grace: Optional[float] = None, start_method: Optional[str] = None) -> list:
    """Run fn(rank, world_size, *args) in `world_size` local processes joined in a process group.

    The processes rendezvous on 127.0.0.1 at a free port (gloo is bound to the loopback
    interface: nothing leaves the machine), with `timeout` seconds for every collective, and use
    one CPU thread each. `fn` must be importable (defined in a module, not in a notebook or
    `__main__`) and its return value picklable by `torch.save`.

    Returns:
        the list of return values, by rank.
    Raises:
        DistributedRunError if any rank fails. A failing rank reports its error and exits at
        once; its peers then fail in their next collective (connection closed, or the
        collective timeout if the failing rank hangs instead) with a `PeerFailureError`. Ranks
        still alive `grace` seconds after the first failure (default 5) are terminated: the
        group is broken by then, and a rank that has not noticed is stalled or busy. The
        error lists every rank's outcome, the first failure first. If the launcher itself is
        interrupted (e.g. Ctrl-C in a notebook), it terminates the ranks before re-raising.
    """
    import multiprocessing as mp
    from multiprocessing.connection import wait

    V.check_positive_int("launch", "world_size", world_size)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"launch: `backend` must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"launch: backend='nccl' needs one GPU per rank: {world_size} ranks, "
                         f"{torch.cuda.device_count()} GPUs")
    method = start_method or _start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":
        # Preloading this module when it is also __main__ (python -m linattn_lib.distributed)
        # would make every rank's runpy warn that it was imported before being run.
        main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        preload = ["torch"] + ([] if getattr(main_spec, "name", None) == __name__ else [__name__])
        ctx.set_forkserver_preload(preload)
    grace = 5.0 if grace is None else float(grace)
    port = free_port()
    procs, conns = [], []
    for rank in range(world_size):
        recv_end, send_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker, name=f"linattn-rank{rank}",
                        args=(fn, rank, world_size, port, backend, float(timeout), args, send_end, os.getpid()))
        p.start()
        send_end.close()
        procs.append(p)
        conns.append(recv_end)

    results: dict = {}
    errors: dict = {}
    tracebacks: dict = {}
    when: dict = {}  # rank -> time of its failure (the failing process's clock, or the launcher's)
    open_conns = dict(enumerate(conns))
    first_failure = None
    terminated = set()
    finished = False
    try:
        while open_conns or any(p.is_alive() for p in procs):
            ready = wait(list(open_conns.values()) + [p.sentinel for p in procs if p.is_alive()], timeout=0.1)
            for rank, c in list(open_conns.items()):
                if c in ready:
                    try:
                        msg = c.recv()
                    except (EOFError, OSError):
                        del open_conns[rank]
                        continue
                    if msg[0] == "ok":
                        results[rank] = torch.load(io.BytesIO(msg[1]), weights_only=False)
                    else:
                        errors[rank], tracebacks[rank], when[rank] = msg[1], msg[2], msg[3]
            for rank, p in enumerate(procs):
                if not p.is_alive() and p.exitcode not in (0, None) and rank not in errors and rank not in open_conns:
                    errors[rank] = _exit_reason(p.exitcode, rank in terminated, grace)
                    when[rank] = time.time()
            if errors and first_failure is None:
                first_failure = time.monotonic()
            if first_failure is not None and time.monotonic() - first_failure > grace:
                for rank, p in enumerate(procs):
                    if p.is_alive():
                        terminated.add(rank)
                        p.terminate()
                first_failure = float("inf")  # terminate once
        finished = True
    finally:
        for p in procs:
            if not finished and p.is_alive():  # interrupted: do not leave ranks behind
                p.terminate()
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        for c in conns:
            c.close()
    exitcodes = [p.exitcode for p in procs]
    for rank, code in enumerate(exitcodes):
        if code != 0 and rank not in errors:
            errors[rank] = _exit_reason(code, rank in terminated, grace)
            when[rank] = time.time()
    if errors:
        order = sorted(errors, key=lambda r: (when[r], r))  # the first failure first
        lines = [f"{len(errors)} of {world_size} ranks failed (first: rank {order[0]}):"]
        lines += [f"  rank {r}: {errors[r]}" for r in order]
        if order[0] in tracebacks:
            lines += [f"traceback of rank {order[0]}:", tracebacks[order[0]].rstrip()]
        raise DistributedRunError("\n".join(lines), errors, exitcodes, tracebacks)
    missing = [r for r in range(world_size) if r not in results]
    if missing:
        raise DistributedRunError(f"ranks {missing} exited without a result", {}, exitcodes, {})
    return [results[r] for r in range(world_size)]


# --------------------------------------------------------------------------------------
# rank functions for tests, the book and the CLI (importable, so that `launch` can start them)
# --------------------------------------------------------------------------------------


def make_inputs(seq_len: int, *, batch: int = 1, heads: int = 2, dk: int = 16, dv: int = 16, decay: Optional[str] = "token",
                dtype: torch.dtype = torch.float32, seed: int = 0, device="cpu") -> dict:
    """Deterministic full-sequence inputs (the same on every rank): positive features q, k
    (elu+1 of Gaussians), v, the weights w of the loss sum(o * w), and a log-decay that is None,
    per head ("head", shape (H,)) or per token ("token", (B, H, T))."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = torch.nn.functional.elu(randn(batch, heads, seq_len, dk)) + 1
    k = torch.nn.functional.elu(randn(batch, heads, seq_len, dk)) + 1
    v = randn(batch, heads, seq_len, dv)
    w = randn(batch, heads, seq_len, dv)
    g = None
    if decay == "head":
        g = -torch.rand(heads, generator=gen, dtype=torch.float64) * 0.2
    elif decay == "token":
        g = torch.nn.functional.logsigmoid(randn(batch, heads, seq_len) + 3.0)
    elif decay is not None:
        raise ValueError(f"make_inputs: `decay` must be None, 'head' or 'token', got {decay!r}")
    out = {"q": q, "k": k, "v": v, "w": w, "log_decay": g}
    return {n: (x.to(dtype=dtype, device=device) if x is not None else None) for n, x in out.items()}


def _sp_forward_backward(inp: dict, rank: int, world: int, *, normalize: bool, group=None, comm=None,
                         backend: str = "auto", chunk_size: int = 64, scan: str = "all_gather") -> dict:
    """This rank's output and gradients of sum(o * w) under sequence parallelism."""
    local = {n: (shard_sequence(x, rank, world) if x is not None and (n != "log_decay" or x.dim() == 3) else x)
             for n, x in inp.items()}
    leaves = {n: local[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v")}
    g = local["log_decay"]
    if g is not None:
        g = g.detach().clone().requires_grad_(True)
    o = sequence_parallel_linear_attention(leaves["q"], leaves["k"], leaves["v"], normalize=normalize, log_decay=g,
                                           group=group, comm=comm, backend=backend, chunk_size=chunk_size,
                                           scan=scan)
    (o * local["w"]).sum().backward()
    out = {"o": o.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}
    if g is not None:
        dg = g.grad if g.grad is not None else torch.zeros_like(g)
        if g.dim() == 1:  # a parameter shared by the ranks: sum its gradient over the group
            dist.all_reduce(dg, group=group)
        out["dlog_decay"] = dg
    return out


def single_process_reference(inp: dict, *, normalize: bool, chunk_size: int = 64, backend: str = "auto") -> dict:
    """Output and gradients of sum(o * w) from `linear_attention` on the whole sequence."""
    leaves = {n: inp[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v")}
    g = inp["log_decay"]
    if g is not None:
        g = g.detach().clone().requires_grad_(True)
    o = linear_attention(leaves["q"], leaves["k"], leaves["v"], causal=True, normalize=normalize, log_decay=g,
                         chunk_size=chunk_size, backend=backend)
    (o * inp["w"]).sum().backward()
    out = {"o": o.detach(), **{f"d{n}": t.grad for n, t in leaves.items()}}
    if g is not None:
        out["dlog_decay"] = g.grad
    return out


def check_rank(rank: int, world: int, cases: Sequence[dict]) -> list[dict]:
    """Rank function: run every case on this rank's slice and return what it computed.

    A case holds keyword arguments of `make_inputs` plus `normalize` (default True) and `kind`:
    "linear" (default: output and gradients of sum(o * w) under sequence-parallel linear
    attention, all-gather scan), "linear_ring" (the same with the chain of sends) or "ring"
    (the output of causal `ring_attention`). Each result also carries the
    communication this rank recorded (`CommLog.summary()`)."""
    results = []
    for case in cases:
        case = dict(case)
        normalize = case.pop("normalize", True)
        kind = case.pop("kind", "linear")
        comm = CommLog()
        inp = make_inputs(**case)
        if kind == "ring":
            local = {n: shard_sequence(inp[n], rank, world) for n in ("q", "k", "v")}
            res = {"o": ring_attention(local["q"], local["k"], local["v"], seq_len=case["seq_len"], comm=comm)}
        else:
            scan = "ring" if kind == "linear_ring" else "all_gather"
            res = _sp_forward_backward(inp, rank, world, normalize=normalize, comm=comm, scan=scan)
        res["comm"] = comm.summary()
        results.append(res)
    return results


def compare_with_reference(results_by_rank: Sequence[list], cases: Sequence[dict]) -> list[dict]:
    """Concatenate the ranks' slices from `check_rank` and compare them with the single-process
    result (`linear_attention`, or `softmax_attention` for ring cases): max |difference| /
    max |reference| of the output and of every gradient, per case. A per-head (H,) log-decay is
    a parameter shared by the ranks: every rank must hold its full gradient (summed over the
    group), so that error is the largest over the ranks."""

    report = []
    world = len(results_by_rank)
    for i, case in enumerate(cases):
        case = dict(case)
        normalize = case.pop("normalize", True)
        kind = case.pop("kind", "linear")
        inp = make_inputs(**case)
        if kind == "ring":
            ref = {"o": softmax_attention(inp["q"], inp["k"], inp["v"], causal=True)}
        else:
            ref = single_process_reference(inp, normalize=normalize)
        errs = {}
        for name, r in ref.items():
            parts = [results_by_rank[rank][i][name] for rank in range(world)]
            got = parts if (name == "dlog_decay" and r.dim() == 1) else [torch.cat(parts, dim=2)]
            errs[name] = max(float((g.double() - r.double()).abs().max() / r.double().abs().max().clamp_min(1e-30))
                             for g in got)
        report.append(errs)
    return report


def measure_rank(rank: int, world: int, seq_lens: Sequence[int], dims: dict, repeats: int = 3,
                 methods: Sequence[str] = ("linear", "linear_ring", "ring")) -> list[dict]:
    """Rank function for the book: for each T and method, the bytes this rank sends (counted,
    and measured by the OS) and the median wall time over `repeats` runs after one warm-up.

    Methods: "linear" (sequence-parallel linear attention with the all-gather scan, forward and
    backward), "linear_ring" (the same with the chain of sends), "ring" (ring attention,
    forward only). `dims` holds keyword arguments of `make_inputs` (batch, heads, dk, dv, ...).
    """
    out = []
    for T in seq_lens:
        inp = make_inputs(T, **{"decay": "token", **dims})
        row = {"T": T}
        for name in methods:
            times, log = [], CommLog()
            for rep in range(repeats + 1):
                comm = CommLog()
                dist.barrier()
                t0 = time.perf_counter()
                if name == "ring":
                    local = {n: shard_sequence(inp[n], rank, world) for n in ("q", "k", "v")}
                    ring_attention(local["q"], local["k"], local["v"], seq_len=T, comm=comm)
                else:
                    _sp_forward_backward(inp, rank, world, normalize=True, comm=comm,
                                         scan="ring" if name == "linear_ring" else "all_gather")
                dt = time.perf_counter() - t0
                if rep:
                    times.append(dt)
                    log = comm
            row[name] = {"seconds": sorted(times)[len(times) // 2], **log.summary()}
        out.append(row)
    return out


def failing_rank(rank: int, world: int, fail_rank: int, mode: str = "raise", stall_s: float = 60.0,
                 collective_timeout: Optional[float] = None) -> dict:
    """Rank function that goes wrong on purpose (for the tests and the book): every rank runs one
    sequence-parallel step; then `fail_rank` raises (mode "raise") or hangs for `stall_s`
    seconds (mode "stall") while the others run a second step and wait for it.

    collective_timeout: if given, the steps run on a new group whose collectives give up after
    this many seconds in the second step. The group connects and runs the first step under a
    timeout of two minutes, so that a short timeout for the demonstration cuts short nothing
    but the wait for the failing rank, however slowly a busy machine runs the processes.
    """
    if mode not in ("raise", "stall"):
        raise ValueError(f"failing_rank: `mode` must be 'raise' or 'stall', got {mode!r}")
    group = None
    if collective_timeout is not None:
        group = dist.new_group(list(range(world)), timeout=timedelta(seconds=120))
    inp = make_inputs(64 + world, decay="token")
    _sp_forward_backward(inp, rank, world, normalize=True, group=group)
    dist.barrier(group=group)  # every rank has finished the first step
    if collective_timeout is not None:
        short = timedelta(seconds=collective_timeout)
        if hasattr(group, "set_timeout"):  # ProcessGroup.set_timeout (recent torch)
            group.set_timeout(short)
        else:
            group = dist.new_group(list(range(world)), timeout=short)
    if rank == fail_rank:
        if mode == "raise":
            raise ValueError(f"rank {rank} failed on purpose in the middle of the run")
        time.sleep(stall_s)
    _sp_forward_backward(inp, rank, world, normalize=True, group=group)
    return {"rank": rank}


# --------------------------------------------------------------------------------------
# a picture of the two scans (for the book)
# --------------------------------------------------------------------------------------


def draw_rank_scan(world_size: int = 4, *, ax=None, mode: str = "all_gather"):
    """Draw how the states cross the ranks: mode "ring" (a chain of sends, W-1 sequential steps)
    or "all_gather" (one collective, then a local combination on every rank). Returns the axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    if mode not in ("ring", "all_gather"):
        raise ValueError(f"draw_rank_scan: `mode` must be 'ring' or 'all_gather', got {mode!r}")
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 2.6))
    W = world_size
    colors = plt.get_cmap("tab10")
    for r in range(W):
        x0 = r * 1.5
        ax.add_patch(Rectangle((x0, 2.0), 1.2, 0.45, color=colors(r), alpha=0.35))
        ax.text(x0 + 0.6, 2.22, f"rank {r}: tokens", ha="center", va="center", fontsize=7)
        ax.add_patch(Rectangle((x0 + 0.35, 1.0), 0.5, 0.5, color=colors(r), alpha=0.8))
        ax.text(x0 + 0.6, 1.25, f"$S_{r}$", ha="center", va="center", fontsize=9, color="white")
        ax.add_patch(FancyArrowPatch((x0 + 0.6, 2.0), (x0 + 0.6, 1.5), arrowstyle="->", mutation_scale=8))
        ax.text(x0 + 0.6, 0.28, f"$S^{{in}}_{r}$", ha="center", va="center", fontsize=9)
    if mode == "ring":
        for r in range(W - 1):
            x0 = r * 1.5
            ax.add_patch(FancyArrowPatch((x0 + 0.85, 0.28), (x0 + 1.5 + 0.35, 0.28), arrowstyle="->",
                                         mutation_scale=10, color="k"))
            ax.add_patch(FancyArrowPatch((x0 + 0.75, 1.0), (x0 + 1.3, 0.3), arrowstyle="->", mutation_scale=8,
                                         color="0.4", linestyle="--"))
            ax.text(x0 + 1.32, 0.12, f"step {r + 1}", ha="center", fontsize=7)
        title = rf"ring: {W - 1} sequential sends; rank $r$ sends $e^{{G_r}} S^{{in}}_r + S_r$ to rank $r+1$"
    else:
        ax.add_patch(Rectangle((-0.1, 0.55), 1.5 * W - 0.1, 0.2, color="0.6", alpha=0.5))
        ax.text(0.75 * W - 0.15, 0.65, "all_gather: every rank receives every $(S_s, z_s, G_s)$",
                ha="center", va="center", fontsize=7)
        for r in range(W):
            ax.add_patch(FancyArrowPatch((r * 1.5 + 0.6, 1.0), (r * 1.5 + 0.6, 0.75), arrowstyle="->", mutation_scale=8))
            ax.add_patch(FancyArrowPatch((r * 1.5 + 0.6, 0.55), (r * 1.5 + 0.6, 0.42), arrowstyle="->", mutation_scale=8))
        title = r"all-gather: one collective; rank $r$ adds $e^{G_{s+1}+\dots+G_{r-1}} S_s$ over $s<r$"
    ax.set_xlim(-0.2, 1.5 * W)
    ax.set_ylim(0.0, 2.6)
    ax.set_title(title, fontsize=9)
    ax.axis("off")
    return ax


# --------------------------------------------------------------------------------------
# command line: `torchrun --nproc-per-node=N -m linattn_lib.distributed` or `python -m ... --nproc N`
# --------------------------------------------------------------------------------------


def _cli_rank(rank: int, world: int, opts: dict) -> dict:
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if dist.get_backend() == "nccl" else torch.device("cpu")
    case = dict(seq_len=opts["seq_len"], batch=opts["batch"], heads=opts["heads"], dk=opts["dk"], dv=opts["dv"],
                decay=opts["decay"], dtype=getattr(torch, opts["dtype"]), seed=opts["seed"], device=device)
    inp = make_inputs(**case)
    # the Triton kernels take float32/16 only: float64 runs the torch path on every device
    backend = "torch" if case["dtype"] == torch.float64 else "auto"
    comm = CommLog()
    _sp_forward_backward(inp, rank, world, normalize=True, comm=comm, backend=backend)  # warm-up (and compile)
    comm.clear()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    res = _sp_forward_backward(inp, rank, world, normalize=True, comm=comm, backend=backend)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    ref = single_process_reference(inp, normalize=True, backend=backend)
    errs = {}
    for name, r in ref.items():
        got = res[name] if (name == "dlog_decay" and r.dim() == 1) else res[name]
        want = r if (name == "dlog_decay" and r.dim() == 1) else shard_sequence(r, rank, world)
        err = (got.double() - want.double()).abs().max() if want.numel() else torch.zeros((), dtype=torch.float64, device=r.device)
        errs[name] = err / r.double().abs().max().clamp_min(1e-30)
    errs_t = torch.stack(list(errs.values())).to(torch.float64)
    dist.all_reduce(errs_t, op=dist.ReduceOp.MAX)
    return {"rank": rank, "backend": dist.get_backend(), "device": str(device), "seconds": seconds,
            "sent": comm.sent, "os_sent": comm.os_sent, "errors": dict(zip(errs, errs_t.tolist()))}


def _report(results: Sequence[dict], opts: dict) -> bool:
    world = len(results)
    r0 = results[0]
    tol = 1e-4 if opts["dtype"] == "float32" else 1e-10
    worst = max(r0["errors"].values())
    print(f"sequence-parallel linear attention: {world} ranks, backend {r0['backend']}, {r0['device']}")
    print(f"  T={opts['seq_len']} B={opts['batch']} H={opts['heads']} Dk={opts['dk']} Dv={opts['dv']} "
          f"decay={opts['decay']} dtype={opts['dtype']}")
    for name, e in r0["errors"].items():
        print(f"  max |sp - single| / max |single|  {name:11s} {e:.2e}")
    expect = linear_sp_bytes_per_rank(world, batch=opts["batch"], heads=opts["heads"], dk=opts["dk"], dv=opts["dv"],
                                      backward=True, bytes_per_element=8 if opts["dtype"] == "float64" else 4)
    for r in results:
        os_txt = "" if r["os_sent"] is None else f", OS saw {r['os_sent']} B written"
        print(f"  rank {r['rank']}: {r['seconds'] * 1e3:.1f} ms forward+backward, sent {r['sent']} B "
              f"(computed {expect} B){os_txt}")
    ok = worst <= tol and all(r["sent"] == expect for r in results)
    print("OK" if ok else f"FAILED (tolerance {tol:g})")
    return ok


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m linattn_lib.distributed",
        description="Check sequence-parallel linear attention against the single-process result. Under torchrun "
                    "(e.g. `torchrun --standalone --nproc-per-node=4 -m linattn_lib.distributed`) every process is "
                    "one rank (nccl on GPUs, gloo on CPU); otherwise --nproc local CPU processes are started (gloo).")
    p.add_argument("--nproc", type=int, default=2, help="ranks to start when not under torchrun (default 2)")
    p.add_argument("--seq-len", type=_positive_int, default=1000)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dk", type=int, default=32)
    p.add_argument("--dv", type=int, default=32)
    p.add_argument("--decay", choices=["none", "head", "token"], default="token")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a collective gives up")
    a = p.parse_args(argv)
    opts = {"seq_len": a.seq_len, "batch": a.batch, "heads": a.heads, "dk": a.dk, "dv": a.dv,
            "decay": None if a.decay == "none" else a.decay, "dtype": a.dtype, "seed": a.seed}
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "gloo" and os.environ.get("MASTER_ADDR", LOOPBACK) in (LOOPBACK, "localhost", "::1"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=a.timeout))
        try:
            res = _cli_rank(dist.get_rank(), dist.get_world_size(), opts)
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, res)
        finally:
            dist.destroy_process_group()
        return 0 if (res["rank"] != 0 or _report(gathered, opts)) else 1
    results = launch(_cli_rank, a.nproc, opts, timeout=a.timeout)
    return 0 if _report(results, opts) else 1


if __name__ == "__main__":
    sys.exit(main())
