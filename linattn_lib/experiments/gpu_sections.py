"""The GPU check's sections, each a function of a deadline that returns a JSON-able dict.

* `install_wheels`: the wheels carried in .whl/ (fla) into a temporary folder put on the path
  (pip --target, or unzipped when there is no pip), so that a bare machine can import them;
* `environment`: versions, the GPU, its clocks (nvidia-smi), the achieved device-to-device
  copy bandwidth and bf16 matmul rate (the model's ceilings, measured);
* `profile_fwd_bwd`: torch.profiler's per-kernel times of one forward+backward of ours,
  beside the performance model's per-launch predictions (`model_launches`);
* `run_kernel_tests`: the checkout's kernel test files with CUDA tensors, in a subprocess
  that is stopped at the deadline (its log says how far it got).
"""
from __future__ import annotations

import importlib
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import torch

from .gpu_limits import Timeout, time_limit

PASSED, FAILED, NOT_RUN, CUT = "passed", "failed", "not run", "cut"


# ------------------------------------------------------------------------------ wheels


def _unzip_wheel(wheel: Path, target: Path) -> None:
    """A pure-Python wheel unpacked as pip would: its packages at the top, *.data/purelib too."""
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.namelist():
            parts = member.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            dest = target.joinpath(*parts)
            if member.endswith("/"):
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(zf.read(member))


def install_wheels(wheel_dir: str | Path = ".whl", target: str | Path | None = None, *, use_pip: bool = True) -> dict:
    """Install every wheel of `wheel_dir` (no index, no dependencies) into `target` (default a new
    temporary folder) and put it first on sys.path and PYTHONPATH (for subprocesses). pip is tried
    first (`python -m pip install --no-index --no-deps --target`); without it, or when it fails,
    each wheel is unzipped. Returns {"status", "wheels", "path", "method"[, "pip_error"]}."""
    wheels = sorted(Path(wheel_dir).glob("*.whl"))
    if not wheels:
        return {"status": NOT_RUN, "reason": f"no wheels in {wheel_dir}/ (make gpu-deps fills it)", "wheels": []}
    target = Path(target or tempfile.mkdtemp(prefix="linattn_wheels_"))
    target.mkdir(parents=True, exist_ok=True)
    out = {"wheels": [w.name for w in wheels], "path": str(target)}
    if use_pip:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, wheels)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if proc.returncode == 0:
                out["method"] = "pip"
            else:
                out["pip_error"] = (proc.stderr or proc.stdout)[-500:]
        except (OSError, subprocess.TimeoutExpired) as e:
            out["pip_error"] = f"{type(e).__name__}: {e}"[:500]
    if "method" not in out:
        for wheel in wheels:
            _unzip_wheel(wheel, target)
        out["method"] = "zipfile"
    sys.path.insert(0, str(target))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH")) if p)
    importlib.invalidate_caches()
    out["status"] = PASSED
    return out


def fla_status() -> dict:
    """fla's version and whether its ops import, or why not."""
    try:
        fla = importlib.import_module("fla")
        for name in ("fla.ops.linear_attn", "fla.ops.simple_gla", "fla.ops.retention"):
            importlib.import_module(name)
        return {"fla": getattr(fla, "__version__", "?"), "path": str(Path(fla.__file__).parent)}
    except Exception as e:  # not carried, or it does not import here
        return {"fla": None, "error": f"{type(e).__name__}: {e}"[:400]}


# ------------------------------------------------------------------------- environment


SMI_FIELDS = ("name", "driver_version", "clocks.sm", "clocks.max.sm", "clocks.mem", "clocks.max.mem",
              "power.draw", "power.limit", "temperature.gpu", "pstate")


def nvidia_smi() -> dict:
    """nvidia-smi's clocks (MHz), power and state of GPU 0, or the error."""
    try:
        proc = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader,nounits",
                               "-i", "0"], capture_output=True, text=True, timeout=15)
        values = [v.strip() for v in proc.stdout.strip().split(",")]
        return dict(zip(SMI_FIELDS, values)) if len(values) == len(SMI_FIELDS) else {"error": proc.stderr[-300:]}
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": f"{type(e).__name__}: {e}"}


