"""Ahead-of-time compilation of every kernel config for every GPU target, without a GPU.

The interpreter (tests/test_kernels_interpret.py) checks what the kernels compute; it does not
check that they compile for a real GPU, nor that their tiles fit in shared memory: numpy has
neither registers nor shared memory. Triton can compile to a cubin with no GPU present:

    triton.compile(ASTSource(fn=kernel, signature=..., constexprs=...),
                   target=GPUTarget("cuda", 80, 32))

runs the whole pipeline (Triton IR -> GPU IR -> LLVM IR -> PTX -> cubin through ptxas) and
returns the shared memory the kernel needs in `.metadata.shared`. For every kernel, every
target in `TARGETS` and every config `select_config` can pick there, this test compiles the
kernel's heaviest variant (every feature switched on) and asserts that it fits the target:

    sm_75 (T4, Colab; fp16/fp32: no bf16 tensor cores)   64 KiB per block
    sm_80 (A100)                                         163 KiB
    sm_86 / sm_89 (RTX 30xx, A10 / RTX 40xx, L4)          99 KiB
    sm_90 (H100)                                         227 KiB

Inputs are compiled as bf16 and fp32 on sm_80+ (fp16 picks the same configs and lays them out
exactly like bf16: `test_fp16_lays_out_like_bf16` checks that on the heaviest configs), and
as fp16 and fp32 on sm_75.

The compilations run in a subprocess (this file run as a script) so that TRITON_INTERPRET=1
in the test environment cannot turn the kernels into interpreted ones, on a small process
pool (LINATTN_COMPILE_WORKERS, default: up to 2). Triton caches compiled kernels in
~/.triton/cache (or TRITON_CACHE_DIR), so a second run takes seconds.

`python tests/test_kernels_compile.py --table` prints the shared memory of every config per
target as a markdown table.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent

# fp16 on sm_80+ is covered by bf16 (same configs, same layout; see test_fp16_lays_out_like_bf16)
COMPILED_DTYPES = {"sm_75": ("fp16", "fp32"), "sm_80": ("bf16", "fp32"), "sm_86": ("bf16", "fp32"),
                   "sm_89": ("bf16", "fp32"), "sm_90": ("bf16", "fp32")}


def _kernels():
    """linattn_lib.kernels, installed or from this checkout."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from linattn_lib.core.triton_ops import kernels_import_error, load_kernels

    K = load_kernels()
    if K is None:
        raise ImportError(f"linattn_lib.kernels does not import: {kernels_import_error()}")
    return K


def compile_jobs(K) -> list[dict]:
    """One job per (kernel, target, dtype, config that select_config can pick there)."""
    jobs = []
    for kernel in K.KERNELS:
        for target in K.TARGETS:
            for dtype in COMPILED_DTYPES[target]:
                assert dtype in K.TARGET_DTYPES[target]
                for cfg in K.selectable_configs(kernel, target, dtype):
                    jobs.append({"kernel": kernel, "target": target, "dtype": dtype, "config": cfg})
    return jobs


