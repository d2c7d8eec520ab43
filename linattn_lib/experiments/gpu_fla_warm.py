"""Compile fla's autotuning candidates on many cores before the benchmark times fla.

    python -m linattn_lib.experiments.gpu_fla_warm SLICE SLICES   (started by gpu_check, one per core)

fla autotunes its kernels on first use, compiling every candidate config (48 for its state
passes) one after another: minutes of a short GPU lease before the first fla row. fla's own
code is not changed for the measurement. Instead, before it, `SLICES` processes each run the
benchmark's fla calls once at a short sequence (T = `WARM_T`) with every fla autotuner
restricted to its slice of the configs (`configs[SLICE::SLICES]`), so that each candidate is
compiled once, by one of them, into Triton's on-disk cache. The benchmark's own process then
autotunes as fla always does -- every candidate timed at the real shape -- but finds each
compiled. This works because fla's kernels do not specialise on T (`do_not_specialize`) and
the workers use the benchmark's B, H and D (constexprs of fla's kernels);
a candidate the workers missed is simply compiled by the benchmark. FLA_CACHE_RESULTS=0 keeps
the workers' choices (from a slice, at a short T) out of the autotuning cache.
"""
from __future__ import annotations

import sys
from collections.abc import Iterator

import torch

WARM_T = 1024  # 16 chunks of 64: the chunk counts of every benchmark shape are multiples of 16 too


def warm_cases() -> list[tuple[int, int, int, str]]:
    """(B, H, D, variant) of every distinct fla specialisation the benchmark calls, in its order."""
    from .gpu_bench import benchmark_cases

    # B and H are constexprs of some of fla's kernels (its cumsums take B, most take H): kept exact
    return list(dict.fromkeys((c.B, c.H, c.D, c.variant) for c in benchmark_cases(("fla",))))


def fla_autotuners() -> list:
    """Every Triton autotuner in the loaded fla modules (each once, found through the heuristics
    that wrap some of them)."""
    from triton.runtime.autotuner import Autotuner

    found: dict[int, Autotuner] = {}
    for name, module in list(sys.modules.items()):
        if not name.startswith("fla.") or module is None:
            continue
        for obj in list(vars(module).values()):
            while obj is not None and id(obj) not in found:
                if isinstance(obj, Autotuner):
                    found[id(obj)] = obj
                obj = getattr(obj, "fn", None) if hasattr(obj, "run") else None
    return list(found.values())


def slice_autotuners(index: int, slices: int) -> int:
    """Restrict every fla autotuner (`fla_autotuners`) to its slice of configs (the first config
    where the slice is empty); returns how many autotuners were restricted."""
    tuners = fla_autotuners()
    for tuner in tuners:
        tuner.configs = tuner.configs[index::slices] or tuner.configs[:1]
    return len(tuners)


def _config(cfg) -> dict:
    return dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def autotuned() -> dict:
    """What fla's autotuners chose in this process: {"chosen": one row per kernel and key,
    {"kernel", "key" (the key's values by name, then its tensors' dtypes, as Triton's autotuner
    forms it), "config" (constexprs, num_warps, num_stages)}, "timings": kernel -> every
    candidate's ms as its last tuning timed them at its shape, fastest first}. Empty before fla
    has run."""
    chosen, timings = [], {}
    ms = lambda t: round(float(t[0] if isinstance(t, (list, tuple)) else t), 4)
    for tuner in fla_autotuners():
        name = getattr(getattr(tuner, "base_fn", None), "__name__", "?")
        names = [k for k in tuner.keys if k in tuner.arg_names]
        for key, cfg in getattr(tuner, "cache", {}).items():
            keys = key if isinstance(key, tuple) else (key,)
            chosen.append({"kernel": name, "config": _config(cfg), "key": {
                **dict(zip(names, map(str, keys))), "dtypes": [str(k) for k in keys[len(names):]]}})
        if getattr(tuner, "configs_timings", None):
            timings[name] = sorted(({"config": _config(c), "ms": ms(t)} for c, t in tuner.configs_timings.items()),
                                   key=lambda r: r["ms"])
    return {"chosen": sorted(chosen, key=lambda r: r["kernel"]), "timings": timings}


def warm(index: int, slices: int, hopper_refuses_gated_backward: bool) -> Iterator[str]:
    """Run each of `warm_cases` forward and backward (fla's gated backward not where fla refuses it),
    yielding a line as each is done: a worker ended at its deadline still says how far it got
    (the first GPU run's workers, printing at the end, said nothing)."""
    import fla.ops.linear_attn  # noqa: F401  (loads the modules whose autotuners are sliced)
    import fla.ops.retention  # noqa: F401
    import fla.ops.simple_gla  # noqa: F401

    from .gpu_bench import VARIANTS, fla_call, fwd_bwd, make_inputs

    slice_autotuners(index, slices)
    for B, H, D, variant in warm_cases():
        v = VARIANTS[variant]
        x = make_inputs(B, WARM_T, H, D, v, "cuda")
        call, leaves, do = fla_call(x, v)
        try:
            with torch.no_grad():
                call()
            if not (v.decay == "token" and hopper_refuses_gated_backward):
                fwd_bwd(call, leaves, do)()
            torch.cuda.synchronize()
            yield f"{variant} B={B} H={H} D={D}"
        except Exception as e:  # reported; the benchmark will meet it again and record it
            yield f"{variant} B={B} H={H} D={D}: {type(e).__name__}: {e}"[:300]


def main(argv: list[str] | None = None) -> int:
    """Warm one slice; prints what it ran."""
    import argparse

    from .gpu_bench import fla_refuses_gated_backward

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("index", type=int, metavar="SLICE", help="this worker's slice, 0 .. SLICES - 1")
    parser.add_argument("slices", type=int, metavar="SLICES", help="how many workers share the configs")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    index, slices = args.index, args.slices
    for line in warm(index, slices, fla_refuses_gated_backward()):
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def start_workers(slices: int) -> list:
    """Start `slices` warm-up processes (python -m this module), FLA_CACHE_RESULTS=0, each writing
    to a temporary file (a pipe nobody reads could fill and stall it)."""
    import os
    import subprocess
    import tempfile

    env = dict(os.environ, FLA_CACHE_RESULTS="0", PYTHONUNBUFFERED="1")
    procs = []
    for i in range(slices):
        log = tempfile.TemporaryFile(mode="w+")
        procs.append((subprocess.Popen([sys.executable, "-m", __name__, str(i), str(slices)], env=env,
                                       stdout=log, stderr=subprocess.STDOUT), log))
    return procs


def finish_workers(procs: list, deadline: float) -> dict:
    """Wait for the warm-up processes until `deadline` (time.monotonic()), end the rest; what they did."""
    import subprocess
    import time

    out = {"workers": len(procs), "finished": 0, "ended_at_deadline": 0, "last_lines": []}
    for proc, log in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            out["finished"] += proc.returncode == 0
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            out["ended_at_deadline"] += 1
        log.seek(0)
        out["last_lines"].append(log.read()[-2000:].strip().splitlines()[-3:])
        log.close()
    out["last_lines"] = out["last_lines"][:4]
    return out
