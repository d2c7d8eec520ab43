"""The GPU check rehearsed on a CPU: `python -m linattn_lib.experiments.gpu_check --dry-run`.

What CI runs (`make gpu-rehearsal`) in an environment like the GPU machine's (torch, the
GPU machine's Triton, numpy, einops, pytest; the project from source on PYTHONPATH, not
installed): every module the GPU run imports is imported; every kernel launch of ours that
the benchmark, the profiled forward+backward and the whole-op sweep of the extras make is
recorded (`gpu_plan.planned_calls`, `gpu_plan.record_plan`:
the launchers run on CPU stand-ins with the launches stubbed out, as on an H100/H200);
each distinct launch is compiled for sm_90 exactly as the JIT would specialise it, and the
performance model's per-launch predictions are made for the profiled call and paired with
the recorded launches. Nothing touches CUDA. Prints the launch list (kernel, grid, warps,
registers, spills, shared memory) and the time taken; exits 1 if any compile or the model
fails, 0 otherwise.
"""
from __future__ import annotations

import argparse
import importlib
import platform
import time

# every module the GPU run imports (a missing or broken one fails the rehearsal)
MODULES = ("linattn_lib", "linattn_lib.core.custom_ops", "linattn_lib.experiments.gpu_bench",
           "linattn_lib.experiments.gpu_sections", "linattn_lib.experiments.gpu_plan",
           "linattn_lib.experiments.gpu_extras", "linattn_lib.experiments.gpu_fla_warm",
           "linattn_lib.experiments.gpu_report", "linattn_lib.experiments.kernel_selftest",
           "linattn_lib.experiments.launches", "linattn_lib.chapters.perf_model", "linattn_lib.chapters.kernel_anatomy")


def _check_wheels(folder: str) -> str:
    """Install the carried wheels as the GPU run does and try to import fla (information only:
    fla's import may need a GPU)."""
    from .gpu_sections import fla_status, install_wheels

    res = install_wheels(folder)
    if res["status"] != "passed":
        return f"wheels: {res.get('reason')}"
    status = fla_status()
    found = f"fla {status['fla']}" if status.get("fla") else f"fla does not import here: {status.get('error')}"
    return f"wheels: {', '.join(res['wheels'])} installed by {res['method']}; {found}"


def launch_lines(launches: list[dict], results: dict) -> list[str]:
    """One line per recorded call: its launches (kernel, grid, warps)."""
    lines, by_call = [], {}
    for launch in launches:
        by_call.setdefault(launch["call"], []).append(launch)
    for call, ls in by_call.items():
        parts = [f"{x['kernel'].removesuffix('_kernel')}{tuple(x['grid'])}w{x['num_warps']}" for x in ls]
        lines.append(f"{call}: {len(ls)} launches: {' '.join(parts)}")
    return lines


def job_lines(jobs: list[dict], results: dict) -> list[str]:
    """One line per distinct compile: kernel, warps, stages, registers, spills, shared memory, seconds."""
    lines = [f"{'kernel':<26} {'launches':>8} {'warps':>5} {'stages':>6} {'regs':>5} {'spills':>6} {'smem':>7} {'s':>5}"]
    for job in sorted(jobs, key=lambda j: (j["kernel"], -j["calls"])):
        r = results[job["key"]]
        if not r.get("ok"):
            lines.append(f"{job['kernel']:<26} FAILED: {r.get('error', '')[:300]}")
            continue
        lines.append(f"{job['kernel']:<26} {job['calls']:>8} {job['options']['num_warps']:>5} "
                     f"{job['options']['num_stages']:>6} {r.get('registers') or '?':>5} {r.get('spills') or 0:>6} "
                     f"{r['shared']:>7} {r['seconds']:>5.1f}")
    return lines


def model_check(launches: list[dict]) -> tuple[list[str], bool]:
    """The model's per-launch predictions for the profiled call (gpu_check's first profile), paired
    with the launches recorded for it: lines to print, and whether the model ran."""
    from .gpu_bench import MAIN_D, MAIN_H, MAIN_T, PROFILED, Case
    from .gpu_sections import model_launches, pair_launches

    variant = PROFILED[0]
    label = f"{Case(2, MAIN_T, MAIN_H, MAIN_D, variant, 'ours: op').label} forward+backward"
    recorded = [{"name": x["kernel"], "us": 0.0} for x in launches if x["call"] == label]
    try:
        predicted = model_launches(variant, 2, MAIN_T, MAIN_H, MAIN_D)
    except Exception as e:
        return [f"model: FAILED: {type(e).__name__}: {e}"[:500]], False
    paired = pair_launches(recorded, predicted)
    triton = [p for p in paired if not p["kernel"].startswith("torch:")]
    unpaired = [p["kernel"] for p in triton if p["measured_us"] is None]
    lines = [f"model: {len(predicted)} launches predicted for '{label}', {sum(p['predicted_us'] for p in predicted):.0f} us; "
             f"{len(triton) - len(unpaired)} of its {len(triton)} Triton launches found among the {len(recorded)} recorded"
             + (f"; not recorded: {', '.join(unpaired)}" if unpaired else "")]
    return lines, True


def dry_run(args: argparse.Namespace) -> int:
    """The rehearsal; its exit status (0: everything imported, compiled and was predicted)."""
    t0 = time.perf_counter()
    for name in MODULES:
        importlib.import_module(name)
    import torch
    import triton

    from .gpu_plan import compile_jobs, compile_workers, planned_calls, record_plan

    print(f"gpu_check --dry-run: python {platform.python_version()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; imports {time.perf_counter() - t0:.1f} s", flush=True)
    print(_check_wheels(args.wheels), flush=True)
    t1 = time.perf_counter()
    launches, jobs = record_plan(planned_calls())
    t2 = time.perf_counter()
    print(f"recorded {len(launches)} launches ({len(jobs)} distinct compiles) in {t2 - t1:.1f} s", flush=True)
    results = {r["key"]: r for r in compile_jobs(jobs, args.workers)}
    t3 = time.perf_counter()
    print(f"compiled {len(jobs)} for sm_90 on {compile_workers(args.workers)} processes in {t3 - t2:.1f} s", flush=True)
    model, model_ok = model_check(launches)
    print("\n".join(launch_lines(launches, results) + [""] + job_lines(jobs, results) + [""] + model))
    failed = [r for r in results.values() if not r.get("ok")]
    if torch.cuda.is_initialized():
        print("gpu_check --dry-run: CUDA was initialised (it must not be)")
        failed.append({})
    print(f"gpu_check --dry-run: {len(jobs) - len(failed)} of {len(jobs)} compiled, model "
          f"{'ok' if model_ok else 'FAILED'}; {time.perf_counter() - t0:.1f} s in all (model {time.perf_counter() - t3:.1f} s)")
    return 1 if failed or not model_ok else 0
