"""The GPU check's launch plan: every kernel launch it would make, compiled ahead of time for sm_90.

`record_plan()` runs the benchmark's, the profile's and the whole-op sweep's calls of ours
(`planned_calls`) on CPU stand-ins under
`launches.record_launches(stub=True)` (nothing runs; the launchers take the CUDA path: the
configs, grids and arguments of an H100/H200). `jit_job()` turns each recorded launch into
exactly what Triton's JIT would compile for it -- the JIT's own binder gives the
specialisation (dtypes, 16-byte alignment, integers divisible by 16 or equal to 1, the
constexprs) and its options -- so that `compile_jobs()` compiles each distinct one once with
`triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`, in a process pool, and
reads registers, spills and shared memory from the result.

Two uses: the dry run (`gpu_check --dry-run`, CI's rehearsal on a CPU) fails if any of them
does not compile under the installed Triton; on the GPU machine the same compiles fill
Triton's cache on all cores before the benchmark, so that the JIT finds them there (the cache
key is the same source, specialisation, options and target) instead of compiling one at a time.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .launches import Launch

TARGET = ("cuda", 90, 32)  # an H100 / H200
PLAN_SMS = 132


@contextlib.contextmanager
def bf16_as_on_cuda() -> Iterator[None]:
    """Within the block the Triton path takes bf16 CPU tensors as it takes CUDA ones: its refusal
    of bf16 on CPU (the interpreter has no bf16) is for running kernels, and nothing runs here.
    The check is called with a same-size fp16 view instead (shape, device and head-dim checks kept)."""
    from ..core import triton_ops

    original = triton_ops._check_inputs

    def check(fn, q, v):
        return original(fn, q.detach().view(torch.float16) if q.dtype == torch.bfloat16 else q, v)

    triton_ops._check_inputs = check
    try:
        yield
    finally:
        triton_ops._check_inputs = original


def _binder(fn, backend):
    from triton.runtime.jit import create_function_from_signature

    cache = fn.__dict__.setdefault("_linattn_plan_binders", {})
    if id(backend) not in cache:
        cache[id(backend)] = create_function_from_signature(fn.signature, fn.params, backend)
    return cache[id(backend)]


def jit_job(launch: Launch, backend: object) -> dict:
    """What `JITFunction.run` would compile for a recorded launch (Triton 3.x's own binder and
    `_pack_args`): {"kernel", "module", "signature", "constexprs", "attrs", "options", "key"};
    key: the JIT's in-memory cache key (specialisation and options), equal launches equal keys."""
    from triton import knobs

    fn = launch.fn
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", fn.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    bound, specialization, options = _binder(fn, backend)(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    plain = lambda v: v.value if hasattr(v, "value") and not isinstance(v, torch.Tensor) else v
    constexprs = {k: plain(v) for k, v in constexprs.items()}
    key = repr((fn.fn.__module__, fn.fn.__qualname__, specialization, sorted(options.__dict__.items())))
    return {"kernel": launch.name, "module": fn.fn.__module__, "qualname": fn.fn.__qualname__,
            "signature": signature, "constexprs": constexprs, "attrs": attrs, "options": options.__dict__,
            "key": key}