def _median_ms(do_bench: Callable, make: Callable[[], Callable[[], object]]) -> float:
    fn = make()  # the tensors live only as long as this call
    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def ceilings(do_bench: Callable, nbytes: int = 2**31, n: int = 8192) -> dict:
    """Achieved device-to-device copy bandwidth (bytes read + written over the median time, one
    2 GiB buffer: 30x the L2) and the rate of an n^3 bf16 matmul on random data, with the SM clock
    nvidia-smi reads right after each (under load)."""

    def copy():
        x = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
        y = torch.empty_like(x)
        return lambda: y.copy_(x)

    def matmul():
        a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        return lambda: a @ b

    ms = _median_ms(do_bench, copy)
    out = {"copy_bytes": nbytes, "copy_ms": round(ms, 4), "copy_TB_per_s": round(2 * nbytes / (ms * 1e-3) / 1e12, 3),
           "sm_clock_after_copy_MHz": nvidia_smi().get("clocks.sm")}
    ms = _median_ms(do_bench, matmul)
    out.update(matmul_n=n, matmul_ms=round(ms, 4), matmul_TFLOP_per_s=round(2 * n**3 / (ms * 1e-3) / 1e12, 1),
               sm_clock_after_matmul_MHz=nvidia_smi().get("clocks.sm"))
    torch.cuda.empty_cache()
    return out


def environment(do_bench: Callable | None) -> dict:
    """Versions (python, torch, CUDA, Triton, fla, this library), the GPU and its state, the ceilings."""
    from .. import __version__

    props = torch.cuda.get_device_properties(0)
    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "gpu": props.name, "capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
           "memory_GiB": round(props.total_memory / 2**30, 1), "linattn_lib": __version__,
           "time": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count(), "nvidia_smi": nvidia_smi()}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    env.update(fla_status())
    env["commit"] = _git_commit()
    if do_bench is not None:
        env["ceilings"] = ceilings(do_bench)
    return env


def _git_commit() -> str | None:
    try:
        proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        return proc.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


# ----------------------------------------------------------------------------- profile


