"""Measure the length T* where linear attention overtakes softmax attention (chapter 7).

    python -m linattn_lib.experiments.crossover --out book/results/crossover_cpu.json

times one causal forward of both mechanisms (fused SDPA against elu+1 features and the chunked
linear attention) over a range of lengths, for several head dimensions, locates T* with
`chapters.dispatch.crossover_from_times`, and writes JSON with the command, the hardware and
every time. `chapters.dispatch.MEASURED_CROSSOVER` holds the committed CPU result; the
dispatcher (`chapters.dispatch.crossover_length`, `choose_attention`) reads such tables.
"""
from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _validate as V
from ..chapters.dispatch import Crossover, crossover_from_times
from ..core.features import elu_plus_one
from ..core.linear import linear_attention
from ..measure import default_device, device_name, time_fn, torch_threads
from .common import run_metadata, write_json

MODULE = "linattn_lib.experiments.crossover"
DEFAULT_LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096)


def _inputs(T: int, d: int, heads: int, batch: int, device: torch.device | str) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(T)
    return tuple(torch.randn(batch, heads, T, d, generator=gen).to(device) for _ in range(3))


def time_attention(kind: str, T: int, d: int, *, device: torch.device | str = "cpu", heads: int = 4, batch: int = 1,
                   causal: bool = True, repeats: int = 5) -> float:
    """Median forward time (s) of "softmax" (fused SDPA) or "linear" (elu+1 features included, chunked)."""
    V.check_choice("time_attention", "kind", kind, ("softmax", "linear"))
    q, k, v = _inputs(T, d, heads, batch, device)
    if kind == "softmax":
        fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
    else:
        fn = lambda: linear_attention(elu_plus_one(q), elu_plus_one(k), v, causal=causal)  # noqa: E731
    with torch.no_grad():
        return time_fn(fn, warmup=1, repeats=repeats, device=device)


def measure_crossover(d: int = 64, *, device: torch.device | str = "cpu", lengths: Sequence[int] = DEFAULT_LENGTHS,
                      heads: int = 4, batch: int = 1, causal: bool = True, repeats: int = 5,
                      threads: int | None = 1) -> Crossover:
    """Time both mechanisms at every length and locate the crossover T* (see `crossover_from_times`).

    threads: CPU threads for the measurement (restored afterwards); the default, one thread,
    gives stable timings on a shared machine, where oversubscribed threads make small calls
    erratic. None keeps torch's current setting. Ignored on CUDA.
    """
    device_type = torch.device(device).type if device is not None else "cpu"
    on_cpu = device_type == "cpu"
    kw = dict(device=device, heads=heads, batch=batch, causal=causal, repeats=repeats)
    with torch_threads(threads if on_cpu else None):
        soft = [time_attention("softmax", T, d, **kw) for T in lengths]
        lin = [time_attention("linear", T, d, **kw) for T in lengths]
    return Crossover(
        device=device_type, d=d, heads=heads, batch=batch, causal=causal, lengths=list(lengths),
        softmax_s=soft, linear_s=lin, t_star=crossover_from_times(lengths, soft, lin),
        threads=threads if on_cpu else None,
    )


def build_parser() -> argparse.ArgumentParser:
    """The command line of `main`."""
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description="measure the softmax/linear crossover length")
    p.add_argument("--out", default=None, help="JSON file to write (default: print only)")
    p.add_argument("--d", nargs="+", type=int, default=[32, 64, 128])
    p.add_argument("--lengths", nargs="+", type=int, default=list(DEFAULT_LENGTHS) + [8192])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default=None)
    p.add_argument("--threads", type=int, default=1, help="CPU threads while timing (default 1: stable on a shared machine)")
    return p


def main(argv: list[str] | None = None) -> dict:
    """Measure the crossover for several head dimensions and write JSON with the hardware."""
    args = build_parser().parse_args(argv)
    device = torch.device(args.device) if args.device else default_device()
    runs = []
    for d in args.d:
        c = measure_crossover(d, device=device, lengths=args.lengths, heads=args.heads, repeats=args.repeats,
                              threads=args.threads)
        runs.append(c.to_dict())
        print(f"d={d}: T* = {c.t_star if c.t_star is None else round(c.t_star)}  "
              f"(T*/d = {c.ratio if c.ratio is None else round(c.ratio, 1)})")
    meta = dict(run_metadata(MODULE, argv), device=device_name(device), timing_threads=args.threads)
    payload = {"meta": meta, "crossovers": runs}
    if args.out:
        write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
