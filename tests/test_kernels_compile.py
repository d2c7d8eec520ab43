"""Ahead-of-time compilation of every kernel config for every GPU target, without a GPU.

The interpreter (tests/test_kernels_interpret.py) checks what the kernels compute; it does not
check that they compile for a real GPU, nor that their tiles fit in shared memory: numpy has
neither registers nor shared memory. Triton can compile to a cubin with no GPU present:

    triton.compile(ASTSource(fn=kernel, signature=..., constexprs=...),
                   target=GPUTarget("cuda", 80, 32))

runs the whole pipeline (Triton IR -> GPU IR -> LLVM IR -> PTX -> cubin through ptxas) and
returns the shared memory the kernel needs in `.metadata.shared`, the GPU IR after software
pipelining in `.asm["ttgir"]` and the cubin, whose registers and spill instructions cuobjdump
(shipped with Triton) reads. For every kernel, every target in `TARGETS` and every config
`select_config` can pick there, this test compiles the kernel's heaviest variant (every
feature switched on) and asserts that it fits the target:

    sm_75 (T4, Colab; fp16/fp32: no bf16 tensor cores)   64 KiB per block
    sm_80 (A100)                                         163 KiB
    sm_86 / sm_89 (RTX 30xx, A10 / RTX 40xx, L4)          99 KiB
    sm_90 (H100)                                         227 KiB

and, the gates of the fast path (bf16 on sm_80 and sm_90, at head dims 64 and 128: the
configs `select_config` picks there):

* no register spills in any kernel (no STL/LDL in the SASS);
* at least `MIN_CTAS` CTAs per SM for the kernels that run one program per chunk
  (`PARALLEL_KERNELS`): registers x threads and shared memory per CTA against the SM's, by
  the CUDA occupancy rule (`kernel_anatomy.ctas_per_sm`);
* pipelined tile loads in the loops of the kernels whose loop loads feed tl.dot
  (`PIPELINED_KERNELS`): in every scf.for of the TTGIR that holds a tl.dot, every 2-D tile
  load is an async copy (cp.async) or TMA load, or a prefetch of the next iteration's tile
  into registers, and at least one is async (`kernel_anatomy.loop_loads`).

The gates read the kernels as the JIT compiles them at those head dims
(`kernel_anatomy.jit_alignment`: 16-byte aligned pointers, head dims multiples of 16, any
sequence length). The fit test compiles them knowing nothing of the sort, as they run at any
head dim: there a 16-bit row may start at any element, its loads cannot be vectorised into
async copies (only the fp32 ones are), and the kernels need more registers (chunk_output:
222 against 163 on sm_80). Both variants must fit shared memory. The delta rule's kernels
are the exception (`PADDED_LAUNCH`): their launchers pad odd head dims to multiples of 16, so
only the aligned variant ever runs, and it is the one compiled for every target.

Inputs are compiled as bf16 and fp32 on sm_80+ (fp16 picks the same configs and lays them out
exactly like bf16: `test_fp16_lays_out_like_bf16` checks that on the heaviest configs), and
as fp16 and fp32 on sm_75.

Compile time. Every (kernel, target, dtype, config) is compiled once per session, by one
module fixture that the fit, spill and gate tests all read. The compilations run in a
subprocess (this file run as a script) so that TRITON_INTERPRET=1 in the test environment
cannot turn the kernels into interpreted ones, on a process pool with one worker per CPU
core (LINATTN_COMPILE_WORKERS overrides), the slowest jobs first. Triton caches compiled
kernels in ~/.triton/cache (or TRITON_CACHE_DIR), and this test keeps what it read from them
beside it (`_result_path`, keyed by the kernels' sources; LINATTN_COMPILE_CACHE=0 turns that
off), so a second run takes seconds; on a clean machine (CI) everything is compiled.

Targets. LINATTN_COMPILE_TARGETS (comma-separated, e.g. `sm_90`) restricts every job, twin and
gate to those targets: `make gpu-rehearsal` runs the sm_90 gates that way under the GPU
machine's Triton, from source (`-o addopts=` drops the nbval options of pyproject.toml for an
environment without nbval).

`python tests/test_kernels_compile.py --table` prints the shared memory of every config per
target as a markdown table; `--gates` the numbers behind the gates.
"""
from __future__ import annotations

