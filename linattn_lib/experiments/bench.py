"""Benchmarks: linear attention next to softmax attention, side by side, and the CPU targets.

    python -m linattn_lib.experiments.bench                  # the CPU targets (B=1, H=8, T=16384, D=64, fp32)
    python -m linattn_lib.experiments.bench sweep --T 1024,4096,16384 --D 64 --chunk-size 64,128
    python -m linattn_lib.experiments.bench --quick          # tiny sizes, a few seconds (a smoke test)

Every run prints a table, and writes JSON (command, configuration, hardware, versions, every
measurement) and a PNG plot into --out (default ``book/results/bench/``).

Providers (all called on the same tensors, q and k being non-negative features; see
`bench_providers`):

* ``linattn-triton``  ``linear_attention(..., backend="triton")`` -- compiled kernels, CUDA only
* ``linattn-torch``   ``linear_attention(..., backend="torch")`` -- the chunked torch path
* ``naive-quadratic`` ``linear_attention(..., form="quadratic")`` -- materialises T x T
* ``sdpa``            ``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)``
* ``fla``             flash-linear-attention's ``chunk_linear_attn``, when it is installed (CUDA)

Timing. CUDA: ``triton.testing.do_bench`` (median, `measure.cuda_time`), plus the achieved memory
bandwidth against the device's peak: the chunked kernel moves O(T D) bytes for O(T D (C + D))
FLOPs, so at D = 64 it is memory-bound on a GPU and GB/s is its honest figure of merit. CPU: a
wall-clock timer (`measure.timed_calls`: warm-up calls, then the median of repeats, each started
with flushed caches as do_bench does on a GPU; the thread count is left as it is), with
providers measured in interleaved rounds so that a noisy neighbour slows all of them alike.
FLOPs and bytes are counted by `linattn_lib.flops` (`chunked_forward_flops`, `io_bytes`).
Triton is never imported without CUDA.

This module holds the sweep and the command line; the CPU targets are `bench_targets`.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.triton_ops import load_kernels
from ..flops import FLOPS_FORMULA, chunked_forward_flops, io_bytes
from ..measure import cuda_time, device_name, timed_calls
from .bench_providers import MODES, PROVIDERS, Skip, make_inputs, provider_call
from .bench_targets import (
    GROWTH_T,
    MATMUL_N,
    MEMORY_T,
    TARGET_SHAPE,
    format_targets,
    plot_targets,
    run_targets,
    verdict,
)
from .common import progress_bar, run_metadata, save_figure, write_json

MODULE = "linattn_lib.experiments.bench"
DEFAULT_OUT = "book/results/bench"


# --------------------------------------------------------------------------------------
# sweep: every provider, side by side
# --------------------------------------------------------------------------------------


@dataclass
class SweepConfig:
    """What `run_sweep` measures: the shapes, modes, providers, dtype and device, and how often."""

    B: int = 1
    H: int = 8
    T: list = field(default_factory=lambda: [1024, 4096, 16384])
    D: list = field(default_factory=lambda: [64])
    chunk_size: list = field(default_factory=lambda: [64])
    modes: list = field(default_factory=lambda: list(MODES))
    providers: list = field(default_factory=lambda: list(PROVIDERS))
    dtype: str = "float32"
    device: str = "cpu"
    repeats: int = 5
    budget_s: float = 10.0
    max_quadratic_gib: float = 4.0


CHUNKED = ("linattn-torch", "linattn-triton", "fla")  # chunked providers (GB/s and GFLOP/s reported)
SWEPT_CHUNK = ("linattn-torch",)  # the one that takes any chunk size; the kernels use their own


def _own_chunk(name: str, D: int, dtype: torch.dtype, device: torch.device | str) -> int | None:
    """The chunk length a kernel provider really uses: the two-phase launchers' config (their
    state and output kernels share it; CUDA only: Triton is never imported without it), or
    fla's 64."""
    if name == "fla":
        return 64
    if name == "linattn-triton" and torch.device(device).type == "cuda":
        K = load_kernels()
        return None if K is None else K.select_config("chunk_output", D, dtype, device)["BT"]
    return None


