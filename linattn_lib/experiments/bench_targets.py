"""The CPU targets of the benchmark: four measurements side by side, their table and plot.

Run through the benchmark's CLI (``python -m linattn_lib.experiments.bench``, the default
``targets``); this module measures (`run_targets`), judges and formats (`format_targets`) and
draws (`plot_targets`). At B=1, H=8, T=16384, D=64, fp32, causal, normalised:

* forward time of sdpa(is_causal=True) / forward time of linattn-torch >= 16;
* forward FLOP/s (`flops.chunked_forward_flops` / time) >= 50% of one big fp32 matmul's;
* fwd+bwd time(T) / time(T/4) <= 4.6 (4 is exactly linear);
* fwd+bwd peak memory, measured in a fresh process, < 4x the bytes of q, k, v and o;
* forward time of fla's torch reference (`naive_chunk_linear_attn`, normalised) / forward time
  of linattn-torch >= 2, when fla-core is installed (`make install` installs it), else n/a.

``python -m linattn_lib.experiments.bench_targets B H T D C`` is the fresh process of the
memory target (internal: it prints one JSON line).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from ..core.linear import linear_attention
from ..core.torch_chunked import BLOCK_TOKENS, _blocks, _prepare, _Workspace
from ..flops import FLOPS_FORMULA, chunked_forward_flops, io_bytes, matmul_flops
from ..measure import peak_memory_bytes, rss_bytes, timed_calls
from .bench_providers import Skip, make_inputs, provider_call, provider_forward
from .common import progress_bar, save_figure

PROBE_MODULE = "linattn_lib.experiments.bench_targets"

# The CPU targets: (B, H, T, D) and what must hold, measured side by side in one run.
TARGET_SHAPE = dict(B=1, H=8, T=16384, D=64)
TARGET_SPEEDUP_VS_SDPA = 16.0  # forward time of sdpa(is_causal=True) / forward time of linattn-torch
TARGET_MATMUL_FRACTION = 0.50  # forward FLOP/s / FLOP/s of one big fp32 matmul
TARGET_GROWTH = 4.6  # fwd+bwd time(T) / time(T/4): 4 is exactly linear
TARGET_MEMORY = 4.0  # fwd+bwd peak memory / bytes of q, k, v and o
TARGET_SPEEDUP_VS_FLA_NAIVE = 2.0  # forward time of fla's naive_chunk_linear_attn / linattn-torch
GROWTH_T = (4096, 16384)
MEMORY_T = 65536
MATMUL_N = 2048


# --------------------------------------------------------------------------------------
# memory, in a fresh process
# --------------------------------------------------------------------------------------


def measure_memory_subprocess(B: int, H: int, T: int, D: int, chunk_size: int, *, timeout_s: float = 600) -> dict:
    """fwd+bwd peak memory of linattn-torch, measured in a fresh Python process (see _memory_probe)."""
    cmd = [sys.executable, "-m", PROBE_MODULE, *(str(x) for x in (B, H, T, D, chunk_size))]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"bench: memory probe failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _memory_probe(B: int, H: int, T: int, D: int, chunk_size: int) -> dict:
    """In a fresh process: the resident-set peak of one fwd+bwd of linattn-torch.

    Counted: everything the process holds at the peak above the interpreter with torch loaded
    and warmed up -- q, k, v and the output gradient do (the inputs, 4 tensors), then what
    fwd+bwd adds: o, dq, dk, dv, the tensors saved for the backward, and every temporary.
    Large tensors are mmap'ed and returned to the OS on free, so RSS tracks tensor memory.
    """
    small = make_inputs(1, 1, 64, D, grad=True)
    linear_attention(*small[:3], chunk_size=chunk_size).backward(small[3])  # warm-up: lazy inits
    del small
    gc.collect()
    base = rss_bytes()
    q, k, v, do = make_inputs(B, H, T, D, grad=True)
    held = rss_bytes()
    kept = {}

    def fwd_bwd():
        o = linear_attention(q, k, v, chunk_size=chunk_size)
        o.backward(do)
        kept["o"] = o

    delta = peak_memory_bytes(fwd_bwd)  # peak above `held`, reset just before
    return dict(
        B=B, H=H, T=T, D=D, chunk_size=chunk_size,
        tensor_bytes=q.numel() * q.element_size(),
        qkvo_bytes=io_bytes(B, H, T, D, D, q.element_size()),
        inputs_rss_bytes=None if base is None or held is None else held - base,
        fwd_bwd_peak_bytes=delta,
        total_peak_bytes=None if delta is None or base is None else held - base + delta,
    )


# --------------------------------------------------------------------------------------
# the forward's matmuls alone: a ceiling
# --------------------------------------------------------------------------------------


def chunk_matmuls_only(q: Tensor, k: Tensor, v: Tensor, *, chunk_size: int) -> Callable[[], Tensor]:
    """The four matmuls of the torch path's forward, and nothing else: a ceiling for it.

    The same bmm calls on the same shapes and the same blocks as `torch_chunked._forward_block`
    with normalize=True (k^T v', q E, q k^T and A v', with v' = [v, 1] built once, outside the
    timing), writing into a freshly allocated output as every forward must -- but no scan (q
    multiplies the chunk's own increment), no mask, no division, no copies. Its FLOP/s is what
    the chunked algorithm's matmuls reach on this machine at these sizes, so no implementation
    built from these calls can beat it; the targets table reports linattn-torch against it.
    It reuses torch_chunked's private blocking (`_prepare`, `_blocks`, `_Workspace`,
    `BLOCK_TOKENS`) so that the blocks are exactly the torch path's.
    """
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


# --------------------------------------------------------------------------------------
# measuring the targets
# --------------------------------------------------------------------------------------


def _forward_calls(q: Tensor, k: Tensor, v: Tensor, chunk_size: int, alt_chunk: int,
                   matmul_n: int) -> dict[str, Callable[[], object]]:
    """The six forward-section calls: linattn-torch at two chunk sizes, sdpa, a big matmul,
    the matmuls-only ceiling and the compulsory memory traffic."""
    def io_only():  # what any forward must do: read q, k and v once, write a freshly allocated o
        return q.sum() + k.sum() + v.sum(), torch.empty_like(v).fill_(0.0)

    a, b = torch.randn(matmul_n, matmul_n), torch.randn(matmul_n, matmul_n)
    try:
        fla = dict(fla=provider_forward("fla-naive", q, k, v, chunk_size=chunk_size, max_quadratic_bytes=0))
    except Skip:
        fla = {}
    return fla | dict(
        lin=provider_forward("linattn-torch", q, k, v, chunk_size=chunk_size, max_quadratic_bytes=0),
        alt=provider_forward("linattn-torch", q, k, v, chunk_size=alt_chunk, max_quadratic_bytes=0),
        sdpa=provider_forward("sdpa", q, k, v, chunk_size=chunk_size, max_quadratic_bytes=0),
        mm=lambda: a @ b,
        floor=chunk_matmuls_only(q, k, v, chunk_size=chunk_size),
        io=io_only,
    )


def _time_forward(calls: dict[str, Callable[[], object]], rounds: int, flush_caches: bool) -> dict[str, list[float]]:
    """Interleaved rounds (the fast calls three times per round: cheap, and steadier), after one
    warm-up call of each; a noisy neighbour then slows every call alike."""
    def once(name):
        return timed_calls(calls[name], warmup=0, repeats=1, device="cpu", flush_caches=flush_caches)

    slow = [name for name in ("sdpa", "fla") if name in calls]  # fla: when it is installed
    for name in calls:  # warm-up
        calls[name]()
    t = {name: [] for name in calls}
    for _ in range(rounds):
        t["mm"] += once("mm")
        for _ in range(3):
            for name in ("lin", "floor", "io", "alt"):
                t[name] += once(name)
        for name in slow:
            t[name] += once(name)
        t["mm"] += once("mm")
    return t


def _forward_results(t: dict[str, list[float]], flops: int, alt_flops: int, alt_chunk: int, matmul_n: int) -> dict:
    """Medians, FLOP/s and the ratios the targets judge, from `_time_forward`'s times."""
    med = {name: statistics.median(ts) for name, ts in t.items()}
    mm_flops = matmul_flops(matmul_n, matmul_n, matmul_n)
    f = dict(
        linattn_s=med["lin"], sdpa_s=med["sdpa"], matmul_s=med["mm"],
        linattn_times_s=t["lin"], sdpa_times_s=t["sdpa"], matmul_times_s=t["mm"],
        linattn_flops=flops, matmul_flops=mm_flops, matmul_n=matmul_n,
        alt_chunk_size=alt_chunk, alt_s=med["alt"], alt_times_s=t["alt"],
        alt_flops=alt_flops,
        matmuls_only_s=med["floor"], matmuls_only_times_s=t["floor"],
        io_only_s=med["io"], io_only_times_s=t["io"],
    )
    f["speedup_vs_sdpa"] = f["sdpa_s"] / f["linattn_s"]
    f["linattn_flops_per_s"] = flops / f["linattn_s"]
    f["matmul_flops_per_s"] = mm_flops / f["matmul_s"]
    f["matmul_fraction"] = f["linattn_flops_per_s"] / f["matmul_flops_per_s"]
    f["alt_matmul_fraction"] = f["alt_flops"] / f["alt_s"] / f["matmul_flops_per_s"]
    f["matmuls_only_fraction"] = flops / f["matmuls_only_s"] / f["matmul_flops_per_s"]
    f["linattn_vs_matmuls_only"] = f["matmuls_only_s"] / f["linattn_s"]
    if "fla" in t:
        f.update(fla_naive_s=med["fla"], fla_naive_times_s=t["fla"], speedup_vs_fla_naive=med["fla"] / med["lin"])
    return f