import functools
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
# Kernels whose launchers pad the head dims to multiples of 16 (kernels/delta_rule.py,
# `pad_head_dims`): the JIT always sees aligned strides, so they are compiled that way. (At
# odd head dims, with no divisibility known, their state and backward kernels spilled 34-776
# instructions.)
PADDED_LAUNCH = ("delta_",)
# The kernels and targets whose fp16 twin is compiled to compare with bf16 (heaviest config).
FP16_TWINS = ("chunk_fwd", "chunk_output", "chunk_dqk")
FP16_TWIN_TARGETS = ("sm_80", "sm_90")

# The gates: the configs select_config picks for bf16 at these head dims on these targets.
GATE_TARGETS = ("sm_80", "sm_90")
GATE_DIMS = (64, 128)
GATE_DTYPE = "bf16"
# One program per (tile, chunk, batch * head): a grid of many short programs, which needs
# more than one resident CTA per SM to hide the latency of its loads and its epilogue.
PARALLEL_KERNELS = ("chunk_output", "chunk_dqk", "chunk_dv", "chunk_bwd_prep")
MIN_CTAS = 2
# Kernels whose loops load tiles that feed tl.dot: those loads must be software-pipelined.
PIPELINED_KERNELS = ("chunk_state", "chunk_state_wide", "chunk_state_few", "chunk_state_few_wide", "chunk_output", "chunk_dqk", "chunk_dv")


def compile_targets(K) -> tuple[str, ...]:
    """The targets compiled: LINATTN_COMPILE_TARGETS (comma-separated names of K.TARGETS), else all."""
    wanted = os.environ.get("LINATTN_COMPILE_TARGETS", "").replace(" ", "")
    if not wanted:
        return tuple(K.TARGETS)
    names = tuple(wanted.split(","))
    unknown = [n for n in names if n not in K.TARGETS]
    if unknown:
        raise ValueError(f"LINATTN_COMPILE_TARGETS: unknown targets {unknown}; expected some of {list(K.TARGETS)}")
    return tuple(n for n in K.TARGETS if n in names)