def measured_kernels(fn: Callable[[], object], iterations: int = 3) -> dict:
    """torch.profiler's GPU activity of `fn` (already warm), `iterations` times: every kernel,
    memcpy and memset of one iteration in launch order with its time (the median over the
    iterations of the one at that position), and the same grouped by name."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iterations):
            fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: e.time_range.start)
    n = len(events) // iterations if iterations and len(events) % iterations == 0 else len(events)
    seq = []
    for i in range(n):
        times = sorted(events[i + j * n].time_range.elapsed_us() for j in range(len(events) // n))
        seq.append({"name": events[i].name, "us": round(float(times[len(times) // 2]), 2)})
    by_name: dict = {}
    for e in seq:
        s = by_name.setdefault(e["name"], {"name": e["name"], "calls": 0, "us": 0.0})
        s["calls"] += 1
        s["us"] = round(s["us"] + e["us"], 2)
    return {"sequence": seq, "by_name": sorted(by_name.values(), key=lambda s: -s["us"]),
            "total_us": round(sum(e["us"] for e in seq), 1), "split_into_iterations": n != len(events)}


def model_launches(variant: str, B: int, T: int, H: int, D: int, gpu_name: str = "H200") -> list[dict]:
    """The performance model's per-launch predictions of ours' forward+backward (`perf_model.census`,
    `launch_of`, `predict`; sm_90 configs, split as on 132 SMs): part, kernel, grid, predicted us, bound."""
    from ..chapters import perf_model as pm
    from .gpu_bench import VARIANTS

    v = VARIANTS[variant]
    gpu = pm.GPUS["H100 SXM" if "H100" in gpu_name else "H200 SXM"]
    calls = pm.census(B, H, T, D, torch.bfloat16, normalize=v.normalize, decay=v.decay, target=gpu.target, sms=gpu.sms)
    rows = []
    for part in ("forward", "backward"):
        for r in pm.predict([pm.launch_of(c, gpu) for c in calls[part]], gpu):
            rows.append({"part": part, "kernel": r["kernel"], "grid": list(r["grid"]), "bound": r["bound"],
                         "predicted_us": round(r["time"] * 1e6, 2)})
    return rows


def pair_launches(measured: list[dict], predicted: list[dict]) -> list[dict]:
    """Each predicted launch beside the measured kernel of the same name and occurrence (the
    Triton kernels; eager torch ops, named differently by the profiler, stay unpaired)."""
    seen: dict = {}
    by_name: dict = {}
    for e in measured:
        by_name.setdefault(e["name"], []).append(e["us"])
    rows = []
    for p in predicted:
        i = seen[p["kernel"]] = seen.get(p["kernel"], -1) + 1
        got = by_name.get(p["kernel"], [])
        rows.append(dict(p, measured_us=got[i] if i < len(got) else None))
    return rows


def profile_fwd_bwd(variant: str, B: int, T: int, H: int, D: int, deadline: float,
                    provider: str = "ours: op") -> dict:
    """One forward+backward of `provider` (gpu_bench's names) at a shape, profiled kernel by
    kernel, then, for ours through the op and while the deadline allows, beside the model's
    per-launch predictions."""
    from .gpu_bench import VARIANTS, Case, case_call, fwd_bwd, make_inputs

    x = make_inputs(B, T, H, D, VARIANTS[variant], "cuda")
    call, leaves, do = case_call(Case(B, T, H, D, variant, provider), x)
    out = {"variant": variant, "shape": f"B={B} T={T} H={H} D={D}", "provider": provider}
    out.update(measured_kernels(fwd_bwd(call, leaves, do)))
    del x, call, leaves, do
    torch.cuda.empty_cache()
    if provider != "ours: op":
        return out
    try:
        with time_limit(max(deadline - time.monotonic(), 1.0)):
            predicted = model_launches(variant, B, T, H, D, torch.cuda.get_device_name())
        out["launches"] = pair_launches(out["sequence"], predicted)
        out["predicted_total_us"] = round(sum(r["predicted_us"] for r in predicted), 1)
    except (Exception, Timeout) as e:  # the model is not essential to the measurement
        out["model_error"] = f"{type(e).__name__}: {e}"[:400]
    return out


# ------------------------------------------------------------------------ kernel tests


def run_kernel_tests(out: Path, files: list[str], deadline: float) -> dict:
    """pytest on the checkout's kernel test files with CUDA tensors, its log streamed to
    out/kernel_tests.log; stopped at the deadline, when the counts so far are reported (status cut)."""
    missing = [f for f in files if not Path(f).is_file()]
    if missing or not files:
        return {"status": NOT_RUN, "reason": f"{', '.join(missing)} not found (a source checkout's test files)"}
    env = dict(os.environ, LINATTN_KERNEL_TEST_DEVICE="cuda", PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)
    root = Path(files[0]).resolve().parent.parent
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    log = out / "kernel_tests.log"
    cmd = [sys.executable, "-m", "pytest", *(str(Path(f).resolve()) for f in files), "-v", "-p", "no:cacheprovider",
           "-o", "addopts=", f"--junitxml={(out / 'kernel_tests.xml').resolve()}"]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=str(root), env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            rc = proc.wait(timeout=max(deadline - time.monotonic(), 1.0))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
    text = log.read_text(errors="replace")
    counts = {k: len(re.findall(rf" {word}( |$)", text, re.M))
              for k, word in (("passed", "PASSED"), ("failed", "FAILED"), ("errors", "ERROR"), ("skipped", "SKIPPED"))}
    failed = [m.group(1) for m in re.finditer(r"^(\S+::\S+) (?:FAILED|ERROR)", text, re.M)][:50]
    status = FAILED if counts["failed"] or counts["errors"] else CUT if rc is None else PASSED if rc == 0 else FAILED
    if rc == 5 or (rc is not None and not any(counts.values())):
        status = NOT_RUN
    return {"status": status, "returncode": rc, **counts, "failed_tests": failed, "log": log.name,
            **({"reason": "stopped at the time budget"} if rc is None else {})}