def _measure_forward(B: int, H: int, T: int, D: int, chunk_size: int, rounds: int, matmul_n: int,
                     flush_caches: bool) -> dict:
    """Targets 1 and 2: linattn-torch, sdpa and a big matmul, forward, in interleaved rounds."""
    q, k, v, _ = make_inputs(B, H, T, D)
    alt_chunk = 128 if chunk_size != 128 else 64  # for information: the other usual chunk size
    calls = _forward_calls(q, k, v, chunk_size, alt_chunk, matmul_n)
    t = _time_forward(calls, rounds, flush_caches)
    return _forward_results(t, chunked_forward_flops(B, H, T, D, D, chunk_size),
                            chunked_forward_flops(B, H, T, D, D, alt_chunk), alt_chunk, matmul_n)


def _measure_growth(B: int, H: int, D: int, chunk_size: int, rounds: int, growth_T: tuple[int, int],
                    flush_caches: bool) -> dict:
    """Target 3: fwd+bwd time from T/4 to T, interleaved."""
    calls = {}
    for t in growth_T:
        qg, kg, vg, dog = make_inputs(B, H, t, D, grad=True)
        calls[t] = provider_call("linattn-torch", "fwd+bwd", qg, kg, vg, dog, chunk_size=chunk_size)
        calls[t]()
    times = {t: [] for t in growth_T}
    for _ in range(rounds):
        for t in growth_T:  # steady state at each length: one settling call, then two timed ones
            times[t] += timed_calls(calls[t], warmup=1, repeats=2, device="cpu", flush_caches=flush_caches)
    lo, hi = growth_T
    g = dict(
        T=list(growth_T), times_s={str(t): times[t] for t in growth_T},
        median_s={str(t): statistics.median(times[t]) for t in growth_T},
    )
    g["ratio"] = g["median_s"][str(hi)] / g["median_s"][str(lo)]
    g["linear_ratio"] = hi / lo
    return g


