"""Benchmarks: linear attention next to softmax attention, side by side, and the CPU targets.

    python -m linattn_lib.experiments.bench                  # the CPU targets (B=1, H=8, T=16384, D=64, fp32)
    python -m linattn_lib.experiments.bench sweep --T 1024,4096,16384 --D 64 --chunk-size 64,128
    python -m linattn_lib.experiments.bench --quick          # tiny sizes, a few seconds (a smoke test)

Every run prints a table, and writes JSON (command, configuration, hardware, versions, every
measurement) and a PNG plot into --out (default ``bench_results/``).

Providers (all called on the same tensors, q and k being non-negative features):

* ``linattn-triton``  ``linear_attention(..., backend="triton")`` -- compiled kernels, CUDA only
* ``linattn-torch``   ``linear_attention(..., backend="torch")`` -- the chunked torch path
* ``naive-quadratic`` ``linear_attention(..., form="quadratic")`` -- materialises T x T
* ``sdpa``            ``torch.nn.functional.scaled_dot_product_attention(..., is_causal=True)``
* ``fla``             flash-linear-attention's ``chunk_linear_attn``, when it is installed (CUDA)

Timing. CUDA: ``triton.testing.do_bench`` (median), plus the achieved memory bandwidth against
the device's peak: the chunked kernel moves O(T D) bytes for O(T D (C + D)) FLOPs, so at
D = 64 it is memory-bound on a GPU and GB/s is its honest figure of merit. CPU: a wall-clock
timer (warm-up calls, then the median of repeats, each started with flushed caches as
do_bench does on a GPU; the thread count is left as it is), with providers measured in
interleaved rounds so that a noisy neighbour slows all of them alike.
Triton is never imported without CUDA.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..core.linear import linear_attention
from .common import progress_bar, run_metadata, write_json
from ..measure import device_name, peak_memory_bytes

PROVIDERS = ("linattn-triton", "linattn-torch", "naive-quadratic", "sdpa", "fla")
MODES = ("fwd", "fwd+bwd")
MODULE = "linattn_lib.experiments.bench"

# The CPU targets: (B, H, T, D) and what must hold, measured side by side in one run.
TARGET_SHAPE = dict(B=1, H=8, T=16384, D=64)
TARGET_SPEEDUP_VS_SDPA = 16.0  # forward time of sdpa(is_causal=True) / forward time of linattn-torch
TARGET_MATMUL_FRACTION = 0.50  # forward FLOP/s / FLOP/s of one big fp32 matmul
TARGET_GROWTH = 4.6  # fwd+bwd time(T) / time(T/4): 4 is exactly linear
TARGET_MEMORY = 4.0  # fwd+bwd peak memory / bytes of q, k, v and o
GROWTH_T = (4096, 16384)
MEMORY_T = 65536
MATMUL_N = 2048


class Skip(Exception):
    """A provider that cannot run this configuration (with the reason)."""


# --------------------------------------------------------------------------------------
# what is counted
# --------------------------------------------------------------------------------------


def chunked_forward_flops(B: int, H: int, T: int, Dk: int, Dv: int, C: int, normalize: bool = True) -> int:
    """FLOPs of the chunked forward, counted as the torch path does them (see FLOPS_FORMULA).

    Per chunk of C tokens and head, with Dv' = Dv + 1 when normalising (the ones column of v
    that carries the denominator): the intra-chunk scores q k^T (2 C^2 Dk) and their product
    with v' (2 C^2 Dv') -- the full C x C matrices, masked half included, because that is what
    the matmuls compute -- the past through the state q E (2 C Dk Dv') and the chunk's state
    increment k^T v' (2 C Dk Dv'). Padding of the last chunk is counted too. Not counted: the
    scan that turns increments into entry states, masks, copies and the final division.
    """
    C = min(C, T)
    Dva = Dv + int(normalize)
    chunks = B * H * math.ceil(T / C)
    return chunks * (2 * C * C * Dk + 2 * C * C * Dva + 4 * C * Dk * Dva)


FLOPS_FORMULA = (
    "FLOPs per chunk of C tokens and head: 2C^2*Dk (q k^T) + 2C^2*Dv' (A v') + 2C*Dk*Dv' (q E) "
    "+ 2C*Dk*Dv' (k^T v'), with Dv' = Dv + 1 (the ones column that carries the normaliser); "
    "times B*H*ceil(T/C) chunks. Not counted: the scan over chunk states, masks, copies, the division."
)


def io_bytes(B: int, H: int, T: int, Dk: int, Dv: int, itemsize: int, mode: str) -> int:
    """Bytes a chunked kernel must move at least: read q, k, v and write o (forward); the
    backward also reads q, k, v, o, do and writes dq, dk, dv."""
    per_token = 2 * Dk + 2 * Dv
    if mode == "fwd+bwd":
        per_token += (2 * Dk + 3 * Dv) + (2 * Dk + Dv)
    return B * H * T * per_token * itemsize


# --------------------------------------------------------------------------------------
# timers
# --------------------------------------------------------------------------------------


def _last_level_cache_bytes() -> int:
    """Size of the CPU's last-level cache (Linux sysfs), or 256 MiB when it cannot be read."""
    try:
        base = Path("/sys/devices/system/cpu/cpu0/cache")
        sizes = []
        for index in base.glob("index*"):
            text = (index / "size").read_text().strip().upper()
            mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
            sizes.append(int(text.rstrip("KMG")) * mult)
        return max(sizes)
    except (OSError, ValueError):
        return 256 * 2**20