def _kernels():
    """linattn_lib.kernels, installed or from this checkout."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from linattn_lib.core.triton_ops import kernels_import_error, load_kernels

    K = load_kernels()
    if K is None:
        raise ImportError(f"linattn_lib.kernels does not import: {kernels_import_error()}")
    return K


def compile_jobs(K, targets: tuple[str, ...] | None = None) -> list[dict]:
    """One job per (kernel, target, dtype, config that select_config can pick there), for
    `targets` (default `compile_targets`). The jobs know no divisibility (any head dim), except
    for kernels in PADDED_LAUNCH."""
    jobs = []
    for kernel in K.KERNELS:
        for target in targets or compile_targets(K):
            for dtype in COMPILED_DTYPES[target]:
                assert dtype in K.TARGET_DTYPES[target]
                for cfg in K.selectable_configs(kernel, target, dtype):
                    job = {"kernel": kernel, "target": target, "dtype": dtype, "config": cfg}
                    jobs.append(dict(job, aligned=True) if kernel.startswith(PADDED_LAUNCH) else job)
    return jobs


def twin_jobs(K) -> list[dict]:
    """fp16 compilations of the heaviest bf16 config of the FP16_TWINS kernels that exist."""
    return [{"kernel": kernel, "target": target, "dtype": "fp16",
             "config": K.selectable_configs(kernel, target, "fp16")[-1]}
            for kernel in FP16_TWINS if kernel in K.KERNELS for target in FP16_TWIN_TARGETS
            if target in compile_targets(K)]


def gate_config(K, kernel: str, target: str, d: int) -> dict:
    """The config the launcher picks for `kernel` with bf16 inputs at head dim `d` on `target`."""
    import torch

    return K.select_config(kernel, d, torch.bfloat16, K.TARGETS[target])


def gate_jobs(K) -> list[dict]:
    """The gate configs, compiled as the JIT compiles them at D = 64 and 128 (`jit_alignment`)."""
    jobs = []
    for kernel in K.KERNELS:
        for target in (t for t in GATE_TARGETS if t in compile_targets(K)):
            for d in GATE_DIMS:
                job = {"kernel": kernel, "target": target, "dtype": GATE_DTYPE,
                       "config": gate_config(K, kernel, target, d), "aligned": True}
                if job not in jobs:
                    jobs.append(job)
    return jobs


def _job_key(job: dict) -> str:
    return json.dumps([job["kernel"], job["target"], job["dtype"], job["config"], bool(job.get("aligned"))],
                      sort_keys=True)


def _cost(job: dict) -> int:
    """A guess at a job's compile time, to start the slowest first: the elements of its
    tiles (every block size of the config), the chunk kernels and the 16-bit ones heavier."""
    cfg = job["config"]
    size = 1
    for name, value in cfg.items():
        if name.startswith("B"):  # the block sizes (not warps, stages, a register cap or flags)
            size *= value
    return size * (4 if job["kernel"].startswith("chunk") else 1) * (2 if job["dtype"] != "fp32" else 1)


@functools.lru_cache(maxsize=1)
def _readers_digest() -> str:
    """A hash of the code that reads the compiled artifacts: kernel_anatomy.py and this file."""
    import hashlib

    readers = (ROOT / "linattn_lib" / "chapters" / "kernel_anatomy.py", HERE)
    return hashlib.sha256(b"".join(p.read_bytes() for p in readers)).hexdigest()


def _result_path(fn, job: dict, signature: dict, constexprs: dict) -> Path | None:
    """Where the result of `job` is kept between sessions, None when LINATTN_COMPILE_CACHE=0.

    Next to Triton's own cache (TRITON_CACHE_DIR, default ~/.triton/cache): a cold Triton
    cache is a cold cache of these results too. The key is everything the result depends
    on: the kernel's source and the sources of the @triton.jit functions it calls (Triton's
    `cache_key`), the job and its signature, the Triton release and its ptxas, and the code
    that reads the artifacts (kernel_anatomy.py, this file).
    """
    import hashlib

    import triton

    if os.environ.get("LINATTN_COMPILE_CACHE", "1") == "0":
        return None
    material = json.dumps([fn.cache_key, _job_key(job), sorted(signature.items()), repr(sorted(constexprs.items())),
                           triton.__version__, os.environ.get("TRITON_PTXAS_PATH", ""), _readers_digest()])
    base = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    return base / "linattn_compile" / f"{hashlib.sha256(material.encode()).hexdigest()}.json"


def _kept_result(job: dict) -> dict | None:
    """The result of `job` an earlier session kept (`_result_path`), if any."""
    fn, spec = _kernels().KERNELS[job["kernel"]]
    path = _result_path(fn, job, *spec(job["config"], job["dtype"]))
    if path is None or not path.exists():
        return None
    return dict(json.loads(path.read_text()), **job, seconds=0.0, cached=True)


def _compile_one(job: dict) -> dict:
    """Compile one job to cubin and read its artifacts, keeping the result (`_result_path`);
    runs in a worker process."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from linattn_lib.chapters.kernel_anatomy import jit_alignment, loop_loads, sass_stats

    K = _kernels()
    fn, spec = K.KERNELS[job["kernel"]]
    cfg = job["config"]
    signature, constexprs = spec(cfg, job["dtype"])
    path = _result_path(fn, job, signature, constexprs)
    attrs = jit_alignment(fn.arg_names, signature) if job.get("aligned") else None
    t0 = time.perf_counter()
    result = dict(job)
    try:
        compiled = triton.compile(
            ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
            target=GPUTarget("cuda", int("".join(map(str, K.TARGETS[job["target"]]))), 32),
            options={"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"],
                     # the launchers' cap applies where the JIT sees the dims' divisibility
                     **({"maxnreg": cfg["maxnreg"]} if "maxnreg" in cfg and job.get("aligned") else {})},
        )
        result.update(ok=True, shared=int(compiled.metadata.shared), cubin_bytes=len(compiled.asm["cubin"]))
        result["sass"] = sass_stats(compiled.asm["cubin"], lazy=True)  # None without cuobjdump
        result["loops"] = loop_loads(compiled.asm["ttgir"])
    except Exception as e:  # reported by the test, with the message
        result.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
    result["seconds"] = round(time.perf_counter() - t0, 2)
    if path is not None and result["ok"]:  # failures are compiled again, for a fresh message
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result))
        tmp.replace(path)
    return result


