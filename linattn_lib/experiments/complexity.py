"""Measured complexity of the attention variants: time and peak memory against the sequence length.

Text 000 §8.1 tabulates the forward, backward and memory complexity of five attention variants.
This module measures them instead: for each method and each length T it times the forward pass
(no autograd) and the forward + backward pass, records the peak memory of each, and fits the
exponent p of `cost ~ T^p` on a log-log scale. `complexity_table` prints the exponents beside the
theory (and beside what the text claims).

Methods (all causal, inputs q, k, v of shape (B, H, T, d), the raw projections):

| method            | computation                                                          |
|-------------------|----------------------------------------------------------------------|
| "softmax"         | `softmax_attention`: materialises the T x T matrix (the naive kernel)|
| "softmax_fused"   | `torch.nn.functional.scaled_dot_product_attention`: fused, O(T) memory |
| "performer"       | FAVOR+ positive random features (m per head) + `linear_attention`    |
| "linear"          | elu + 1 features + `linear_attention` (chunked, custom backward)     |
| "cosformer"       | relu features with the cos re-weighting: two linear attentions       |
| "decayed"         | unnormalised `linear_attention` with a data-dependent log-decay (SSD) |

CLI (writes the JSON the chapter plots; the speed table uses the text's sizes):

    python -m linattn_lib.experiments.complexity   # -> book/results/complexity_<cpu|cuda>.json

On CUDA the times are wall times from `linattn_lib.measure.cuda_time` (Triton's do_bench); on the
CPU they are single-thread CPU times (`measure.timed_calls(..., clock="process")` inside
`measure.torch_threads(1)`).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core.features import RandomFeatureMap, elu_plus_one
from ..core.linear import linear_attention
from ..core.performer import performer_attention
from ..core.positional import cosformer_attention
from ..core.softmax import softmax_attention
from ..flops import score_matrix_bytes
from ..measure import (
    cuda_time,
    default_device,
    fit_loglog_slope,
    peak_memory_bytes,
    settle_cpu_allocator,
    time_fn,
    timed_calls,
    torch_threads,
)
from .common import parse_cli, progress_bar, run_metadata, write_json

METHODS = ("softmax", "performer", "linear", "cosformer", "decayed")
ALL_METHODS = ("softmax", "softmax_fused", "performer", "linear", "cosformer", "decayed")
MODES = ("forward", "forward+backward")

# Exponent of T at fixed head size d and feature count m, for a straightforward implementation
# (`softmax` stores its T x T matrix; the linear methods use the chunked algorithm whose backward
# recomputes the states, as Katharopoulos et al. 2020 and flash-linear-attention do).
THEORY = {
    "softmax": {"time": 2, "memory": 2, "formula": "O(T^2 d) fwd and bwd, O(T^2) memory"},
    "softmax_fused": {"time": 2, "memory": 1, "formula": "O(T^2 d) fwd and bwd, O(T d) memory (FlashAttention)"},
    "performer": {"time": 1, "memory": 1, "formula": "O(T m d) fwd and bwd, O(T m + T d) memory"},
    "linear": {"time": 1, "memory": 1, "formula": "O(T d^2) fwd and bwd, O(T d) memory"},
    "cosformer": {"time": 1, "memory": 1, "formula": "O(T (2d) d) fwd and bwd, O(T d) memory"},
    "decayed": {"time": 1, "memory": 1, "formula": "O(T d^2 + T C d) fwd and bwd, O(T d) memory"},
}

# What text 000 §8.1 claims (forward, backward, memory), verbatim in its own notation; N is the
# sequence length except in the Mamba row, where the text's footnote reuses N for the state size.
TEXT_CLAIMS = {
    "softmax": ("O(N^2 d)", "O(N^2 d)", "O(N^2)"),
    "performer": ("O(N d m)", "O(N d m)", "O(N m)"),
    "linear": ("O(N d m)", "O(N^2 d)", "O(N m)"),
    "cosformer": ("O(N d m)", "O(N^2 d)", "O(N m)"),
    "decayed": ("O(N d N)", "O(N d N)", "O(N d)"),  # the text's "Mamba" row
}


def make_attention(method: str, d: int, *, num_features: int | None = None, seed: int = 0) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """A causal attention function `f(q, k, v) -> o` of raw (B, H, T, d) inputs for `method`.

    Performer's random projection (m = `num_features`, default floor(d ln d)) is drawn once here,
    not per call. The decayed method derives its log-decay from the queries, -softplus(mean q),
    so that it is data-dependent (and differentiable) like Mamba-2's.
    """
    if method == "softmax":
        return lambda q, k, v: softmax_attention(q, k, v, causal=True)
    if method == "softmax_fused":
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if method == "performer":
        fm = RandomFeatureMap(d, num_features, kind="positive", seed=seed)
        return lambda q, k, v: performer_attention(q, k, v, causal=True, feature_map=fm.to(q.device))
    if method == "linear":
        return lambda q, k, v: linear_attention(elu_plus_one(q), elu_plus_one(k), v, causal=True)
    if method == "cosformer":
        return lambda q, k, v: cosformer_attention(torch.relu(q), torch.relu(k), v, causal=True)
    if method == "decayed":
        scale = d**-0.5
        return lambda q, k, v: linear_attention(
            q * scale, k * scale, v, causal=True, normalize=False, log_decay=-F.softplus(q.mean(-1))
        )
    raise ValueError(f"make_attention: unknown method {method!r}; expected one of {ALL_METHODS}")


def _cuda_seconds(call: Callable[[], object], repeats: int, device: torch.device | str | None) -> float:
    """CUDA time from `measure.cuda_time` (Triton's do_bench, median), when Triton is installed;
    torch-synchronised wall time otherwise."""
    try:
        return cuda_time(call)[0]
    except ImportError:
        return time_fn(call, warmup=0, repeats=repeats, device=device)


def _inputs(batch: int, heads: int, T: int, d: int, *, device, grad: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, T, d, generator=g).to(device).requires_grad_(grad) for _ in range(3)]


def measure_point(
    method: str,
    T: int,
    *,
    mode: str = "forward",
    batch: int = 1,
    heads: int = 4,
    d: int = 32,
    num_features: int | None = None,
    repeats: int = 3,
    device: torch.device | str | None = None,
    fn: Callable | None = None,
    clock: str = "auto",
) -> dict:
    """Median time (s) and peak extra memory (bytes) of one call at length T.

    mode: "forward" (under torch.no_grad) or "forward+backward" (the gradient of o.sum() with
    respect to q, k and v). Memory is `linattn_lib.measure.peak_memory_bytes`: the CUDA
    allocator's peak, or on CPU the process's resident-set high-water mark (None where the OS
    offers neither).
    clock: "wall" (`measure.time_fn`, GPU-synchronised), "cpu" (the median process CPU time,
    `measure.timed_calls(..., clock="process")`, on one torch thread: robust on a busy machine,
    where wall time includes the time other processes hold the cores) or "auto" (wall on CUDA,
    cpu otherwise).
    """
    if mode not in MODES:
        raise ValueError(f"measure_point: mode must be one of {MODES}, got {mode!r}")
    device = torch.device(device) if device is not None else default_device()
    f = fn or make_attention(method, d, num_features=num_features)
    q, k, v = _inputs(batch, heads, T, d, device=device, grad=mode != "forward")

    if mode == "forward":
        def call():
            with torch.no_grad():
                f(q, k, v)
    else:
        def call():
            f(q, k, v).sum().backward()
            q.grad = k.grad = v.grad = None

    if clock == "auto":
        clock = "wall" if device.type == "cuda" else "cpu"
    if clock not in ("wall", "cpu"):
        raise ValueError(f"measure_point: clock must be 'auto', 'wall' or 'cpu', got {clock!r}")
    call()  # warm-up: first-call allocations and caches are not part of the cost
    peak = peak_memory_bytes(call, device=device)
    if clock == "cpu":
        with torch_threads(1):
            seconds = statistics.median(timed_calls(call, warmup=0, repeats=repeats, device=device, clock="process"))
    elif device.type == "cuda":
        seconds = _cuda_seconds(call, repeats, device)
    else:
        seconds = time_fn(call, warmup=0, repeats=repeats, device=device)
    return {"method": method, "T": T, "mode": mode, "seconds": seconds, "peak_bytes": peak, "clock": clock}


def complexity_sweep(
    methods: Sequence[str] = METHODS,
    lengths: Sequence[int] = (512, 1024, 2048, 4096),
    *,
    modes: Sequence[str] = MODES,
    batch: int = 1,
    heads: int = 4,
    d: int = 32,
    num_features: int | None = None,
    repeats: int = 3,
    device: torch.device | str | None = None,
    max_lengths: dict | None = None,
    clock: str = "auto",
    progress: bool = False,
) -> list[dict]:
    """`measure_point` for every method, mode and length: a list of rows (dicts).

    max_lengths: optional {method: longest T} to skip lengths a method cannot afford (e.g. the
    T x T matrix of "softmax" at long T).
    """
    grid = [
        (m, T, mode) for m in methods for mode in modes for T in lengths
        if max_lengths is None or T <= max_lengths.get(m, T)
    ]
    fns = {m: make_attention(m, d, num_features=num_features) for m in methods}
    if progress:
        grid = progress_bar(grid, desc="complexity sweep")
    if torch.device(device or default_device()).type == "cpu":
        settle_cpu_allocator()  # every point timed under the allocator the memory readings need
    rows = []
    for m, T, mode in grid:
        rows.append(measure_point(m, T, mode=mode, batch=batch, heads=heads, d=d, repeats=repeats, device=device, fn=fns[m], clock=clock))
    return rows


def fit_exponents(rows: Iterable[dict], *, min_T: int = 0) -> dict:
    """Fitted exponents {method: {"time_forward", "time_forward+backward", "memory_forward",
    "memory_forward+backward": p}} over the rows with T >= min_T (NaN where < 2 points)."""
    rows = [r for r in rows if r["T"] >= min_T]
    out: dict = {}
    for r in rows:
        out.setdefault(r["method"], {})
    for method in out:
        for mode in MODES:
            pts = sorted((r["T"], r["seconds"], r["peak_bytes"]) for r in rows if r["method"] == method and r["mode"] == mode)
            Ts = [p[0] for p in pts]
            times = [p[1] for p in pts]
            mems = [p[2] for p in pts]
            ok_t = len(Ts) >= 2 and all(t > 0 for t in times)
            ok_m = len(Ts) >= 2 and all(m is not None and m > 0 for m in mems)
            out[method][f"time_{mode}"] = fit_loglog_slope(Ts, times) if ok_t else math.nan
            out[method][f"memory_{mode}"] = fit_loglog_slope(Ts, mems) if ok_m else math.nan
    return out


def complexity_table(exponents: dict, *, text: bool = True) -> str:
    """The §8.1 table, corrected and measured: theory exponent vs fitted exponent per column."""
    head = f"{'method':14s} {'time fwd':>15s} {'time fwd+bwd':>15s} {'mem fwd':>15s} {'mem fwd+bwd':>15s}"
    if text:
        head += "   text 000 §8.1 (fwd / bwd / memory)"
    lines = [head, " " * 15 + "   theory  meas." * 4]
    for method, ex in exponents.items():
        th = THEORY.get(method, {"time": math.nan, "memory": math.nan})
        cells = []
        for key, kind in (("time_forward", "time"), ("time_forward+backward", "time"), ("memory_forward", "memory"), ("memory_forward+backward", "memory")):
            cells.append(f"{th[kind]:>9}  {ex[key]:5.2f}")
        line = f"{method:14s}" + "".join(cells)
        if text and method in TEXT_CLAIMS:
            line += "   " + " / ".join(TEXT_CLAIMS[method])
        lines.append(line)
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# the speed table of §8.3, at the text's own sizes
# ------------------------------------------------------------------------------------------

# "Typical results" of text 000 §8.3 (unsourced; d_model = 768, m = 256): N -> (softmax ms,
# Performer ms, perplexity difference).
TEXT_SPEED = {512: (12.0, 8.0, 0.3), 4096: (180.0, 25.0, 0.8), 16384: (2800.0, 90.0, 1.2)}


@dataclass
class SpeedConfig:
    """The text's benchmark shape: d_model = 768 as 12 heads of 64, m = 256 features per head."""

    lengths: tuple = (512, 4096, 16384)
    batch: int = 1
    heads: int = 12
    d_head: int = 64
    num_features: int = 256
    methods: tuple = ("softmax", "softmax_fused", "performer", "linear", "cosformer", "decayed")
    repeats: int = 3
    max_matrix_bytes: int = 2 << 30  # the naive softmax runs head by head above this


def by_head_groups(fn: Callable[[Tensor, Tensor, Tensor], Tensor], heads_per_call: int) -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """`fn` applied to `heads_per_call` heads at a time, outputs concatenated: the same result
    (heads are independent) with the memory of one group."""

    def grouped(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        g = heads_per_call
        return torch.cat([fn(q[:, i:i + g], k[:, i:i + g], v[:, i:i + g]) for i in range(0, q.shape[1], g)], dim=1)

    return grouped


def speed_table(cfg: SpeedConfig | None = None, *, device: torch.device | str | None = None, progress: bool = False) -> list[dict]:
    """Forward time (median, ms) and peak memory of each method at the text's sizes.

    The naive softmax materialises B*H*T*T floats; where that exceeds `cfg.max_matrix_bytes` it
    is run over groups of heads in sequence (same arithmetic, memory of one group), and the row
    records `heads_per_call`. cfg defaults to `SpeedConfig()`.
    """
    cfg = SpeedConfig() if cfg is None else cfg
    device = torch.device(device) if device is not None else default_device()
    rows = []
    grid = [(m, T) for T in cfg.lengths for m in cfg.methods]
    if progress:
        grid = progress_bar(grid, desc="speed table")
    fns = {m: make_attention(m, cfg.d_head, num_features=cfg.num_features) for m in cfg.methods}
    for m, T in grid:
        f, heads_per_call = fns[m], cfg.heads
        if m == "softmax":
            per_head = score_matrix_bytes(T, batch=cfg.batch)  # one head's T x T fp32 matrix
            heads_per_call = max(1, min(cfg.heads, cfg.max_matrix_bytes // per_head))
            if heads_per_call < cfg.heads:
                f = by_head_groups(fns[m], heads_per_call)

        r = measure_point(m, T, mode="forward", batch=cfg.batch, heads=cfg.heads, d=cfg.d_head, repeats=cfg.repeats, device=device, fn=f)
        r["ms"] = 1000 * r["seconds"]
        r["heads_per_call"] = heads_per_call
        rows.append(r)
    return rows


def local_exponents(lengths: Sequence[float], times: Sequence[float]) -> list[float]:
    """Exponent between consecutive points, log(t2/t1)/log(T2/T1): a pure power law keeps it constant."""
    return [math.log(t2 / t1) / math.log(T2 / T1) for T1, T2, t1, t2 in zip(lengths, lengths[1:], times, times[1:])]


def main(argv: list[str] | None = None) -> dict:
    """Run the sweep (and the speed table) and write the JSON the chapter plots."""
    p = argparse.ArgumentParser(prog="python -m linattn_lib.experiments.complexity", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--softmax-max", type=int, default=8192, help="longest T for the naive softmax in the sweep")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-speed", action="store_true", help="skip the speed table at the text's sizes")
    p.add_argument("--speed-lengths", nargs="+", type=int, default=list(SpeedConfig.lengths))
    args = parse_cli(p, argv, f"book/results/complexity_{default_device().type}.json")
    if args.quick:
        args.lengths, args.repeats, args.no_speed = [64, 128], 1, True
    torch.manual_seed(0)
    sweep_cfg = {"lengths": args.lengths, "batch": 1, "heads": args.heads, "d": args.d, "repeats": args.repeats,
                 "max_lengths": {"softmax": args.softmax_max}}
    rows = complexity_sweep(ALL_METHODS, progress=True, **sweep_cfg)
    payload = {
        "meta": run_metadata("linattn_lib.experiments.complexity", argv),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "sweep": {"config": sweep_cfg, "rows": rows, "exponents": fit_exponents(rows, min_T=args.lengths[len(args.lengths) // 2 - 1])},
    }
    if not args.no_speed:
        scfg = SpeedConfig(lengths=tuple(args.speed_lengths), repeats=args.repeats)
        payload["speed"] = {"config": asdict(scfg), "rows": speed_table(scfg, progress=True), "text": TEXT_SPEED}
    payload["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    write_json(args.out, payload)
    print(f"wrote {args.out}")
    return payload


if __name__ == "__main__":
    main()