_FLUSH: dict = {"enabled": True}


def flush_cpu_caches() -> None:
    """Evict the caches by writing a buffer twice the last-level cache (at most 1 GiB), the way
    triton.testing.do_bench clears the GPU's L2 before every timed run: each call then starts
    cold, as it would inside a model, instead of finding last call's inputs still cached."""
    if not _FLUSH["enabled"]:
        return
    if "buf" not in _FLUSH:
        _FLUSH["buf"] = torch.empty(min(2 * _last_level_cache_bytes(), 2**30) // 4, dtype=torch.int32)
    _FLUSH["buf"].zero_()


def cpu_time(
    fn: Callable[[], object], *, warmup: int = 1, repeats: int = 5, budget_s: float = 10.0
) -> list[float]:
    """Wall-clock seconds of `repeats` calls of fn() after `warmup` calls (fewer when one call
    alone would exceed the budget), each timed call starting with flushed caches. torch's
    thread count is left untouched."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        fn()
    first = (time.perf_counter() - t0) / warmup if warmup else 0.0
    n = max(1, min(repeats, int(budget_s / max(first, 1e-9))))
    times = []
    for _ in range(n):
        flush_cpu_caches()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def cuda_time(fn: Callable[[], object], grad_to_none=None) -> list[float]:
    """Median seconds from triton.testing.do_bench (CUDA only: never called without a GPU)."""
    from triton.testing import do_bench

    return [do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median") / 1e3]


def cuda_peak_gbps() -> Optional[float]:
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


def matmul_flops_per_s(n: int = MATMUL_N, *, dtype=torch.float32, device="cpu", repeats: int = 5) -> float:
    """FLOP/s of one n x n @ n x n matmul (2 n^3 FLOPs), median of `repeats`."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    if torch.device(device).type == "cuda":
        t = cuda_time(lambda: a @ b)[0]
    else:
        t = statistics.median(cpu_time(lambda: a @ b, warmup=2, repeats=repeats))
    return 2 * n**3 / t


# --------------------------------------------------------------------------------------
# providers
# --------------------------------------------------------------------------------------


def make_inputs(B, H, T, D, *, dtype=torch.float32, device="cpu", grad=False, seed=0):
    """q, k: non-negative features (what linear attention takes); v and the output gradient."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.rand(B, H, T, D, generator=g, dtype=torch.float32).to(device, dtype)
    k = torch.rand(B, H, T, D, generator=g, dtype=torch.float32).to(device, dtype)
    v = torch.randn(B, H, T, D, generator=g, dtype=torch.float32).to(device, dtype)
    do = torch.randn(B, H, T, D, generator=g, dtype=torch.float32).to(device, dtype)
    for x in (q, k, v):
        x.requires_grad_(grad)
    return q, k, v, do


def _fla_forward(q, k, v):
    """flash-linear-attention's chunked kernel on copies of q, k, v in its (B, T, H, D) layout,
    made once, outside the timed calls; returns o in our (B, H, T, D) layout (a free view)."""
    try:
        from fla.ops.linear_attn import chunk_linear_attn
    except Exception as e:  # not installed, or no GPU build
        raise Skip(f"fla not importable ({type(e).__name__})")
    qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_(x.requires_grad) for x in (q, k, v))

    def run():
        qt.grad = kt.grad = vt.grad = None
        out = chunk_linear_attn(qt, kt, vt, scale=1.0, normalize=True)  # our features are unscaled
        o = out[0] if isinstance(out, tuple) else out
        return o.transpose(1, 2)

    return run


def provider_forward(name: str, q, k, v, *, chunk_size: int, max_quadratic_bytes: float) -> Callable[[], torch.Tensor]:
    """A zero-argument callable running provider `name`'s forward on q, k, v (or Skip)."""
    B, H, T, D = q.shape
    if name == "linattn-torch":
        return lambda: linear_attention(q, k, v, chunk_size=chunk_size, backend="torch")
    if name == "linattn-triton":
        if not q.is_cuda:
            raise Skip("needs CUDA (on CPU the Triton backend is the interpreter)")
        from ..core.triton_ops import triton_available

        if not triton_available():
            raise Skip("triton kernels not available")
        return lambda: linear_attention(q, k, v, chunk_size=chunk_size, backend="triton")
    if name == "naive-quadratic":
        need = B * H * T * T * q.element_size() * 3  # scores, mask, product
        if need > max_quadratic_bytes:
            raise Skip(f"T x T matrices need ~{need / 2**30:.1f} GiB")
        return lambda: linear_attention(q, k, v, form="quadratic")
    if name == "sdpa":
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if name == "fla":
        if not q.is_cuda:
            raise Skip("needs CUDA")
        return _fla_forward(q, k, v)
    raise ValueError(f"bench: unknown provider {name!r}; expected one of {', '.join(PROVIDERS)}")


def provider_call(name, mode, q, k, v, do, *, chunk_size, max_quadratic_bytes=2**31):
    """The callable to time: forward only, or forward + backward (gradients reset each call)."""
    fwd = provider_forward(name, q, k, v, chunk_size=chunk_size, max_quadratic_bytes=max_quadratic_bytes)
    if mode == "fwd":
        return fwd
    if name == "naive-quadratic":  # autograd keeps several T x T matrices
        B, H, T, _ = q.shape
        if B * H * T * T * q.element_size() * 6 > max_quadratic_bytes:
            raise Skip("backward of the T x T form does not fit the memory limit")

    def fwd_bwd():
        fwd().backward(do)
        q.grad = k.grad = v.grad = None

    return fwd_bwd


# --------------------------------------------------------------------------------------
# sweep: every provider, side by side
# --------------------------------------------------------------------------------------


@dataclass
class SweepConfig:
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


def _own_chunk(name: str, D: int, dtype: torch.dtype, device) -> Optional[int]:
    """The chunk length a kernel provider really uses: the Triton launcher's config (CUDA only:
    Triton is never imported without it), or fla's 64."""
    if name == "fla":
        return 64
    if name == "linattn-triton" and torch.device(device).type == "cuda":
        from ..core.triton_ops import _load_kernels

        K = _load_kernels()
        return None if K is None else K.select_config("chunk_fwd", D, dtype, device)["BT"]
    return None


def run_sweep(cfg: SweepConfig, *, progress: bool = True) -> list[dict]:
    """Time every (T, D, mode) for every provider -- the chunked ones at every chunk size --
    measured side by side; one record per measurement (or per skip, with the reason)."""
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
                rec["times_s"] = cpu_time(call, warmup=1, repeats=1, budget_s=cfg.budget_s)
            for _ in range(cfg.repeats - 1):
                for rec, call in runs:
                    if sum(rec["times_s"]) < cfg.budget_s:  # slow providers get fewer repeats
                        rec["times_s"] += cpu_time(call, warmup=0, repeats=1)
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
    keys = sorted({(r["T"], r["D"], r["chunk_size"] or 0, r["mode"]) for r in records if r["chunk_size"]})
    if not keys:  # no chunked provider in this sweep
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


def plot_sweep(records: list[dict], path: Path, title: str) -> Optional[Path]:
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
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------
# the CPU targets
# --------------------------------------------------------------------------------------


def measure_memory_subprocess(B, H, T, D, chunk_size, *, timeout_s: float = 600) -> dict:
    """fwd+bwd peak memory of linattn-torch, measured in a fresh Python process (see _memory_probe)."""
    cmd = [sys.executable, "-m", MODULE, "_memory", "--B", str(B), "--H", str(H), "--T", str(T),
           "--D", str(D), "--chunk-size", str(chunk_size)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"bench: memory probe failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _rss_bytes() -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _memory_probe(B, H, T, D, chunk_size) -> dict:
    """In a fresh process: the resident-set peak of one fwd+bwd of linattn-torch.

    Counted: everything the process holds at the peak above the interpreter with torch loaded
    and warmed up -- q, k, v and the output gradient do (the inputs, 4 tensors), then what
    fwd+bwd adds: o, dq, dk, dv, the tensors saved for the backward, and every temporary.
    Large tensors are mmap'ed and returned to the OS on free, so RSS tracks tensor memory.
    """
    import gc

    small = make_inputs(1, 1, 64, D, grad=True)
    linear_attention(*small[:3], chunk_size=chunk_size).backward(small[3])  # warm-up: lazy inits
    del small
    gc.collect()
    base = _rss_bytes()
    q, k, v, do = make_inputs(B, H, T, D, grad=True)
    held = _rss_bytes()
    kept = {}

    def fwd_bwd():
        o = linear_attention(q, k, v, chunk_size=chunk_size)
        o.backward(do)
        kept["o"] = o

    delta = peak_memory_bytes(fwd_bwd)  # peak above `held`, reset just before
    tensor = q.numel() * q.element_size()
    return dict(
        B=B, H=H, T=T, D=D, chunk_size=chunk_size,
        tensor_bytes=tensor,
        qkvo_bytes=4 * tensor,
        inputs_rss_bytes=None if base is None or held is None else held - base,
        fwd_bwd_peak_bytes=delta,
        total_peak_bytes=None if delta is None or base is None else held - base + delta,
    )


def chunk_matmuls_only(q, k, v, *, chunk_size: int) -> Callable[[], torch.Tensor]:
    """The four matmuls of the torch path's forward, and nothing else: a ceiling for it.

    The same bmm calls on the same shapes and the same blocks as `torch_chunked._forward_block`
    with normalize=True (k^T v', q E, q k^T and A v', with v' = [v, 1] built once, outside the
    timing), writing into a freshly allocated output as every forward must -- but no scan (q
    multiplies the chunk's own increment), no mask, no division, no copies. Its FLOP/s is what
    the chunked algorithm's matmuls reach on this machine at these sizes, so no implementation
    built from these calls can beat it; the targets table reports linattn-torch against it.
    """
    from ..core.torch_chunked import BLOCK_TOKENS, _blocks, _prepare, _Workspace

    B, H, T, D = q.shape
    C = min(chunk_size, T)
    qc, kc, vc, _, N = _prepare(q, k, v, None, C)
    va = torch.cat([vc, vc.new_ones(vc.shape[:-1] + (1,))], dim=-1)
    G0, Dva = B * H * N, va.shape[-1]

    def run():
        out = qc.new_empty(G0, C, Dva)
        ws = _Workspace(qc)
        for h0, h1, ranges in _blocks(B * H, N, max(1, BLOCK_TOKENS // C)):
            for n0, n1 in ranges:
                rows = slice(h0 * N + n0, (h1 - 1) * N + n1)
                q_, k_, v_ = qc[rows], kc[rows], va[rows]
                G = q_.shape[0]
                inc = torch.bmm(k_.transpose(1, 2), v_, out=ws("inc", G, D, Dva))
                y = torch.bmm(q_, inc, out=out[rows])
                A = torch.bmm(q_, k_.transpose(1, 2), out=ws("A", G, C, C))
                y.baddbmm_(A, v_)
        return out

    return run


def run_targets(*, B, H, T, D, chunk_size, rounds, growth_T, memory_T, matmul_n, progress=True) -> dict:
    """Measure the four CPU targets side by side in this one process (memory: a child process)."""
    res: dict = dict(shape=dict(B=B, H=H, T=T, D=D), chunk_size=chunk_size, rounds=rounds)
    steps = progress_bar(range(4), desc="bench targets", enabled=progress)
    it = iter(steps)

    # 1 + 2. forward: linattn-torch, sdpa and a big matmul, in interleaved rounds
    next(it, None)
    q, k, v, _ = make_inputs(B, H, T, D)
    alt_chunk = 128 if chunk_size != 128 else 64  # for information: the other usual chunk size
    lin = provider_forward("linattn-torch", q, k, v, chunk_size=chunk_size, max_quadratic_bytes=0)
    alt = provider_forward("linattn-torch", q, k, v, chunk_size=alt_chunk, max_quadratic_bytes=0)
    sdpa = provider_forward("sdpa", q, k, v, chunk_size=chunk_size, max_quadratic_bytes=0)
    floor = chunk_matmuls_only(q, k, v, chunk_size=chunk_size)

    def io_only():  # what any forward must do: read q, k and v once, write a freshly allocated o
        return q.sum() + k.sum() + v.sum(), torch.empty_like(v).fill_(0.0)
    a, b = torch.randn(matmul_n, matmul_n), torch.randn(matmul_n, matmul_n)
    mm = lambda: a @ b  # noqa: E731
    t_lin, t_alt, t_sdpa, t_mm, t_floor, t_io = [], [], [], [], [], []
    for fn in (lin, alt, sdpa, mm, floor, io_only):  # warm-up
        fn()
    for _ in range(rounds):
        t_mm += cpu_time(mm, warmup=0, repeats=1)
        for _ in range(3):  # the fast calls are measured more often: cheap, and steadier
            t_lin += cpu_time(lin, warmup=0, repeats=1)
            t_floor += cpu_time(floor, warmup=0, repeats=1)
            t_io += cpu_time(io_only, warmup=0, repeats=1)
            t_alt += cpu_time(alt, warmup=0, repeats=1)
        t_sdpa += cpu_time(sdpa, warmup=0, repeats=1)
        t_mm += cpu_time(mm, warmup=0, repeats=1)
    flops = chunked_forward_flops(B, H, T, D, D, chunk_size)
    res["forward"] = dict(
        linattn_s=statistics.median(t_lin), sdpa_s=statistics.median(t_sdpa), matmul_s=statistics.median(t_mm),
        linattn_times_s=t_lin, sdpa_times_s=t_sdpa, matmul_times_s=t_mm,
        linattn_flops=flops, matmul_flops=2 * matmul_n**3, matmul_n=matmul_n,
        alt_chunk_size=alt_chunk, alt_s=statistics.median(t_alt), alt_times_s=t_alt,
        alt_flops=chunked_forward_flops(B, H, T, D, D, alt_chunk),
        matmuls_only_s=statistics.median(t_floor), matmuls_only_times_s=t_floor,
        io_only_s=statistics.median(t_io), io_only_times_s=t_io,
    )
    f = res["forward"]
    f["speedup_vs_sdpa"] = f["sdpa_s"] / f["linattn_s"]
    f["linattn_flops_per_s"] = flops / f["linattn_s"]
    f["matmul_flops_per_s"] = 2 * matmul_n**3 / f["matmul_s"]
    f["matmul_fraction"] = f["linattn_flops_per_s"] / f["matmul_flops_per_s"]
    f["alt_matmul_fraction"] = f["alt_flops"] / f["alt_s"] / f["matmul_flops_per_s"]
    f["matmuls_only_fraction"] = flops / f["matmuls_only_s"] / f["matmul_flops_per_s"]
    f["linattn_vs_matmuls_only"] = f["matmuls_only_s"] / f["linattn_s"]
    del q, k, v, lin, alt, sdpa, floor, io_only, a, b

    # 3. fwd+bwd growth from T/4 to T, interleaved
    next(it, None)
    calls = {}
    for t in growth_T:
        qg, kg, vg, dog = make_inputs(B, H, t, D, grad=True)
        calls[t] = provider_call("linattn-torch", "fwd+bwd", qg, kg, vg, dog, chunk_size=chunk_size)
        calls[t]()
    times = {t: [] for t in growth_T}
    for _ in range(rounds):
        for t in growth_T:  # steady state at each length: one settling call, then two timed ones
            times[t] += cpu_time(calls[t], warmup=1, repeats=2)
    lo, hi = growth_T
    res["growth"] = dict(
        T=list(growth_T), times_s={str(t): times[t] for t in growth_T},
        median_s={str(t): statistics.median(times[t]) for t in growth_T},
    )
    res["growth"]["ratio"] = res["growth"]["median_s"][str(hi)] / res["growth"]["median_s"][str(lo)]
    res["growth"]["linear_ratio"] = hi / lo
    del calls

    # 4. fwd+bwd peak memory, in a fresh process
    next(it, None)
    res["memory"] = measure_memory_subprocess(B, H, memory_T, D, chunk_size)
    next(it, None)
    if hasattr(steps, "close"):
        steps.close()
    return res


def _verdict(ok: Optional[bool]) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def format_targets(res: dict, meta: dict) -> tuple[str, list[dict]]:
    f, g, m = res["forward"], res["growth"], res["memory"]
    s = res["shape"]
    C = res["chunk_size"]
    rows = []
    rows.append(dict(
        target=f"forward, T={s['T']}: sdpa(is_causal=True) time / linattn-torch time",
        measured=f"{f['sdpa_s'] * 1e3:.0f} ms / {f['linattn_s'] * 1e3:.1f} ms = {f['speedup_vs_sdpa']:.1f}x",
        goal=f">= {TARGET_SPEEDUP_VS_SDPA:g}x", ok=f["speedup_vs_sdpa"] >= TARGET_SPEEDUP_VS_SDPA,
    ))
    rows.append(dict(
        target=f"forward FLOP/s / fp32 matmul FLOP/s ({f['matmul_n']}^3)",
        measured=f"{f['linattn_flops_per_s'] / 1e9:.0f} / {f['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s "
                 f"= {100 * f['matmul_fraction']:.0f}%",
        goal=f">= {100 * TARGET_MATMUL_FRACTION:.0f}%", ok=f["matmul_fraction"] >= TARGET_MATMUL_FRACTION,
    ))
    lo, hi = g["T"]
    rows.append(dict(
        target=f"fwd+bwd time T={hi} / T={lo} (linear: {hi // lo})",
        measured=f"{g['median_s'][str(hi)] * 1e3:.1f} / {g['median_s'][str(lo)] * 1e3:.1f} ms = {g['ratio']:.2f}",
        goal=f"<= {TARGET_GROWTH:g}", ok=g["ratio"] <= TARGET_GROWTH,
    ))
    total, qkvo = m.get("total_peak_bytes"), m["qkvo_bytes"]
    mib = 2**20
    if total is None:
        rows.append(dict(target=f"fwd+bwd peak memory, T={m['T']}", measured="not measurable here",
                         goal=f"< {TARGET_MEMORY:g}x q,k,v,o", ok=None))
    else:
        rows.append(dict(
            target=f"fwd+bwd peak memory, T={m['T']} (everything held) / bytes(q,k,v,o)",
            measured=f"{total / mib:.0f} MiB / {qkvo / mib:.0f} MiB = {total / qkvo:.2f}x",
            goal=f"< {TARGET_MEMORY:g}x", ok=total < TARGET_MEMORY * qkvo,
        ))
    w = max(len(r["target"]) for r in rows)
    wm = max(len(r["measured"]) for r in rows)
    lines = [
        f"CPU targets -- {meta['hardware']}, torch {meta['torch_version']}, linattn_lib {meta['library_version']}",
        f"B={s['B']} H={s['H']} D={s['D']} float32, causal, normalize=True, no decay, chunk_size={C}; "
        f"{res['rounds']} interleaved rounds, medians; torch threads {meta['threads']}, "
        f"THP_MEM_ALLOC_ENABLE={(meta.get('environment') or {}).get('THP_MEM_ALLOC_ENABLE') or 'unset'}, "
        f"caches flushed before each timed call: {'yes' if meta.get('cpu_cache_flush') else 'no'}",
        "",
        f"{'target':{w}s}  {'measured':{wm}s}  {'goal':8s}  verdict",
        "-" * (w + wm + 22),
    ]
    for r in rows:
        lines.append(f"{r['target']:{w}s}  {r['measured']:{wm}s}  {r['goal']:8s}  {_verdict(r['ok'])}")
    lines += [
        "",
        "counted FLOPs: " + FLOPS_FORMULA,
        f"  here: C={C}, Dk=Dv={s['D']}: {f['linattn_flops'] / 1e9:.2f} GFLOP per forward.",
        f"for comparison, chunk_size={f['alt_chunk_size']}: forward {f['alt_s'] * 1e3:.1f} ms, "
        f"{f['alt_flops'] / 1e9:.2f} GFLOP, {100 * f['alt_matmul_fraction']:.0f}% of matmul FLOP/s "
        "(bigger chunks do more FLOPs: the masked half of larger C x C blocks).",
        "counted memory: peak resident set of a fresh process running one fwd+bwd, minus the same "
        "process before the inputs existed (torch loaded, warmed up). It includes q, k, v and do "
        f"({(m['inputs_rss_bytes'] or 0) / mib:.0f} MiB), o, dq, dk, dv, saved tensors and all temporaries "
        f"(fwd+bwd alone: {(m['fwd_bwd_peak_bytes'] or 0) / mib:.0f} MiB).",
        "why the forward stays below big-matmul speed on a CPU: its matmuls are small (C x D blocks), "
        "every block streams q, k, v and its C x C and Dk x Dv temporaries through the caches, and the "
        f"fresh output's pages are faulted in -- a {f['matmul_n']}^3 matmul has none of these costs. On a "
        "GPU at D=64 the chunked kernel is memory-bound (the sweep reports GB/s against the peak).",
    ]
    if "matmuls_only_s" in f:  # results written before this measurement existed lack it
        lines.append(
            f"ceiling: the forward's four matmul calls alone (same shapes and blocks, fresh output; no scan, "
            f"mask or division -- bench.chunk_matmuls_only) take {f['matmuls_only_s'] * 1e3:.1f} ms = "
            f"{100 * f['matmuls_only_fraction']:.0f}% of matmul FLOP/s; linattn-torch runs at "
            f"{100 * f['linattn_vs_matmuls_only']:.0f}% of that speed. Compulsory memory traffic alone "
            f"(read q, k, v; fill a fresh o) takes {f['io_only_s'] * 1e3:.1f} ms, where "
            f"{TARGET_MATMUL_FRACTION:.0%} of matmul FLOP/s would allow "
            f"{f['linattn_flops'] / (TARGET_MATMUL_FRACTION * f['matmul_flops_per_s']) * 1e3:.1f} ms in all."
        )
    return "\n".join(lines), rows


def plot_targets(res: dict, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f, g = res["forward"], res["growth"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    ax = axes[0]
    names = ["linattn-torch", "sdpa (causal)"]
    vals = [f["linattn_s"] * 1e3, f["sdpa_s"] * 1e3]
    ax.bar(names, vals, color=["C0", "C3"])
    ax.set(yscale="log", ylabel="forward time (ms)", title=f"forward, T={res['shape']['T']}")
    for i, val in enumerate(vals):
        ax.text(i, val, f"{val:.1f} ms", ha="center", va="bottom", fontsize=8)
    ax = axes[1]
    Ts = g["T"]
    ys = [g["median_s"][str(t)] * 1e3 for t in Ts]
    ax.plot(Ts, ys, marker="o", label="linattn-torch fwd+bwd")
    ax.plot(Ts, [ys[0] * t / Ts[0] for t in Ts], "--", color="gray", label="linear in T")
    ax.set(xscale="log", yscale="log", xlabel="T", ylabel="time (ms)", title="fwd+bwd growth")
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _names(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("what", nargs="?", default="targets", choices=("targets", "sweep", "_memory"),
                   help="targets (default): the CPU targets table; sweep: every provider side by side")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test that takes seconds")
    p.add_argument("--out", default="bench_results", help="folder for the JSON and PNG (default: bench_results/)")
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


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    if a.thp and os.environ.get("THP_MEM_ALLOC_ENABLE") != "1":
        # torch reads the variable once, at its first allocation: start again with it set
        env = dict(os.environ, THP_MEM_ALLOC_ENABLE="1")
        return subprocess.run([sys.executable, "-m", MODULE, *argv], env=env).returncode
    out = Path(a.out)
    if a.what == "_memory":  # internal: the child process of the memory target
        r = _memory_probe(a.B, a.H, a.T[0], a.D[0], a.chunk_size[0])
        print(json.dumps(r))
        return 0
    _FLUSH["enabled"] = not (a.no_flush or a.quick)
    meta = run_metadata(MODULE, argv)
    meta["environment"] = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "THP_MEM_ALLOC_ENABLE", "MKL_NUM_THREADS")}
    meta["cpu_cache_flush"] = _FLUSH["enabled"]
    progress = not a.no_progress

    if a.what == "sweep":
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
        meta["hardware"] = device_name(device)
        records = run_sweep(cfg, progress=progress)
        table = format_sweep(records, cfg.providers, device == "cuda")
        print(f"linear attention benchmark -- {meta['hardware']}, torch {meta['torch_version']}, "
              f"linattn_lib {meta['library_version']}; B={cfg.B} H={cfg.H} {cfg.dtype}, causal")
        print(table)
        stem = f"sweep-{device}" + ("-quick" if a.quick else "")
        payload = dict(meta, config=cfg.__dict__, records=records, table=table)
        path = write_json(out / f"{stem}.json", payload)
        print(f"wrote {path}")
        if not a.no_plot:
            print(f"wrote {plot_sweep(records, out / f'{stem}.png', meta['hardware'])}")
        return 0

    # targets (CPU)
    if a.quick:
        B, H, T, D, C, rounds, growth_T, memory_T, mm_n = 1, 2, 512, 16, 16, 1, (128, 512), 1024, 128
    else:
        s = TARGET_SHAPE
        B, H, T, D, C, rounds = s["B"], s["H"], s["T"], s["D"], 64, 5
        growth_T, memory_T, mm_n = GROWTH_T, MEMORY_T, MATMUL_N
    B, H = a.B or B, a.H or H
    T, D, C = (a.T or [T])[0], (a.D or [D])[0], (a.chunk_size or [C])[0]
    rounds = a.repeats or rounds
    meta["hardware"] = device_name("cpu")
    res = run_targets(B=B, H=H, T=T, D=D, chunk_size=C, rounds=rounds, growth_T=growth_T,
                      memory_T=memory_T, matmul_n=mm_n, progress=progress)
    table, rows = format_targets(res, meta)
    if a.quick:
        table += "\n(--quick: tiny sizes, a smoke test -- the verdicts mean nothing at this size)"
    print(table)
    stem = "targets-cpu" + ("-quick" if a.quick else "")
    payload = dict(meta, config=dict(B=B, H=H, T=T, D=D, chunk_size=C, rounds=rounds, growth_T=list(growth_T),
                                     memory_T=memory_T, matmul_n=mm_n, quick=a.quick),
                   flops_formula=FLOPS_FORMULA, results=res,
                   targets=[dict(r, verdict=_verdict(r["ok"])) for r in rows], table=table)
    path = write_json(out / f"{stem}.json", payload)
    print(f"wrote {path}")
    if not a.no_plot:
        print(f"wrote {plot_targets(res, out / f'{stem}.png', meta['hardware'])}")
    failed = any(r["ok"] is False for r in rows)
    return 1 if (failed and a.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