def run_sweep(cfg: SweepConfig, *, progress: bool = True, flush_caches: bool = True) -> list[dict]:
    """Time every (T, D, mode) for every provider -- the chunked ones at every chunk size --
    measured side by side; one record per measurement (or per skip, with the reason).

    flush_caches: on the CPU, flush the caches before each timed call (`measure.flush_cpu_caches`).
    """
    dtype = getattr(torch, cfg.dtype)
    on_cuda = torch.device(cfg.device).type == "cuda"
    peak = cuda_peak_gbps() if on_cuda else None
    grid = [(T, D, m) for T in cfg.T for D in cfg.D for m in cfg.modes]
    records = []
    for T, D, mode in progress_bar(grid, desc="bench sweep", enabled=progress):
        q, k, v, do = make_inputs(cfg.B, cfg.H, T, D, dtype=dtype, device=cfg.device, grad=mode == "fwd+bwd")
        runs = []  # (record, callable)
        for name in cfg.providers:
            chunks = cfg.chunk_size if name in SWEPT_CHUNK else [_own_chunk(name, D, dtype, cfg.device)]
            for C in chunks:
                rec = dict(provider=name, mode=mode, B=cfg.B, H=cfg.H, T=T, D=D, chunk_size=C, dtype=cfg.dtype)
                records.append(rec)
                try:
                    call = provider_call(name, mode, q, k, v, do, chunk_size=C or 64,
                                         max_quadratic_bytes=cfg.max_quadratic_gib * 2**30)
                except Skip as e:
                    rec["skipped"] = str(e)
                    continue
                runs.append((rec, call))
        if on_cuda:
            for rec, call in runs:
                rec["times_s"] = cuda_time(call, grad_to_none=[q, k, v] if mode != "fwd" else None)
        else:  # interleaved rounds (A, B, C, A, B, C, ...): a noisy neighbour slows all alike
            for rec, call in runs:  # one warm-up call and one timed call each
                rec["times_s"] = timed_calls(call, warmup=1, repeats=1, device="cpu", flush_caches=flush_caches,
                                             budget_s=cfg.budget_s)
            for _ in range(cfg.repeats - 1):
                for rec, call in runs:
                    if sum(rec["times_s"]) < cfg.budget_s:  # slow providers get fewer repeats
                        rec["times_s"] += timed_calls(call, warmup=0, repeats=1, device="cpu",
                                                      flush_caches=flush_caches)
        for rec, _ in runs:
            rec["median_s"] = statistics.median(rec["times_s"])
            if rec["chunk_size"] and mode == "fwd":
                rec["gflops"] = chunked_forward_flops(cfg.B, cfg.H, T, D, D, rec["chunk_size"]) / rec["median_s"] / 1e9
            if on_cuda and rec["provider"] in CHUNKED:
                rec["gbps"] = io_bytes(cfg.B, cfg.H, T, D, D, q.element_size(), mode) / rec["median_s"] / 1e9
                rec["peak_gbps"] = peak
        del q, k, v, do, runs
    return records


def format_sweep(records: list[dict], providers: list[str], on_cuda: bool) -> str:
    """The sweep as a fixed-width table: one row per (mode, T, D, chunk size), one column per provider."""
    # the chunk sizes that ran: a skipped provider's own chunk length (fla's 64 off CUDA) makes no row
    keys = sorted({(r["T"], r["D"], r["chunk_size"] or 0, r["mode"]) for r in records
                   if r["chunk_size"] and "median_s" in r})
    if not keys:  # no chunked provider ran in this sweep
        keys = sorted({(r["T"], r["D"], 0, r["mode"]) for r in records})
    keys.sort(key=lambda key: (MODES.index(key[3]), key[1], key[2], key[0]))
    width = 28 if on_cuda else 16
    head = f"{'mode':8s} {'T':>7s} {'D':>4s} {'C':>4s} " + " ".join(f"{p:>{width}s}" for p in providers)
    lines = [head, "-" * len(head)]
    for T, D, C, mode in keys:
        cells = []
        for p in providers:
            rec = next(
                (r for r in records if r["provider"] == p and r["T"] == T and r["D"] == D and r["mode"] == mode
                 and (r["chunk_size"] in (None, C))),
                None,
            )
            if rec is None or "median_s" not in rec:
                cells.append(f"{'skip':>{width}s}")
                continue
            cell = f"{rec['median_s'] * 1e3:.2f} ms"
            if on_cuda and "gbps" in rec:
                cell += f" {rec['gbps']:.0f} GB/s"
                if rec.get("peak_gbps"):
                    cell += f" ({100 * rec['gbps'] / rec['peak_gbps']:.0f}%)"
            cells.append(f"{cell:>{width}s}")
        lines.append(f"{mode:8s} {T:7d} {D:4d} {C or '':>4} " + " ".join(cells))
    lines.append("times: median wall clock (ms); 'skip': not run, see the JSON for why.")
    if on_cuda:
        peak = next((r.get("peak_gbps") for r in records if r.get("peak_gbps")), None)
        lines.append(
            "GB/s: minimum bytes moved (q, k, v, o; and do, dq, dk, dv) / time"
            + (f", device peak {peak:.0f} GB/s" if peak else "")
            + ". The chunked kernel is memory-bound at these head sizes: GB/s against the peak is its measure."
        )
    return "\n".join(lines)