def _run_worker_pool(jobs: list[dict], workers: int) -> list[dict]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    kept = [_kept_result(job) for job in jobs]  # without a pool: a warm run starts no worker
    done = {i: r for i, r in enumerate(kept) if r is not None}
    # Slowest first, so that the pool does not end waiting on one long compile.
    order = sorted((i for i in range(len(jobs)) if i not in done), key=lambda i: -_cost(jobs[i]))
    if workers <= 1 or len(order) <= 1:
        done.update((i, _compile_one(jobs[i])) for i in order)
    else:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            done.update(zip(order, pool.map(_compile_one, [jobs[i] for i in order])))
    return [done[i] for i in range(len(jobs))]


def compile_workers() -> int:
    """LINATTN_COMPILE_WORKERS, else one worker per CPU core this process may use (at most 8)."""
    if "LINATTN_COMPILE_WORKERS" in os.environ:
        return max(1, int(os.environ["LINATTN_COMPILE_WORKERS"]))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(8, cores))


def run_compile_jobs(jobs: list[dict], timeout: float = 1500) -> list[dict]:
    """Compile `jobs` (each distinct one once) in a fresh Python process without
    TRITON_INTERPRET; returns one result per job, in order."""
    unique = list({_job_key(j): j for j in jobs}.values())
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, str(HERE), "--worker", str(compile_workers())],
        input=json.dumps(unique), capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the compile worker failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    by_key = {_job_key(r): r for r in json.loads(proc.stdout.strip().splitlines()[-1])}
    return [by_key[_job_key(j)] for j in jobs]


def smem_table(results: list[dict], limits: dict) -> str:
    """Markdown table: shared memory (KiB) of each kernel/config/dtype per target."""
    targets = list(limits)
    rows = {}
    for r in results:
        cfg = r["config"]
        dtype = r["dtype"] + (" (aligned)" if r.get("aligned") else "")
        key = (r["kernel"], dtype, ", ".join(f"{k}={v}" for k, v in cfg.items()))
        rows.setdefault(key, {})[r["target"]] = f"{r['shared'] / 1024:.1f}" if r.get("ok") else "FAIL"
    head = "| kernel | dtype | config | " + " | ".join(f"{t} (≤{limits[t] // 1024})" for t in targets) + " |"
    lines = [head, "|" + " --- |" * (3 + len(targets))]
    for (kernel, dtype, cfg), per in sorted(rows.items()):
        lines.append(f"| {kernel} | {dtype} | {cfg} | " + " | ".join(per.get(t, "") for t in targets) + " |")
    return "\n".join(lines)