def run_targets(
    *, B: int, H: int, T: int, D: int, chunk_size: int, rounds: int, growth_T: tuple[int, int], memory_T: int,
    matmul_n: int, progress: bool = True, flush_caches: bool = True,
) -> dict:
    """Measure the CPU targets side by side in this one process (memory: a child process).

    flush_caches: flush the CPU caches before each timed call (`measure.flush_cpu_caches`).
    """
    res: dict = dict(shape=dict(B=B, H=H, T=T, D=D), chunk_size=chunk_size, rounds=rounds)
    steps = progress_bar(range(4), desc="bench targets", enabled=progress)
    it = iter(steps)
    next(it, None)
    res["forward"] = _measure_forward(B, H, T, D, chunk_size, rounds, matmul_n, flush_caches)
    next(it, None)
    res["growth"] = _measure_growth(B, H, D, chunk_size, rounds, growth_T, flush_caches)
    next(it, None)
    res["memory"] = measure_memory_subprocess(B, H, memory_T, D, chunk_size)
    next(it, None)
    if hasattr(steps, "close"):
        steps.close()
    return res


# --------------------------------------------------------------------------------------
# the table
# --------------------------------------------------------------------------------------


def verdict(ok: bool | None) -> str:
    """"PASS", "FAIL", or "n/a" when a target could not be measured (ok is None)."""
    return "n/a" if ok is None else ("PASS" if ok else "FAIL")