def _compile_one(job: dict) -> dict:
    """Compile one job to cubin; runs in a worker process."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    K = _kernels()
    fn, spec = K.KERNELS[job["kernel"]]
    cfg = job["config"]
    signature, constexprs = spec(cfg, job["dtype"])
    t0 = time.perf_counter()
    result = dict(job)
    try:
        compiled = triton.compile(
            ASTSource(fn=fn, signature=signature, constexprs=constexprs),
            target=GPUTarget("cuda", int("".join(map(str, K.TARGETS[job["target"]]))), 32),
            options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]},
        )
        result.update(ok=True, shared=int(compiled.metadata.shared), cubin_bytes=len(compiled.asm["cubin"]))
        from linattn_lib.chapters.kernel_anatomy import sass_stats

        result["sass"] = sass_stats(compiled.asm["cubin"])  # None without cuobjdump
    except Exception as e:  # reported by the test, with the message
        result.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
    result["seconds"] = round(time.perf_counter() - t0, 2)
    return result


def _run_worker_pool(jobs: list[dict], workers: int) -> list[dict]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    if workers <= 1:
        return [_compile_one(j) for j in jobs]
    # Heaviest first, so that the pool does not end waiting on one long compile.
    order = sorted(range(len(jobs)), key=lambda i: not jobs[i]["kernel"].startswith("chunk"))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        done = dict(zip(order, pool.map(_compile_one, [jobs[i] for i in order])))
    return [done[i] for i in range(len(jobs))]


def run_compile_jobs(jobs: list[dict], timeout: float = 1500) -> list[dict]:
    """Compile `jobs` in a fresh Python process without TRITON_INTERPRET; returns results."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    workers = int(os.environ.get("LINATTN_COMPILE_WORKERS", min(2, os.cpu_count() or 1)))
    proc = subprocess.run(
        [sys.executable, str(HERE), "--worker", str(workers)],
        input=json.dumps(jobs), capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the compile worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def smem_table(results: list[dict], limits: dict) -> str:
    """Markdown table: shared memory (KiB) of each kernel/config/dtype per target."""
    targets = list(limits)
    rows = {}
    for r in results:
        cfg = r["config"]
        key = (r["kernel"], r["dtype"], ", ".join(f"{k}={v}" for k, v in cfg.items()))
        rows.setdefault(key, {})[r["target"]] = f"{r['shared'] / 1024:.1f}" if r.get("ok") else "FAIL"
    head = "| kernel | dtype | config | " + " | ".join(f"{t} (≤{limits[t] // 1024})" for t in targets) + " |"
    lines = [head, "|" + " --- |" * (3 + len(targets))]
    for (kernel, dtype, cfg), per in sorted(rows.items()):
        lines.append(f"| {kernel} | {dtype} | {cfg} | " + " | ".join(per.get(t, "") for t in targets) + " |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# the tests
# --------------------------------------------------------------------------------------

if __name__ != "__main__" and __name__ != "__mp_main__":
    import pytest

    pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:  # pragma: no cover
        pytest.skip(f"this Triton has no ahead-of-time compile API: {e}", allow_module_level=True)
    try:
        _K = _kernels()
    except ImportError as e:  # pragma: no cover
        pytest.skip(str(e), allow_module_level=True)

    GROUPS = [(kernel, target) for kernel in _K.KERNELS for target in _K.TARGETS]

    def _kernels_wanted(session) -> set:
        """The kernels the selected tests of this module need compiled (`-k chunk_state`
        compiles chunk_state only); every kernel when a test without a `kernel` needs them."""
        wanted = set()
        for item in session.items:
            module = getattr(item, "module", None)  # nbval's notebook cells have none
            if module is None or module.__name__ != __name__ or "compiled" not in getattr(item, "fixturenames", ()):
                continue
            params = getattr(getattr(item, "callspec", None), "params", {})
            wanted |= {params["kernel"]} if "kernel" in params else set(_K.KERNELS)
        return wanted

    @pytest.fixture(scope="module")
    def compiled(request) -> dict:
        wanted = _kernels_wanted(request.session)
        results = run_compile_jobs([j for j in compile_jobs(_K) if j["kernel"] in wanted])
        by_group: dict = {}
        for r in results:
            by_group.setdefault((r["kernel"], r["target"]), []).append(r)
        return by_group

    def test_every_config_in_the_table_is_compiled():
        """The compile jobs are exactly what the launchers can pick: every selectable config is
        compiled for its target, and no config in CONFIGS is unreachable (hence uncompiled)."""
        import torch

        jobs = compile_jobs(_K)
        for kernel, table in _K.CONFIGS.items():
            compiled_cfgs = [j["config"] for j in jobs if j["kernel"] == kernel]
            for cfg in table:
                assert cfg in compiled_cfgs, f"{kernel}: {cfg} is in CONFIGS but never compiled"
            for target, cap in _K.TARGETS.items():
                names = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
                for dtype in _K.TARGET_DTYPES[target]:
                    compiled_as = dtype if dtype in COMPILED_DTYPES[target] else "bf16"
                    here = [j["config"] for j in jobs if j["kernel"] == kernel and j["target"] == target and j["dtype"] == compiled_as]
                    for d in range(1, _K.MAX_HEAD_DIM + 1):
                        cfg = _K.select_config(kernel, d, names[dtype], cap)
                        assert cfg in table and cfg in here, (kernel, target, dtype, d, cfg)

    @pytest.mark.parametrize("kernel,target", GROUPS, ids=[f"{k}-{t}" for k, t in GROUPS])
    def test_compiles_and_fits_shared_memory(compiled, kernel, target):
        limit = _K.SMEM_LIMITS[target]
        results = compiled[(kernel, target)]
        assert results, f"nothing compiled for {kernel} on {target}"
        for r in results:
            what = f"{kernel} {r['dtype']} {r['config']} on {target}"
            assert r["ok"], f"{what} does not compile: {r.get('error')}"
            assert r["cubin_bytes"] > 0, f"{what}: empty cubin"
            assert r["shared"] <= limit, f"{what} needs {r['shared']} B of shared memory > {limit} B"

    # Spill instructions (STL/LDL) a selected config may have at head dims up to 128. The
    # first config table had 500-700 in every chunk kernel (and thousands in some fp32 ones);
    # the table in kernels/configs.py was chosen to remove them, and this keeps them out.
    SPILL_BUDGET = 32

    @pytest.mark.parametrize("kernel,target", GROUPS, ids=[f"{k}-{t}" for k, t in GROUPS])
    def test_configs_do_not_spill_at_usual_head_dims(compiled, kernel, target):
        results = [r for r in compiled[(kernel, target)] if r.get("ok")]
        if not results or results[0].get("sass") is None:
            pytest.skip("cuobjdump is not available to read the SASS")
        whole = _K.DIM_NAMES[kernel][0]
        for r in results:
            if r["config"][whole] <= 128:
                spills = r["sass"]["spill_instructions"]
                assert spills <= SPILL_BUDGET, f"{kernel} {r['dtype']} {r['config']} on {target}: {spills} spill instructions"

    def test_fp16_lays_out_like_bf16(compiled):
        """fp16 is compiled for sm_75 only; on sm_80+ it picks bf16's configs. Check on the
        heaviest configs of the two chunk kernels that it needs exactly bf16's shared memory."""
        jobs = []
        for kernel in ("chunk_fwd", "chunk_bwd_dqk"):
            for target in ("sm_80", "sm_90"):
                cfg = _K.selectable_configs(kernel, target, "fp16")[-1]
                jobs.append({"kernel": kernel, "target": target, "dtype": "fp16", "config": cfg})
        for r in run_compile_jobs(jobs):
            assert r["ok"], r.get("error")
            twin = next(b for b in compiled[(r["kernel"], r["target"])] if b["dtype"] == "bf16" and b["config"] == r["config"])
            assert r["shared"] == twin["shared"], (r, twin)


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--worker":
        jobs = json.loads(sys.stdin.read())
        print(json.dumps(_run_worker_pool(jobs, int(sys.argv[2]))))
    elif len(sys.argv) >= 2 and sys.argv[1] == "--table":
        K = _kernels()
        t0 = time.perf_counter()
        results = run_compile_jobs(compile_jobs(K))
        print(smem_table(results, K.SMEM_LIMITS))
        print(f"\n{len(results)} compilations, {sum(r['seconds'] for r in results):.0f} s of compile time, "
              f"{time.perf_counter() - t0:.0f} s wall")
    else:
        print(__doc__)