def gate_rows(K, results: list[dict]) -> list[dict]:
    """The numbers behind the gates, one row per (kernel, target, head dim): registers, stack
    bytes and spill instructions per thread, shared memory, CTAs per SM and what limits them,
    and the loads in the TTGIR's loops (async copies, plain tile loads)."""
    from linattn_lib.chapters.kernel_anatomy import ctas_per_sm

    found = {_job_key(r): r for r in results}
    rows = []
    for kernel in K.KERNELS:
        for target in (t for t in GATE_TARGETS if t in compile_targets(K)):
            for d in GATE_DIMS:
                cfg = gate_config(K, kernel, target, d)
                r = found.get(_job_key({"kernel": kernel, "target": target, "dtype": GATE_DTYPE, "config": cfg,
                                        "aligned": True}))
                row = {"kernel": kernel, "target": target, "d": d, "config": cfg, "result": r}
                if r is not None and r.get("ok") and r.get("sass") is not None:
                    occ = ctas_per_sm(r["sass"]["registers"], cfg["num_warps"], r["shared"], target)
                    row.update(occupancy=occ, registers=r["sass"]["registers"], stack=r["sass"]["stack_bytes"],
                               spills=r["sass"]["spill_instructions"])
                rows.append(row)
    return rows


def gate_table(rows: list[dict]) -> str:
    """Markdown table of `gate_rows`."""
    lines = ["| kernel | target | D | config | regs | stack | spills | smem KiB | CTAs/SM (limit) | per loop: async / prefetched / plain tiles |",
             "|" + " --- |" * 10]
    for row in rows:
        r, cfg = row["result"], row["config"]
        conf = " ".join(f"{k}={v}" for k, v in cfg.items() if k != "num_stages")
        if r is None or not r.get("ok") or "occupancy" not in row:
            lines.append(f"| {row['kernel']} | {row['target']} | {row['d']} | {conf} | not compiled |" + " |" * 5)
            continue
        occ, loops = row["occupancy"], r["loops"]
        ll = ", ".join(f"{x['async']} / {x['prefetched']} / {x['sync_tiles']}" + ("" if x["dots"] else " (no dot)")
                       for x in loops) or "no loop"
        lines.append(f"| {row['kernel']} | {row['target']} | {row['d']} | {conf} | {row['registers']} | {row['stack']}"
                     f" | {row['spills']} | {r['shared'] / 1024:.1f} | {occ.ctas} ({occ.limited_by}) | {ll} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# the tests
# --------------------------------------------------------------------------------------

if __name__ != "__main__" and __name__ != "__mp_main__":
    import pytest

    from linattn_lib.chapters.kernel_anatomy import ctas_per_sm

    def test_ctas_per_sm_by_the_cuda_occupancy_rule():
        """Known numbers of the CUDA occupancy calculator (65536 registers per SM in 4
        sub-partitions, allocated per warp in units of 256; 1 KiB of shared memory reserved
        per CTA from sm_80 on)."""
        occ = ctas_per_sm(128, 8, 0, "sm_80")              # 128 x 32 = 4096 per warp: 4 per sub-partition
        assert (occ.by_registers, occ.by_threads, occ.by_ctas, occ.ctas) == (2, 8, 32, 2)
        assert ctas_per_sm(129, 8, 0, "sm_80").by_registers == 1   # 4128 -> 4352 per warp: 3 per sub-partition
        assert ctas_per_sm(212, 8, 0, "sm_80").ctas == 1           # chunk_output's first mma16 config
        assert ctas_per_sm(255, 4, 0, "sm_90").by_registers == 2   # 4 warps never fall below 2 CTAs
        assert ctas_per_sm(256, 4, 0, "sm_90").by_registers == 0   # over 255 per thread: does not launch
        assert ctas_per_sm(64, 32, 0, "sm_80").by_registers == 1   # 64 x 1024 threads: the whole file
        small = ctas_per_sm(32, 4, 0, "sm_80")                     # 16 by registers and threads
        assert (small.by_registers, small.by_threads, small.ctas, small.limited_by) == (16, 16, 16, "registers")
        assert ctas_per_sm(16, 1, 0, "sm_80").ctas == 32           # the CTA limit
        assert ctas_per_sm(16, 1, 0, "sm_75").ctas == 16
        # shared memory: (bytes rounded up to 128 + 1 KiB) per CTA out of 164 KiB (sm_80), 228 KiB (sm_90)
        assert ctas_per_sm(32, 4, 81 * 1024, "sm_80").by_shared == 2
        assert ctas_per_sm(32, 4, 81 * 1024 + 1, "sm_80").by_shared == 1
        assert ctas_per_sm(32, 4, 113 * 1024, "sm_90").by_shared == 2
        assert ctas_per_sm(32, 4, 113 * 1024 + 1, "sm_90").limited_by == "shared memory"
        assert ctas_per_sm(32, 4, 163 * 1024, "sm_80").by_shared == 1
        assert ctas_per_sm(32, 4, 163 * 1024 + 1, "sm_80").by_shared == 0   # over the per-block opt-in maximum
        assert ctas_per_sm(32, 4, 32 * 1024, "sm_75").by_shared == 2        # no reserved KiB on Turing
        assert ctas_per_sm(32, 8, 0, "sm_86").by_threads == 6               # 1536 threads per SM

    def test_loop_loads_reads_the_loops_of_the_ttgir():
        from linattn_lib.chapters.kernel_anatomy import loop_loads

        ttgir = "\n".join([
            "  tt.func public @k(%a: !tt.ptr<bf16>) {",
            "    %x = tt.load %p : tensor<64x32x!tt.ptr<bf16>, #blocked>",
            "    %c = ttg.async_copy_global_to_local %p, %m : tensor<64x32x!tt.ptr<bf16>, #blocked> -> <64x32xbf16>",
            "    %r:2 = scf.for %i = %c0 to %n step %c1 iter_args(%acc = %z) -> (tensor<64x64xf32, #mma>) {",
            "      %y = tt.load %q : tensor<64x32x!tt.ptr<bf16>, #blocked>",
            "      %s = \"tt.reduce\"(%y) <{axis = 1 : i32}> ({",
            "      ^bb0(%u: f32, %v: f32):",
            "        tt.reduce.return %u : f32",
            "      }) : (tensor<64x32xf32, #blocked>) -> tensor<64xf32>",
            "      %z1 = tt.load %zp : tensor<32x!tt.ptr<f32>, #blocked1>",
            "      %d = tt.dot %a, %b, %acc : tensor<64x32xbf16> * tensor<32x64xbf16> -> tensor<64x64xf32, #mma>",
            "      %c2 = ttg.async_copy_global_to_local %p, %m : tensor<64x32x!tt.ptr<bf16>, #blocked> -> <64x32xbf16>",
            "      scf.yield %d : tensor<64x64xf32, #mma>",
            "    }",
            "    %w = tt.load %p : tensor<64x32x!tt.ptr<bf16>, #blocked>",
            "    tt.return",
            "  }",
        ])
        assert loop_loads(ttgir) == [{"dots": 1, "async": 1, "prefetched": 0, "sync_tiles": 1,
                                      "ops": ["ttg.async_copy_global_to_local"]}]
        carried = loop_loads(ttgir.replace("scf.yield %d :", "scf.yield %d, %y :"))[0]   # %y: next iteration's tile
        assert (carried["prefetched"], carried["sync_tiles"]) == (1, 0)
        assert loop_loads(ttgir.replace("scf.for", "scf.while")) == []
        inner = ttgir.replace("      %z1 = tt.load", "      scf.for %j = %c0 to %n step %c1 {\n"
                              "        %z2 = tt.load %p : tensor<16x16x!tt.ptr<bf16>, #blocked>\n      }\n      %z1 = tt.load")
        assert [x["sync_tiles"] for x in loop_loads(inner)] == [1, 1]   # each load counted in its innermost loop

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

    _TARGETS = compile_targets(_K)
    GROUPS = [(kernel, target) for kernel in _K.KERNELS for target in _TARGETS]
    GATES = [(kernel, target) for kernel in _K.KERNELS for target in GATE_TARGETS if target in _TARGETS]
    PARALLEL = [(k, t) for k, t in GATES if k in PARALLEL_KERNELS]
    PIPELINED = [(k, t) for k, t in GATES if k in PIPELINED_KERNELS]

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
        """Every job of the selected kernels, compiled once: (kernel, target) -> results."""
        wanted = _kernels_wanted(request.session)
        jobs = [j for j in compile_jobs(_K) + twin_jobs(_K) + gate_jobs(_K) if j["kernel"] in wanted]
        by_group: dict = {}
        for r in run_compile_jobs(jobs):
            by_group.setdefault((r["kernel"], r["target"]), []).append(r)
        return by_group

    def _gate_results(compiled, kernel, target) -> list[tuple[int, dict, dict]]:
        """(head dim, config, result) of the gate configs of `kernel` on `target`."""
        out = []
        for d in GATE_DIMS:
            cfg = gate_config(_K, kernel, target, d)
            r = next((r for r in compiled[(kernel, target)]
                      if r["dtype"] == GATE_DTYPE and r["config"] == cfg and r.get("aligned")), None)
            assert r is not None, f"{kernel} {cfg} ({GATE_DTYPE}, D = {d}) was not compiled for {target}"
            assert r["ok"], f"{kernel} {cfg} does not compile for {target}: {r.get('error')}"
            out.append((d, cfg, r))
        return out

    def _sass(r) -> dict:
        if r.get("sass") is None:
            pytest.skip("cuobjdump is not available to read the registers and the SASS")
        return r["sass"]

    def test_every_config_in_the_table_is_compiled():
        """The compile jobs are exactly what the launchers can pick: every selectable config is
        compiled for its target, and no config in CONFIGS is unreachable (hence uncompiled)."""
        import torch

        jobs = compile_jobs(_K, tuple(_K.TARGETS))
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

    # Spill instructions (STL/LDL) a selected config may have at head dims up to 128, in every
    # dtype and on every target. The first config table had 500-700 in every chunk kernel (and
    # thousands in some fp32 ones); the table in kernels/configs.py was chosen to remove them,
    # and this keeps them out. The bf16 gates on sm_80 / sm_90 below allow none.
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

    @pytest.mark.parametrize("kernel,target", GATES, ids=[f"{k}-{t}" for k, t in GATES])
    def test_gate_no_spills(compiled, kernel, target):
        """bf16 at D = 64 and 128: not one local-memory spill store or load in the SASS."""
        for d, cfg, r in _gate_results(compiled, kernel, target):
            sass = _sass(r)
            assert sass["spill_instructions"] == 0, (
                f"{kernel} {cfg} (bf16, D = {d}) on {target}: {sass['spill_instructions']} spill instructions "
                f"(STL/LDL), {sass['registers']} registers, {sass['stack_bytes']} B of stack per thread")

    @pytest.mark.parametrize("kernel,target", PARALLEL, ids=[f"{k}-{t}" for k, t in PARALLEL])
    def test_gate_parallel_kernels_fit_two_ctas_per_sm(compiled, kernel, target):
        """bf16 at D = 64 and 128: registers x threads and shared memory leave room for
        MIN_CTAS CTAs of the kernel on one SM."""
        for d, cfg, r in _gate_results(compiled, kernel, target):
            regs = _sass(r)["registers"]
            occ = ctas_per_sm(regs, cfg["num_warps"], r["shared"], target)
            assert occ.ctas >= MIN_CTAS, (
                f"{kernel} {cfg} (bf16, D = {d}) on {target}: {occ.ctas} CTA(s) per SM, limited by "
                f"{occ.limited_by} ({regs} registers x {cfg['num_warps'] * 32} threads, "
                f"{r['shared']} B of shared memory; {occ})")

    @pytest.mark.parametrize("kernel,target", PIPELINED, ids=[f"{k}-{t}" for k, t in PIPELINED])
    def test_gate_loop_loads_are_pipelined(compiled, kernel, target):
        """bf16 at D = 64 and 128: in every loop of the kernel that feeds tl.dot, the pipeliner
        turned the tile loads into async copies (cp.async, or TMA; at least one) or prefetches
        into registers (a load of the next iteration's tile, carried by the loop), none left
        waited for where it is used: the next iteration's tiles arrive during this one's
        matmuls. Loops without a dot (chunk_state's walk of the
        normaliser state z: row sums, no matmul) are not software-pipelined by Triton and not
        checked."""
        for d, cfg, r in _gate_results(compiled, kernel, target):
            loops = [x for x in r["loops"] if x["dots"]]
            if not loops:
                pytest.skip(f"{kernel} has no loop with a tl.dot at {cfg}: nothing to pipeline")
            for i, x in enumerate(loops):
                assert x["async"] >= 1 and x["sync_tiles"] == 0, (
                    f"{kernel} {cfg} (bf16, D = {d}) on {target}, loop {i} with {x['dots']} dots: "
                    f"{x['async']} async copies or TMA loads, {x['prefetched']} tiles prefetched into "
                    f"registers and {x['sync_tiles']} tile loads waited for where they are used")

    def test_fp16_lays_out_like_bf16(compiled):
        """fp16 is compiled for sm_75 only; on sm_80+ it picks bf16's configs. Check on the
        heaviest configs of the chunk kernels in FP16_TWINS that it needs exactly bf16's
        shared memory, where both multiply alike; where bf16 rounds its operands and fp16 does
        not (configs.ROUNDED, sm_90), that fp16 still fits the SM. chunk_output reads the entry
        states in bf16 for bf16 and in fp32 for fp16: fp16 may need up to the fp32 state tiles'
        extra 2 bytes an element in each pipeline stage (64 x 128 tiles on sm_90: 32 KiB)."""
        twins = twin_jobs(_K)
        assert twins, f"none of {FP16_TWINS} is a kernel"
        for job in twins:
            group = [r for r in compiled[(job["kernel"], job["target"])] if not r.get("aligned")]
            r = next(r for r in group if r["dtype"] == "fp16" and r["config"] == job["config"])
            assert r["ok"], r.get("error")
            twin = next(b for b in group if b["dtype"] == "bf16" and b["config"] == r["config"])
            cfg = r["config"]
            if _K.rounds_operands(cfg, "fp16") != _K.rounds_operands(cfg, "bf16"):
                assert r["shared"] <= _K.SMEM_LIMITS[job["target"]], r
            elif job["kernel"] == "chunk_output":
                extra = r["shared"] - twin["shared"]
                assert 0 <= extra <= cfg["num_stages"] * cfg["BK"] * cfg["BV"] * 2, (r, twin)
            else:
                assert r["shared"] == twin["shared"], (r, twin)


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "--worker":
        jobs = json.loads(sys.stdin.read())
        print(json.dumps(_run_worker_pool(jobs, int(sys.argv[2]))))
    elif len(sys.argv) >= 2 and sys.argv[1] in ("--table", "--gates"):
        K = _kernels()
        t0 = time.perf_counter()
        if sys.argv[1] == "--table":
            results = run_compile_jobs(compile_jobs(K) + twin_jobs(K) + gate_jobs(K))
            print(smem_table(results, K.SMEM_LIMITS))
        else:
            results = run_compile_jobs(gate_jobs(K))
            print(gate_table(gate_rows(K, results)))
        print(f"\n{len(results)} compilations, {sum(r['seconds'] for r in results):.0f} s of compile time, "
              f"{time.perf_counter() - t0:.0f} s wall")
    else:
        print(__doc__)
