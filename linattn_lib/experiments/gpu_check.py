"""Check the compiled Triton kernels on a CUDA GPU, and time them.

    python -m linattn_lib.experiments.gpu_check --out gpu_results/

1. runs tests/test_kernels_interpret.py with CUDA tensors, so every kernel is compiled for
   this GPU and checked against the float64 references (bfloat16 cases included);
2. times forward and forward+backward at T=16384, H=16, D=128 in bfloat16 with
   triton.testing.do_bench: our chunked linear attention (normalised; and unnormalised with a
   per-token decay), torch's scaled_dot_product_attention (causal softmax: flash attention
   where available), and flash-linear-attention's kernels when `fla` is installed; then the
   FAVOR+ feature map (d=64, m=256) in torch against the fused kernel (kernels/favor.py);
3. times the chunked kernels under every candidate launch config (`run_config_sweep`): the
   configs were chosen without a GPU, and these are the numbers to choose them by;
4. writes results.json and results.md into the output folder.

On a machine without CUDA it prints a message and exits 0 without touching any GPU driver.
The exit status is 1 when the kernel tests fail.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _environment() -> dict:
    import torch

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(0))),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    try:
        from .. import __version__

        info["linattn_lib"] = __version__
    except ImportError:
        pass
    return info


def run_kernel_tests(out: Path) -> dict:
    """pytest on the kernel tests with CUDA tensors; returns counts and the tail of the log."""
    tests = REPO / "tests" / "test_kernels_interpret.py"
    if not tests.exists():
        return {"status": "skipped", "reason": f"{tests} not found (run from a source checkout)"}
    env = dict(os.environ, LINATTN_KERNEL_TEST_DEVICE="cuda")
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "pytest", str(tests), "-q", "-p", "no:cacheprovider", "-o", "addopts=",
           f"--junitxml={out / 'kernel_tests.xml'}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=str(REPO), env=env, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    (out / "kernel_tests.log").write_text(log)
    summary = next((line for line in reversed(log.strip().splitlines()) if " in " in line), "")
    return {"status": "passed" if proc.returncode == 0 else "failed", "returncode": proc.returncode,
            "summary": summary.strip("= "), "seconds": round(time.perf_counter() - t0, 1)}


def _bench(fn, do_bench) -> float:
    return float(do_bench(fn, warmup=25, rep=100))


def _fwd_bwd(fn, inputs):
    """fn's forward and backward with a fixed random output gradient."""
    import torch

    with torch.no_grad():
        do = torch.randn_like(fn())

    def run():
        for x in inputs:
            x.grad = None
        fn().backward(do)

    return run


