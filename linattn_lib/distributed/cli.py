"""The command-line check behind `python -m linattn_lib.distributed` (chapter 9).

`main` checks sequence-parallel linear attention against the single-process result (outputs and
gradients), times one forward+backward and compares the bytes every rank sent with
`linear_sp_bytes_per_rank`. Under torchrun every process is one rank (nccl on GPUs, gloo on
CPU); otherwise `--nproc` local CPU processes are started with `launch` (gloo). It is also
callable from Python, `main(["--nproc", "2"])`, and returns the exit status (0 when OK).

`__main__.py` only calls `main`: the rank function `_cli_rank` lives here, in a module the ranks
can import (a function defined in `__main__` would not unpickle in them).
"""
from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from .comm import CommLog
from .harness import _sp_forward_backward, make_inputs, single_process_reference
from .launcher import LOOPBACK, launch, loopback_interface
from .sequence_parallel import linear_sp_bytes_per_rank, shard_sequence

__all__ = ["main"]


def _cli_rank(rank: int, world: int, opts: dict) -> dict:
    """Rank function of the CLI: one warm-up and one timed forward+backward on this rank's slice;
    the errors against the single-process result (the largest over the ranks) and the bytes sent."""
    nccl = dist.get_backend() == "nccl"
    device = torch.device(f"cuda:{torch.cuda.current_device()}") if nccl else torch.device("cpu")
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
    return {"rank": rank, "backend": dist.get_backend(), "device": str(device), "seconds": seconds,
            "sent": comm.sent, "os_sent": comm.os_sent, "errors": _largest_errors(res, ref, rank, world)}


def _largest_errors(res: dict[str, Tensor], ref: dict[str, Tensor], rank: int, world: int) -> dict[str, float]:
    """max |this rank's slice - the reference's| / max |reference| of every output and gradient,
    the largest over the ranks (one all-reduce). A per-head (H,) log-decay gradient is whole on
    every rank, so it is compared as it is."""
    errs = {}
    for name, r in ref.items():
        shared = name == "dlog_decay" and r.dim() == 1
        want = r if shared else shard_sequence(r, rank, world)
        err = ((res[name].double() - want.double()).abs().max() if want.numel()
               else torch.zeros((), dtype=torch.float64, device=r.device))
        errs[name] = err / r.double().abs().max().clamp_min(1e-30)
    errs_t = torch.stack(list(errs.values())).to(torch.float64)
    dist.all_reduce(errs_t, op=dist.ReduceOp.MAX)
    return dict(zip(errs, errs_t.tolist()))


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


def _parser() -> argparse.ArgumentParser:
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
    return p


def _options(a: argparse.Namespace) -> dict:
    """The problem every rank builds (the keyword arguments of `_cli_rank`'s case)."""
    return {"seq_len": a.seq_len, "batch": a.batch, "heads": a.heads, "dk": a.dk, "dv": a.dv,
            "decay": None if a.decay == "none" else a.decay, "dtype": a.dtype, "seed": a.seed}


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _run_under_torchrun(opts: dict, timeout: float) -> int:
    """This process is one rank of a torchrun group: join it, check, and report on rank 0."""
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "gloo" and os.environ.get("MASTER_ADDR", LOOPBACK) in (LOOPBACK, "localhost", "::1"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback_interface())
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    try:
        res = _cli_rank(dist.get_rank(), dist.get_world_size(), opts)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, res)
    finally:
        dist.destroy_process_group()
    return 0 if (res["rank"] != 0 or _report(gathered, opts)) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m linattn_lib.distributed [options]` (see `--help`): check sequence-parallel
    linear attention against the single-process result; returns 0 when it matches and every
    rank sent the computed number of bytes, 1 otherwise."""
    a = _parser().parse_args(argv)
    opts = _options(a)
    if _under_torchrun():
        return _run_under_torchrun(opts, a.timeout)
    results = launch(_cli_rank, a.nproc, opts, timeout=a.timeout)
    return 0 if _report(results, opts) else 1