def record_plan(calls: Iterable[tuple[str, Callable[[], object]]], target: tuple = TARGET,
                sms: int = PLAN_SMS) -> tuple[list[dict], list[dict]]:
    """Run `calls` ((label, call) pairs on CPU tensors) with the launches recorded and stubbed out:
    (every launch as {"call", "kernel", "grid", "num_warps", "key"}, the distinct compile jobs)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    from .launches import record_launches

    backend = make_backend(GPUTarget(*target))
    launches, jobs = [], {}
    with bf16_as_on_cuda():
        for label, call in calls:
            with record_launches(stub=True, sm_count=sms, capability=(target[1] // 10, target[1] % 10)) as rec:
                call()
            for launch in rec:
                job = jit_job(launch, backend)
                jobs.setdefault(job["key"], dict(job, calls=0))["calls"] += 1
                launches.append({"call": label, "kernel": launch.name, "grid": list(launch.grid),
                                 "num_warps": job["options"].get("num_warps"),
                                 "num_stages": job["options"].get("num_stages"), "key": job["key"]})
    return launches, list(jobs.values())


def compile_job(job: dict, target: tuple = TARGET) -> dict:
    """Compile one job (in a worker process or here): ok, seconds, shared memory, registers and
    spills (cuobjdump, lazily: only a kernel with local memory is disassembled), or the error."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from ..chapters.kernel_anatomy import sass_stats
    from ..core.triton_ops import require_kernels

    require_kernels("gpu_check")  # maps kernels/ to linattn_lib.kernels in a source checkout
    out = {"key": job["key"], "kernel": job["kernel"]}
    t0 = time.perf_counter()
    try:
        fn = getattr(importlib.import_module(job["module"]), job["qualname"])
        src = ASTSource(fn, job["signature"], job["constexprs"], job["attrs"])
        compiled = triton.compile(src, target=GPUTarget(*target), options=job["options"])
        out.update(ok=True, shared=int(compiled.metadata.shared), num_warps=int(compiled.metadata.num_warps))
        stats = sass_stats(compiled.asm["cubin"], lazy=True) or {}
        out.update(registers=stats.get("registers"), spills=stats.get("spill_instructions"))
    except Exception as e:  # reported, and the dry run fails
        out.update(ok=False, error=f"{type(e).__name__}: {e}"[:1500])
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def compile_workers(limit: int | None = None) -> int:
    """The CPU cores this process may use (at most `limit`)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, limit or cores))


def compile_jobs(jobs: list[dict], workers: int | None = None, timeout: float | None = None) -> list[dict]:
    """Compile every job, slowest kinds first, on a pool of `workers` processes (spawned: no
    CUDA state is inherited); one result per job, in order. Jobs not done by `timeout` seconds
    are reported as such (ok False), their workers ended."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, wait

    workers = compile_workers(workers)
    if workers <= 1 or len(jobs) <= 1:
        return [compile_job(job) for job in jobs]
    order = sorted(range(len(jobs)), key=lambda i: -len(repr(jobs[i]["signature"])))
    pool = ProcessPoolExecutor(min(workers, len(jobs)), mp_context=multiprocessing.get_context("spawn"))
    futures = {i: pool.submit(compile_job, jobs[i]) for i in order}
    done, _ = wait(futures.values(), timeout=timeout)
    results = []
    for i, job in enumerate(jobs):
        f = futures[i]
        if f in done and f.exception() is None:
            results.append(f.result())
        else:
            why = f"not compiled within {timeout} s" if f not in done else f"worker failed: {f.exception()!r}"
            results.append({"key": job["key"], "kernel": job["kernel"], "ok": False, "error": why[:500]})
    for process in list(getattr(pool, "_processes", {}).values()) if len(done) < len(jobs) else ():
        process.terminate()
    pool.shutdown(wait=len(done) == len(jobs), cancel_futures=True)
    return results


def cache_dir() -> Path:
    """Triton's on-disk kernel cache (TRITON_CACHE_DIR, default ~/.triton/cache)."""
    from triton import knobs

    return Path(knobs.cache.dir)


def cached_kernels() -> set[str]:
    """The cache's entries as "<hash>/<kernel name>" (one per compiled kernel)."""
    root = cache_dir()
    return {f"{p.parent.name}/{p.stem}" for p in root.glob("*/*.json")
            if not p.name.startswith("__grp__")} if root.is_dir() else set()


def planned_calls() -> Iterator[tuple[str, Callable[[], object]]]:
    """The calls of ours the GPU check makes, on CPU stand-ins: the benchmark's and the profile's
    (`gpu_bench.plan_calls`), then the whole-op sweep's (`gpu_extras.override_plan_calls`)."""
    from .gpu_bench import plan_calls
    from .gpu_extras import override_plan_calls

    yield from plan_calls()
    yield from override_plan_calls()


def precompile(deadline: float, workers: int | None = None) -> dict:
    """The plan (`record_plan` of the benchmark's and the profile's calls of ours) compiled on
    `workers` processes until `deadline` (time.monotonic()), into Triton's cache: the JIT then
    loads these instead of compiling them one by one. Returns the counts, the failures and
    the cache's entries before (for `plan_misses`)."""
    t0 = time.perf_counter()
    launches, jobs = record_plan(planned_calls())
    recorded = time.perf_counter() - t0
    results = compile_jobs(jobs, workers, timeout=max(deadline - time.monotonic(), 1.0))
    failed = [r for r in results if not r.get("ok")]
    return {"launches": len(launches), "jobs": len(jobs), "compiled": len(jobs) - len(failed),
            "failed": [{"kernel": r["kernel"], "error": r.get("error", "")[:300]} for r in failed][:20],
            "record_s": round(recorded, 1), "compile_s": round(time.perf_counter() - t0 - recorded, 1),
            "workers": compile_workers(workers), "cache": str(cache_dir()),
            "kernels": sorted({j["kernel"] for j in jobs})}


def plan_misses(before: set[str], kernels: Iterable[str]) -> list[str]:
    """Cache entries of `kernels` (our kernel names) that appeared since `before`: what the JIT
    compiled because the plan did not hold it (each such entry a specialisation the dry run missed)."""
    names = set(kernels)
    return sorted(e.split("/", 1)[1] for e in cached_kernels() - before if e.split("/", 1)[1] in names)


def our_kernel_names() -> set[str]:
    """The names of every @triton.jit kernel of linattn_lib.kernels (as Triton's cache names them)."""
    from ..core.triton_ops import require_kernels

    K = require_kernels("gpu_check")
    return {getattr(fn, "fn", fn).__name__ for fn, _ in K.KERNELS.values()}
