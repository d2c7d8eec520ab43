"""The check and benchmark harness: rank functions for the tests, the book and the CLI.

Each function here runs on one rank under `launch` (or torchrun) and must therefore be
importable, not defined in a notebook or `__main__`: `check_rank` computes outputs and gradients
on this rank's slice, `compare_with_reference` compares the ranks' slices with the single-process
result (`single_process_reference`, or softmax attention for ring attention), `measure_rank`
times and counts the bytes of each method, and `failing_rank` goes wrong on purpose to show how
`launch` reports a failed or stalled rank. `make_inputs` builds the same deterministic inputs on
every rank.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.linear import linear_attention
from ..core.softmax import softmax_attention
from .comm import CommLog
from .ring import ring_attention
from .sequence_parallel import sequence_parallel_linear_attention, shard_sequence

__all__ = [
    "check_rank",
    "compare_with_reference",
    "failing_rank",
    "make_inputs",
    "measure_rank",
    "single_process_reference",
]


def make_inputs(seq_len: int, *, batch: int = 1, heads: int = 2, dk: int = 16, dv: int = 16,
                decay: str | None = "token", dtype: torch.dtype = torch.float32, seed: int = 0,
                device: str | torch.device = "cpu") -> dict[str, Tensor | None]:
    """Deterministic full-sequence inputs (the same on every rank): positive features q, k
    (elu+1 of Gaussians), v, the weights w of the loss sum(o * w), and a log-decay that is None,
    per head ("head", shape (H,)) or per token ("token", (B, H, T))."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> Tensor:
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


def _sp_forward_backward(inp: dict, rank: int, world: int, *, normalize: bool,
                         group: dist.ProcessGroup | None = None, comm: CommLog | None = None,
                         backend: str = "auto", chunk_size: int = 64,
                         scan: str = "all_gather") -> dict[str, Tensor]:
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


def single_process_reference(inp: dict, *, normalize: bool, chunk_size: int = 64,
                             backend: str = "auto") -> dict[str, Tensor]:
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
                 collective_timeout: float | None = None) -> dict[str, int]:
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