def run_benchmark(B: int = 1, H: int = 16, T: int = 16384, D: int = 128) -> list[dict]:
    """Forward and forward+backward times (ms, median of do_bench) at one shape, bf16."""
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    from ..core.linear import linear_attention

    dev, dtype = "cuda", torch.bfloat16
    torch.manual_seed(0)
    q = torch.rand(B, H, T, D, device=dev, dtype=dtype).requires_grad_()
    k = torch.rand(B, H, T, D, device=dev, dtype=dtype).requires_grad_()
    v = torch.randn(B, H, T, D, device=dev, dtype=dtype).requires_grad_()
    g = (-torch.rand(B, H, T, device=dev) * 0.1).requires_grad_()
    qs, ks = (q / D).detach().requires_grad_(), (k - 0.5).detach().requires_grad_()  # signed, small
    inputs = [q, k, v, g, qs, ks]

    candidates = {
        "linattn triton (normalised)": lambda: linear_attention(q, k, v, backend="triton"),
        "linattn triton (unnormalised, per-token decay)": lambda: linear_attention(
            qs, ks, v, normalize=False, log_decay=g, backend="triton"),
        "torch SDPA (causal softmax)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    try:  # flash-linear-attention, if installed (its layout is (B, T, H, D))
        from fla.ops.simple_gla import chunk_simple_gla

        def fla_simple_gla():
            o, _ = chunk_simple_gla(qs.transpose(1, 2), ks.transpose(1, 2), v.transpose(1, 2),
                                    g=g.transpose(1, 2), scale=1.0)
            return o

        candidates["fla chunk_simple_gla (unnormalised, per-token decay)"] = fla_simple_gla
    except Exception:  # not installed, or another API version
        pass

    shape = f"B={B} H={H} T={T} D={D}"
    rows = [_time_candidate(name, fn, inputs, shape, do_bench) for name, fn in candidates.items()]
    del q, k, v, g, qs, ks, inputs
    torch.cuda.empty_cache()
    return rows + run_favor_benchmark(B, H, T, do_bench=do_bench)


def _time_candidate(name, fn, inputs, shape, do_bench, dtype: str = "bfloat16") -> dict:
    import torch

    row = {"name": name, "shape": shape, "dtype": dtype}
    try:
        with torch.no_grad():
            row["forward_ms"] = round(_bench(fn, do_bench), 3)
        row["forward_backward_ms"] = round(_bench(_fwd_bwd(fn, inputs), do_bench), 3)
    except Exception as e:  # one failing candidate must not hide the others
        row["error"] = f"{type(e).__name__}: {e}"[:500]
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def run_favor_benchmark(B: int, H: int, T: int, d: int = 64, m: int = 256, *, do_bench, device: str = "cuda") -> list[dict]:
    """The FAVOR+ feature map of keys (global stabiliser: the two-launch case) and queries (row
    stabiliser), torch against the fused kernel (kernels/favor.py), bf16, forward and
    forward+backward: the measurement that decides whether the fused map should become the
    default on CUDA."""
    import torch

    from ..core.features import positive_random_features, random_projection

    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter has no bf16
    x = (torch.randn(B, H, T, d, device=device) * 1.5).to(dtype).requires_grad_()
    W = random_projection(m, d, seed=0).to(device=device, dtype=dtype)
    s, shape = d**-0.25, f"B={B} H={H} T={T} d={d} m={m}"
    rows = []
    for stabilize, who in (("global", "keys"), ("row", "queries")):
        for backend in ("torch", "triton"):
            def fn(stabilize=stabilize, backend=backend):
                return positive_random_features(x, W, input_scale=s, stabilize=stabilize, backend=backend)

            name = f"FAVOR+ features of {who} ({stabilize} max), {backend}"
            rows.append(_time_candidate(name, fn, [x], shape, do_bench, dtype=str(dtype).replace("torch.", "")))
    return rows


def candidate_configs(kernel: str, d_whole: int, dtype, capability) -> list[dict]:
    """Launch configs worth timing for `kernel` at one head-dim bucket on this GPU: chunk
    lengths 32 and 64, tiles of 16, 32 and 64 columns, 4 and 8 warps, at the pipelining depth
    the launcher uses for this dtype -- those that fit the GPU's shared memory per block are
    decided by the run itself (a config that does not fit fails to launch and is reported)."""
    from ..kernels import DIM_NAMES, select_config

    chosen = select_config(kernel, d_whole, dtype, capability)
    whole, tiled = DIM_NAMES[kernel]
    out = [chosen]
    for BT in (32, 64):
        for tile in (16, 32, 64):
            for warps in (4, 8):
                cfg = {"BT": BT, whole: d_whole, tiled: tile, "num_warps": warps, "num_stages": chosen["num_stages"]}
                if cfg not in out:
                    out.append(cfg)
    return out


def run_config_sweep(B: int = 1, H: int = 16, T: int = 16384, D: int = 128, *, do_bench, device: str = "cuda") -> list[dict]:
    """Time the chunked kernels' forward (chunk_fwd) and dq pass (chunk_bwd_dqk) under every
    candidate config at the benchmark shape, bf16 (fp16 before sm_80), normalised, per-token
    decay. The configs in kernels/configs.py were chosen without a GPU, from compile-time
    evidence (registers and spills, `kernel_anatomy.compile_report`); these numbers are what
    should replace that evidence."""
    import torch

    from .. import kernels as K

    if device == "cuda":
        cap = torch.cuda.get_device_capability()
        dtype = torch.bfloat16 if cap >= (8, 0) else torch.float16
    else:  # the interpreter (a smoke test of this function)
        cap, dtype = None, torch.float32
    torch.manual_seed(0)
    q, k = (torch.rand(B, H, T, D, device=device, dtype=dtype) for _ in range(2))
    v = torch.randn(B, H, T, D, device=device, dtype=dtype)
    g = -torch.rand(B, H, T, device=device) * 0.1
    dden = torch.randn(B, H, T, device=device)
    calls = {
        "chunk_fwd": lambda cfg: K.chunk_fwd(q, k, v, log_decay=g, config=cfg),
        "chunk_bwd_dqk": lambda cfg: K.chunk_bwd_dqk(v, v, k, dden=dden, log_decay=g, config=cfg),
    }
    rows = []
    for kernel, call in calls.items():
        chosen = K.select_config(kernel, D, dtype, cap)
        for cfg in candidate_configs(kernel, K.whole_dim(D), dtype, cap):
            row = {"kernel": kernel, "config": cfg, "chosen": cfg == chosen, "shape": f"B={B} H={H} T={T} D={D}",
                   "dtype": str(dtype).replace("torch.", "")}
            try:
                row["ms"] = round(float(do_bench(lambda: call(cfg), warmup=10, rep=50)), 4)
            except Exception as e:  # e.g. out of shared memory on this GPU
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
    return rows


def _markdown(env: dict, tests: dict, bench: list[dict], sweep: list[dict] = ()) -> str:
    lines = ["# GPU check", "", "| | |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in env.items()]
    lines += ["", "## Kernel tests (CUDA tensors)", "", f"{tests.get('status')}: {tests.get('summary', tests.get('reason', ''))}",
              "", "## Benchmark (median ms, triton.testing.do_bench)", "",
              "| implementation | shape | forward | forward + backward |", "| --- | --- | ---: | ---: |"]
    for r in bench:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['shape']} | error: {r['error'][:80]} | |")
        else:
            lines.append(f"| {r['name']} | {r['shape']} | {r['forward_ms']:.2f} | {r['forward_backward_ms']:.2f} |")
    if sweep:
        lines += ["", "## Launch configs (median ms; * = the one select_config picks)", "",
                  "| kernel | config | ms |", "| --- | --- | ---: |"]
        for r in sorted(sweep, key=lambda r: (r["kernel"], r.get("ms", float("inf")))):
            cfg = ", ".join(f"{k}={v}" for k, v in r["config"].items())
            ms = f"{r['ms']:.3f}" if "ms" in r else f"error: {r['error'][:60]}"
            lines.append(f"| {r['kernel']}{' *' if r['chosen'] else ''} | {cfg} | {ms} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_results", help="folder for results.json and results.md")
    parser.add_argument("--skip-tests", action="store_true", help="only run the benchmark")
    parser.add_argument("--skip-bench", action="store_true", help="only run the kernel tests")
    parser.add_argument("--skip-sweep", action="store_true",
                        help="skip the launch-config sweep (it compiles about 24 kernel variants)")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (the CPU tests run the kernels in the "
              "Triton interpreter: `make test`).")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = _environment()
    print(f"gpu_check: {env['gpu']} (sm_{env['capability'].replace('.', '')}), torch {env['torch']}, triton {env['triton']}")

    tests = {"status": "skipped"} if args.skip_tests else run_kernel_tests(out)
    print(f"kernel tests: {tests.get('status')} {tests.get('summary', '')}")
    bench = []
    if not args.skip_bench:
        try:
            bench = run_benchmark()
        except Exception as e:
            bench = [{"name": "benchmark", "shape": "", "error": f"{type(e).__name__}: {e}"[:500]}]
        for r in bench:
            print(f"  {r['name']:<55} " + (f"fwd {r['forward_ms']:8.2f} ms  fwd+bwd {r['forward_backward_ms']:8.2f} ms"
                                           if "error" not in r else f"error: {r['error'][:100]}"))
    sweep = []
    if not (args.skip_bench or args.skip_sweep):
        from triton.testing import do_bench

        try:
            sweep = run_config_sweep(do_bench=do_bench)
        except Exception as e:
            sweep = [{"kernel": "sweep", "config": {}, "chosen": False, "error": f"{type(e).__name__}: {e}"[:500]}]
        best = {}
        for r in sweep:
            if "ms" in r and r["ms"] < best.get(r["kernel"], (float("inf"),))[0]:
                best[r["kernel"]] = (r["ms"], r["config"])
        for r in sweep:
            if r.get("chosen") and "ms" in r:
                print(f"  {r['kernel']}: chosen config {r['ms']:.3f} ms, best of {sum(x['kernel'] == r['kernel'] for x in sweep)} "
                      f"candidates {best[r['kernel']][0]:.3f} ms {best[r['kernel']][1]}")
    (out / "results.json").write_text(json.dumps(
        {"environment": env, "kernel_tests": tests, "benchmark": bench, "config_sweep": sweep}, indent=2))
    (out / "results.md").write_text(_markdown(env, tests, bench, sweep))
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}")
    return 1 if tests.get("status") == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