def _target_rows(res: dict) -> list[dict]:
    """One row per target: what is measured, the measurement, the goal and whether it is met."""
    f, g, m, s = res["forward"], res["growth"], res["memory"], res["shape"]
    rows = [dict(
        target=f"forward, T={s['T']}: sdpa(is_causal=True) time / linattn-torch time",
        measured=f"{f['sdpa_s'] * 1e3:.0f} ms / {f['linattn_s'] * 1e3:.1f} ms = {f['speedup_vs_sdpa']:.1f}x",
        goal=f">= {TARGET_SPEEDUP_VS_SDPA:g}x", ok=f["speedup_vs_sdpa"] >= TARGET_SPEEDUP_VS_SDPA,
    ), dict(
        target=f"forward FLOP/s / fp32 matmul FLOP/s ({f['matmul_n']}^3)",
        measured=f"{f['linattn_flops_per_s'] / 1e9:.0f} / {f['matmul_flops_per_s'] / 1e9:.0f} GFLOP/s "
                 f"= {100 * f['matmul_fraction']:.0f}%",
        goal=f">= {100 * TARGET_MATMUL_FRACTION:.0f}%", ok=f["matmul_fraction"] >= TARGET_MATMUL_FRACTION,
    )]
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
    fla = f.get("speedup_vs_fla_naive")
    rows.append(dict(
        target=f"forward, T={s['T']}: fla naive_chunk_linear_attn time / linattn-torch time",
        measured="fla-core not installed" if fla is None else
        f"{f['fla_naive_s'] * 1e3:.0f} ms / {f['linattn_s'] * 1e3:.1f} ms = {fla:.1f}x",
        goal=f">= {TARGET_SPEEDUP_VS_FLA_NAIVE:g}x", ok=None if fla is None else fla >= TARGET_SPEEDUP_VS_FLA_NAIVE,
    ))
    return rows


def _target_notes(res: dict) -> list[str]:
    """What the table counts, and what bounds the forward on a CPU (the lines below the table)."""
    f, m, s, C = res["forward"], res["memory"], res["shape"], res["chunk_size"]
    mib = 2**20
    lines = [
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
            f"mask or division -- bench_targets.chunk_matmuls_only) take {f['matmuls_only_s'] * 1e3:.1f} ms = "
            f"{100 * f['matmuls_only_fraction']:.0f}% of matmul FLOP/s; linattn-torch runs at "
            f"{100 * f['linattn_vs_matmuls_only']:.0f}% of that speed. Compulsory memory traffic alone "
            f"(read q, k, v; fill a fresh o) takes {f['io_only_s'] * 1e3:.1f} ms, where "
            f"{TARGET_MATMUL_FRACTION:.0%} of matmul FLOP/s would allow "
            f"{f['linattn_flops'] / (TARGET_MATMUL_FRACTION * f['matmul_flops_per_s']) * 1e3:.1f} ms in all."
        )
    return lines


def format_targets(res: dict, meta: dict) -> tuple[str, list[dict]]:
    """The targets table (with its header and notes) and its rows, from `run_targets`'s results
    and the run's metadata."""
    s, C = res["shape"], res["chunk_size"]
    rows = _target_rows(res)
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
        lines.append(f"{r['target']:{w}s}  {r['measured']:{wm}s}  {r['goal']:8s}  {verdict(r['ok'])}")
    lines += [""] + _target_notes(res)
    return "\n".join(lines), rows


def plot_targets(res: dict, path: Path, title: str) -> Path:
    """Forward times (bar chart) and the fwd+bwd growth against a linear line, as a PNG at `path`."""
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
    return save_figure(fig, path, title)


def _probe_main(argv: list[str] | None = None) -> int:
    """The child process of `measure_memory_subprocess`: print `_memory_probe`'s result as JSON."""
    p = argparse.ArgumentParser(prog=f"python -m {PROBE_MODULE}",
                                description="internal: the fresh process of the bench's memory target")
    for name in ("B", "H", "T", "D", "chunk_size"):
        p.add_argument(name, type=int)
    a = p.parse_args(argv)
    print(json.dumps(_memory_probe(a.B, a.H, a.T, a.D, a.chunk_size)))
    return 0


if __name__ == "__main__":
    sys.exit(_probe_main())