def plot_sweep(records: list[dict], path: Path, title: str) -> Path:
    """Time against T, log-log, one panel per mode and one line per provider (and chunk size), as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in MODES if any(r["mode"] == m for r in records)]
    fig, axes = plt.subplots(1, len(modes), figsize=(5.5 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        series = {}
        for r in records:
            if r["mode"] == mode and "median_s" in r:
                label = r["provider"] + (f" C={r['chunk_size']}" if r["chunk_size"] else "") + f" D={r['D']}"
                series.setdefault(label, []).append((r["T"], r["median_s"] * 1e3))
        for label, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel="sequence length T", ylabel="time (ms)", title=mode)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return save_figure(fig, path, title)


def cuda_peak_gbps() -> float | None:
    """The device's peak DRAM bandwidth in GB/s (CUDA only), from its memory clock and bus."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate
    try:
        from triton.testing import get_dram_gbps

        return float(get_dram_gbps())
    except Exception:
        return None


# --------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------


def _ints(s: str) -> list[int]:
    """Comma-separated positive ints (T, D and chunk sizes: 0 would fall back to a default
    while the record kept the 0)."""
    out = [int(x) for x in s.split(",") if x]
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive ints, got {s!r}")
    return out


def _names(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The command line of `main`."""
    p = argparse.ArgumentParser(
        prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("what", nargs="?", default="targets", choices=("targets", "sweep"),
                   help="targets (default): the CPU targets table; sweep: every provider side by side")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test that takes seconds")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"folder for the JSON and PNG (default: {DEFAULT_OUT}/)")
    p.add_argument("--B", type=int, default=None)
    p.add_argument("--H", type=int, default=None)
    p.add_argument("--T", type=_ints, default=None, help="comma-separated sequence lengths")
    p.add_argument("--D", type=_ints, default=None, help="comma-separated head sizes (Dk = Dv)")
    p.add_argument("--chunk-size", type=_ints, default=None, help="comma-separated chunk sizes")
    p.add_argument("--mode", type=_names, default=None, help="fwd, fwd+bwd (comma-separated)")
    p.add_argument("--providers", type=_names, default=None, help=f"from {', '.join(PROVIDERS)}")
    p.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    p.add_argument("--device", default=None, help="cpu or cuda (sweep; default: cuda when present)")
    p.add_argument("--repeats", type=int, default=None, help="timed calls (sweep) or rounds (targets)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--strict", action="store_true", help="targets: exit with status 1 if one fails")
    p.add_argument("--no-flush", action="store_true",
                   help="CPU: do not flush the caches before each timed call (--quick implies it)")
    p.add_argument("--thp", action="store_true",
                   help="run with torch's 2 MiB transparent-huge-page allocations (THP_MEM_ALLOC_ENABLE=1): "
                        "fewer page faults on fresh tensors, for every provider alike")
    return p


def _sweep_config(a: argparse.Namespace) -> SweepConfig:
    """The sweep's configuration from the command line (--quick: tiny sizes)."""
    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = SweepConfig(device=device, dtype=a.dtype)
    if a.quick:
        cfg.H, cfg.T, cfg.D, cfg.chunk_size, cfg.repeats, cfg.budget_s = 2, [64, 256], [16], [16], 2, 1.0
    for name in ("B", "H", "T", "D", "chunk_size", "repeats"):
        if getattr(a, name) is not None:
            setattr(cfg, name, getattr(a, name))
    cfg.modes = a.mode or cfg.modes
    cfg.providers = a.providers or cfg.providers
    for what, given, allowed in (("--mode", cfg.modes, MODES), ("--providers", cfg.providers, PROVIDERS)):
        bad = [x for x in given if x not in allowed]
        if bad:
            raise SystemExit(f"bench: unknown {what} {', '.join(bad)}; expected some of {', '.join(allowed)}")
    return cfg


def _main_sweep(a: argparse.Namespace, meta: dict, out: Path) -> int:
    """`bench sweep`: measure, print the table, write the JSON (and the plot)."""
    cfg = _sweep_config(a)
    meta["hardware"] = device_name(cfg.device)
    records = run_sweep(cfg, progress=not a.no_progress, flush_caches=meta["cpu_cache_flush"])
    table = format_sweep(records, cfg.providers, cfg.device == "cuda")
    print(f"linear attention benchmark -- {meta['hardware']}, torch {meta['torch_version']}, "
          f"linattn_lib {meta['library_version']}; B={cfg.B} H={cfg.H} {cfg.dtype}, causal")
    print(table)
    stem = f"sweep-{cfg.device}" + ("-quick" if a.quick else "")
    payload = dict(meta, config=cfg.__dict__, records=records, table=table)
    path = write_json(out / f"{stem}.json", payload)
    print(f"wrote {path}")
    if not a.no_plot:
        print(f"wrote {plot_sweep(records, out / f'{stem}.png', meta['hardware'])}")
    return 0


def _targets_config(a: argparse.Namespace) -> dict:
    """`run_targets`'s arguments from the command line (--quick: tiny sizes)."""
    if a.quick:
        B, H, T, D, C, rounds, growth_T, memory_T, mm_n = 1, 2, 512, 16, 16, 1, (128, 512), 1024, 128
    else:
        s = TARGET_SHAPE
        B, H, T, D, C, rounds = s["B"], s["H"], s["T"], s["D"], 64, 5
        growth_T, memory_T, mm_n = GROWTH_T, MEMORY_T, MATMUL_N
    B, H = a.B or B, a.H or H
    T, D, C = (a.T or [T])[0], (a.D or [D])[0], (a.chunk_size or [C])[0]
    return dict(B=B, H=H, T=T, D=D, chunk_size=C, rounds=a.repeats or rounds, growth_T=growth_T,
                memory_T=memory_T, matmul_n=mm_n)


def _main_targets(a: argparse.Namespace, meta: dict, out: Path) -> int:
    """`bench` (targets, CPU): measure, print the verdicts, write the JSON (and the plot)."""
    cfg = _targets_config(a)
    meta["hardware"] = device_name("cpu")
    res = run_targets(**cfg, progress=not a.no_progress, flush_caches=meta["cpu_cache_flush"])
    table, rows = format_targets(res, meta)
    if a.quick:
        table += "\n(--quick: tiny sizes, a smoke test -- the verdicts mean nothing at this size)"
    print(table)
    stem = "targets-cpu" + ("-quick" if a.quick else "")
    payload = dict(meta, config=dict(cfg, growth_T=list(cfg["growth_T"]), quick=a.quick),
                   flops_formula=FLOPS_FORMULA, results=res,
                   targets=[dict(r, verdict=verdict(r["ok"])) for r in rows], table=table)
    path = write_json(out / f"{stem}.json", payload)
    print(f"wrote {path}")
    if not a.no_plot:
        print(f"wrote {plot_targets(res, out / f'{stem}.png', meta['hardware'])}")
    failed = any(r["ok"] is False for r in rows)
    return 1 if (failed and a.strict) else 0


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark command line (see the module docstring); returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    if a.thp and os.environ.get("THP_MEM_ALLOC_ENABLE") != "1":
        # torch reads the variable once, at its first allocation: start again with it set
        env = dict(os.environ, THP_MEM_ALLOC_ENABLE="1")
        return subprocess.run([sys.executable, "-m", MODULE, *argv], env=env).returncode
    meta = run_metadata(MODULE, argv)
    meta["environment"] = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "THP_MEM_ALLOC_ENABLE", "MKL_NUM_THREADS")}
    meta["cpu_cache_flush"] = not (a.no_flush or a.quick)
    if a.what == "sweep":
        return _main_sweep(a, meta, Path(a.out))
    return _main_targets(a, meta, Path(a.out))


if __name__ == "__main__":
    sys.exit(main())
