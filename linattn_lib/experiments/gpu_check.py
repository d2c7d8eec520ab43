"""Check the compiled Triton kernels on a CUDA GPU, and time them.

    python -m linattn_lib.experiments.gpu_check --out gpu_results/
    python -m linattn_lib.experiments.gpu_check --pytest tests/test_kernels_interpret.py  # + the full suite

1. the kernel self-test (`kernel_selftest.run_kernel_selftest`, part of the package, so it runs from an
   installed copy too): every kernel is compiled for this GPU and checked against the float64
   references of the library -- outputs, final states (S and z) and the gradients of q, k, v,
   the log-decay and the initial state, in float32, float16 and bfloat16, at awkward shapes
   (T in 1..300 around the chunk of 64, head dims 16..256 including padded ones, several
   heads and batches, resumed states, decays from none to underflowing and with resets), plus
   the non-causal kernels, the decoding step and the fused FAVOR+ feature map;
   `--pytest PATH...` also runs a checkout's kernel test files with CUDA tensors;
2. times forward and forward+backward at T=16384, H=16, D=128 in bfloat16 with
   triton.testing.do_bench: our chunked linear attention (normalised; and unnormalised with a
   per-token decay), torch's scaled_dot_product_attention (causal softmax: flash attention
   where available), and flash-linear-attention's kernels when `fla` is installed; then the
   FAVOR+ feature map (d=64, m=256) in torch against the fused kernel (kernels/favor.py);
3. times the chunked kernels under every candidate launch config (`run_config_sweep`): the
   configs were chosen without a GPU, and these are the numbers to choose them by;
4. writes results.json and results.md into the output folder.

Exit status: 0 when every check ran and passed; 1 when a check failed; 2 when a check did not
run -- no CUDA device (then nothing touches a GPU driver and nothing is written), no Triton,
kernels that do not import, or a --pytest file that is not there -- with a message saying what
did not run. Parts skipped on request (--skip-tests, --skip-bench) are reported as such and do
not change the status. The benchmark and the sweep measure, they do not check: their errors
are recorded in the results, not in the exit status.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .kernel_selftest import FAILED, NOT_RUN, PASSED, run_kernel_selftest

if TYPE_CHECKING:
    import torch

SKIPPED = "skipped"


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


def run_kernel_tests(out: Path, tests: Path | Sequence[Path]) -> dict:
    """pytest on a checkout's kernel test files (tests/test_kernels_interpret.py, ...) with
    CUDA tensors, in one run."""
    files = [Path(tests)] if isinstance(tests, (str, Path)) else [Path(t) for t in tests]
    missing = [str(f) for f in files if not f.is_file()]
    if missing or not files:
        return {"status": NOT_RUN, "reason": f"{', '.join(missing)} not found (--pytest needs a source checkout's test files)"}
    env = dict(os.environ, LINATTN_KERNEL_TEST_DEVICE="cuda")
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "pytest", *(str(f.resolve()) for f in files), "-q", "-p", "no:cacheprovider",
           "-o", "addopts=", f"--junitxml={(out / 'kernel_tests.xml').resolve()}"]
    t0 = time.perf_counter()
    # from the checkout's root (the test files' grandparent), as `make test` runs it
    proc = subprocess.run(cmd, cwd=str(files[0].resolve().parent.parent), env=env, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    (out / "kernel_tests.log").write_text(log)
    summary = next((line for line in reversed(log.strip().splitlines()) if " in " in line), "")
    if proc.returncode == 5 or (" skipped" in summary and " passed" not in summary):
        return {"status": NOT_RUN, "reason": f"pytest ran no kernel test: {summary.strip('= ') or log[-300:]}",
                "returncode": proc.returncode}
    return {"status": PASSED if proc.returncode == 0 else FAILED, "returncode": proc.returncode,
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
    try:  # fla's normalised linear attention (normalises in torch, no decay)
        from fla.ops.linear_attn import chunk_linear_attn

        def fla_linear_attn():
            o, _ = chunk_linear_attn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=1.0,
                                     normalize=True)
            return o

        candidates["fla chunk_linear_attn (normalised)"] = fla_linear_attn
    except Exception:
        pass

    shape = f"B={B} H={H} T={T} D={D}"
    rows = [_time_candidate(name, fn, inputs, shape, do_bench) for name, fn in candidates.items()]
    q = k = v = g = qs = ks = inputs = candidates = None  # free the GPU memory the lambdas hold
    torch.cuda.empty_cache()
    decode = run_decode_benchmark(do_bench=do_bench)
    attach_predictions(rows, torch.cuda.get_device_name(), B)
    return rows + [decode] + run_favor_benchmark(B, H, T, do_bench=do_bench)


# benchmark row -> the performance model's row (book/results/perf_model.json, same shape)
PREDICTED_AS = {
    "linattn triton (normalised)": "ours, normalised, no decay",
    "linattn triton (unnormalised, per-token decay)": "ours, unnormalised, per-token decay",
    "fla chunk_simple_gla (unnormalised, per-token decay)": "fla chunk_simple_gla (per-token decay g)",
    "fla chunk_linear_attn (normalised)": "fla chunk_linear_attn(normalize=True)",
}


def attach_predictions(rows: list[dict], gpu_name: str, B: int = 1) -> list[dict]:
    """Put the performance model's predicted forward and forward+backward ms beside each
    benchmark row it has a prediction for (the committed book/results/perf_model.json, for
    the H100 or H200 the name says; other GPUs get none). Returns the rows."""
    from ..results import load_result

    pred = load_result("perf_model.json", default=None)
    gpu = next((g for g in ("H100", "H200") if g in gpu_name), None)
    if pred is None or gpu is None:
        return rows
    table = pred["ms"].get(f"{gpu} SXM, B={B}", {})
    for row in rows:
        model = table.get(PREDICTED_AS.get(row["name"], ""))
        if model is not None:
            row["predicted_forward_ms"] = model["forward"]
            row["predicted_forward_backward_ms"] = model["total"]
    return rows


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


def run_favor_benchmark(B: int, H: int, T: int, d: int = 64, m: int = 256, *, do_bench: Callable,
                        device: str = "cuda") -> list[dict]:
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


def run_decode_benchmark(B: int = 64, H: int = 16, D: int = 128, *, do_bench: Callable,
                         device: str = "cuda") -> dict:
    """One decoding step (normalised, per-head decay) at a batch whose fp32 states (B H D^2 x 4
    bytes, 64 MiB here) dwarf the caches: the step reads and writes every state once, so its
    time is set by that traffic. Returns ms, the state bytes moved and the bandwidth reached."""
    import torch

    from .. import kernels as K

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.rand(B, H, D, device=device, dtype=dtype) for _ in range(3))
    S = torch.zeros(B, H, D, D, device=device)
    z = torch.zeros(B, H, D, device=device)
    g = -torch.rand(H, device=device) * 0.1
    ms = float(do_bench(lambda: K.decode_step(q, k, v, S, z, log_decay=g), warmup=25, rep=100))
    moved = 2 * (S.numel() + z.numel()) * 4
    return {"name": "decode step (state read + write)", "shape": f"B={B} H={H} D={D}", "ms": round(ms, 4),
            "state_bytes": moved, "GB_per_s": round(moved / (ms * 1e-3) / 1e9, 1)}


def candidate_configs(kernel: str, d_whole: int, dtype: torch.dtype, capability: tuple[int, int] | None) -> list[dict]:
    """Launch configs worth timing for `kernel` at one head-dim bucket on this GPU: the chosen
    one first, then its neighbours -- each block width (BK, BV) halved or doubled within 16 to
    64, at its warp count -- and the chosen blocks on the other warp count (4 or 8), at the
    chosen chunk length (the two phases must share it) and pipelining depth: at most ten per
    kernel, so that the sweep's compiles fit the GPU check's time. Which fit the GPU's shared
    memory is decided by the run itself (a config that does not fit fails to launch and is
    reported)."""
    from ..kernels import select_config

    chosen = select_config(kernel, d_whole, dtype, capability)

    def near(b: int) -> list[int]:
        return [x for x in (b // 2, b, b * 2) if 16 <= x <= 64]

    out = [chosen]
    for BK in near(chosen["BK"]):
        for BV in near(chosen["BV"]):
            out.append(dict(chosen, BK=BK, BV=BV))
    out.append(dict(chosen, num_warps=12 - chosen["num_warps"]))
    return [cfg for i, cfg in enumerate(out) if cfg not in out[:i]]


def _sweep_calls(B: int, H: int, T: int, D: int, dtype, device: str) -> dict:
    """kernel name -> call(config) launching that kernel alone on inputs of the benchmark shape
    (normalised, per-token decay); the state tensors they read are made once, up front."""
    import torch

    from .. import kernels as K

    torch.manual_seed(0)
    q, k = (torch.rand(B, H, T, D, device=device, dtype=dtype) for _ in range(2))
    v, do = (torch.randn(B, H, T, D, device=device, dtype=dtype) for _ in range(2))
    g = -torch.rand(B, H, T, device=device) * 0.1
    o, den, _, _ = K.chunk_fwd_two_phase(q, k, v, log_decay=g)
    r, e, _ = K.chunk_bwd_prep(do, o, den)
    h, hz, _, _ = K.chunk_states(k, v, log_decay=g)
    dh, dhz, _, _ = K.chunk_states(q, do, log_decay=g, reverse=True, key_scale=r, z_weights=e)
    layout = (None, None, None, h.shape[2])
    return {
        "chunk_state": lambda cfg: K.chunk_states(k, v, log_decay=g, config=cfg),
        "chunk_output": lambda cfg: K.chunk_output(q, k, v, h, hz, log_decay=g, config=cfg),
        "chunk_dqk": lambda cfg: K.chunk_dqk(q, k, v, do, g, r, e, (h, hz), (dh, dhz), layout, None, cfg),
        "chunk_dv": lambda cfg: K.chunk_dv(q, k, do, g, r, dh, layout, None, cfg),
    }


def run_config_sweep(B: int = 1, H: int = 16, T: int = 16384, D: int = 128, *, do_bench: Callable,
                     device: str = "cuda") -> list[dict]:
    """Time each kernel of the two-phase engine alone (chunk_state, chunk_output, chunk_dqk,
    chunk_dv) under every candidate config at the benchmark shape, bf16 (fp16 before sm_80),
    normalised, per-token decay. The configs in kernels/configs.py were chosen without a GPU,
    from compile-time evidence (registers, spills, CTAs per SM: tests/test_kernels_compile.py);
    these numbers are what should replace that evidence."""
    import torch

    from .. import kernels as K

    if device == "cuda":
        cap = torch.cuda.get_device_capability()
        dtype = torch.bfloat16 if cap >= (8, 0) else torch.float16
    else:  # the interpreter (a smoke test of this function)
        cap, dtype = None, torch.float32
    rows = []
    for kernel, call in _sweep_calls(B, H, T, D, dtype, device).items():
        chosen = K.select_config(kernel, D, dtype, cap)
        for cfg in candidate_configs(kernel, K.whole_dim(D), dtype, cap):
            row = {"kernel": kernel, "config": cfg, "chosen": cfg == chosen, "shape": f"B={B} H={H} T={T} D={D}",
                   "dtype": str(dtype).replace("torch.", "")}
            try:
                row["ms"] = round(float(do_bench(lambda call=call, cfg=cfg: call(cfg), warmup=10, rep=50)), 4)
            except Exception as e:  # e.g. out of shared memory on this GPU
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
    return rows + run_split_sweep(1, max(1, H // 8), T, D, dtype=dtype, do_bench=do_bench, device=device)


def run_split_sweep(B: int, H: int, T: int, D: int, *, dtype: torch.dtype, do_bench: Callable,
                    device: str = "cuda") -> list[dict]:
    """The state pass (normalised, per-token decay) where its grid is small (B * H = 2 at the
    benchmark shape): walked whole, in the runs the launcher picks (split-T), and in twice as
    many; the model's predictions are in book/results/perf_model.json ("split_T")."""
    import torch

    from .. import kernels as K

    torch.manual_seed(0)
    k = torch.rand(B, H, T, D, device=device, dtype=dtype)
    v = torch.randn(B, H, T, D, device=device, dtype=dtype)
    g = -torch.rand(B, H, T, device=device) * 0.1
    cfg = K.select_config("chunk_state", D, dtype, None if device == "cpu" else torch.device(device))
    programs = -(-D // cfg["BK"]) * (-(-D // cfg["BV"]) + 1) * B * H
    NT = -(-T // cfg["BT"])
    sms = K.configs.multiprocessor_count(device) or 132
    chosen = K.split_count(programs, NT, sms)
    rows = []
    for splits in dict.fromkeys((1, chosen, 2 * chosen)):
        row = {"kernel": f"chunk_state split-T, B={B} H={H}", "config": {"splits": splits}, "chosen": splits == chosen,
               "shape": f"B={B} H={H} T={T} D={D}", "dtype": str(dtype).replace("torch.", "")}
        call = lambda splits=splits: K.chunk_states(k, v, log_decay=g, splits=splits)
        try:
            row["ms"] = round(float(do_bench(call, warmup=10, rep=50)), 4)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
    return rows


def _markdown(env: dict, checks: dict, bench: list[dict], sweep: list[dict] = ()) -> str:
    lines = ["# GPU check", "", "| | |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in env.items()]
    lines += ["", "## Checks", ""]
    for what, res in checks.items():
        lines.append(f"* {what}: **{res.get('status')}** {res.get('summary', res.get('reason', ''))}")
    failures = [r for r in checks.get("kernel self-test", {}).get("checks", []) if r["status"] == FAILED]
    if failures:
        lines += ["", "| failed check | dtype | problems |", "| --- | --- | --- |"]
        lines += [f"| {r['name']} | {r['dtype']} | {'; '.join(r['problems'])[:200]} |" for r in failures]
    lines += ["", "## Benchmark (median ms, triton.testing.do_bench)", "",
              "| implementation | shape | forward | forward + backward | model: fwd / fwd+bwd |",
              "| --- | --- | ---: | ---: | ---: |"]
    for r in bench:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['shape']} | error: {r['error'][:80]} | | |")
        elif "GB_per_s" in r:
            lines.append(f"| {r['name']} | {r['shape']} | {r['ms']:.4f} ({r['GB_per_s']:.0f} GB/s) | | |")
        else:
            model = (f"{r['predicted_forward_ms']:.2f} / {r['predicted_forward_backward_ms']:.2f}"
                     if "predicted_forward_ms" in r else "")
            lines.append(f"| {r['name']} | {r['shape']} | {r['forward_ms']:.2f} | {r['forward_backward_ms']:.2f} | {model} |")
    if sweep:
        lines += ["", "## Launch configs (median ms; * = the one select_config picks)", "",
                  "| kernel | config | ms |", "| --- | --- | ---: |"]
        for r in sorted(sweep, key=lambda r: (r["kernel"], r.get("ms", float("inf")))):
            cfg = ", ".join(f"{k}={v}" for k, v in r["config"].items())
            ms = f"{r['ms']:.3f}" if "ms" in r else f"error: {r['error'][:60]}"
            lines.append(f"| {r['kernel']}{' *' if r['chosen'] else ''} | {cfg} | {ms} |")
    return "\n".join(lines) + "\n"


def exit_status(checks: dict) -> int:
    """0 when every check ran and passed (or was skipped on request), 1 when one failed,
    2 when one did not run."""
    states = {res.get("status") for res in checks.values()}
    return 1 if FAILED in states else 2 if NOT_RUN in states else 0


def _report_not_run(checks: dict) -> None:
    for what, res in checks.items():
        if res.get("status") == NOT_RUN:
            print(f"gpu_check: NOT RUN: {what}: {res.get('reason', '')}", file=sys.stderr)


def _not_run_without_cuda(args: argparse.Namespace) -> dict:
    checks = {}
    if not args.skip_tests:
        checks["kernel self-test"] = {"status": NOT_RUN, "reason": "no CUDA device"}
        if args.pytest:
            checks[f"pytest {' '.join(args.pytest)}"] = {"status": NOT_RUN, "reason": "no CUDA device"}
    if not args.skip_bench:
        checks["benchmark"] = {"status": NOT_RUN, "reason": "no CUDA device"}
    return checks


def _run_checks(args: argparse.Namespace, out: Path) -> dict:
    if args.skip_tests:
        return {"kernel self-test": {"status": SKIPPED, "reason": "--skip-tests"}}
    checks = {"kernel self-test": run_kernel_selftest("cuda", quick=args.quick, log=print)}
    if args.pytest:
        checks[f"pytest {' '.join(args.pytest)}"] = run_kernel_tests(out, [Path(p) for p in args.pytest])
    for what, res in checks.items():
        print(f"{what}: {res.get('status')} {res.get('summary', res.get('reason', ''))}")
    return checks


def _run_bench(args: argparse.Namespace, do_bench: Callable | None) -> list[dict]:
    if args.skip_bench:
        return []
    if do_bench is None:
        bench = [{"name": "benchmark", "shape": "", "error": "triton is not installed (triton.testing.do_bench)"}]
    else:
        try:
            bench = run_benchmark()
        except Exception as e:
            bench = [{"name": "benchmark", "shape": "", "error": f"{type(e).__name__}: {e}"[:500]}]
    for r in bench:
        if "GB_per_s" in r:
            print(f"  {r['name']:<55} {r['ms']:8.4f} ms  {r['GB_per_s']:8.1f} GB/s")
            continue
        model = (f"  (model: {r['predicted_forward_ms']:.2f} / {r['predicted_forward_backward_ms']:.2f})"
                 if "predicted_forward_ms" in r else "")
        print(f"  {r['name']:<55} " + (f"fwd {r['forward_ms']:8.2f} ms  fwd+bwd {r['forward_backward_ms']:8.2f} ms"
                                       if "error" not in r else f"error: {r['error'][:100]}") + model)
    return bench


def _run_sweep(args: argparse.Namespace, do_bench: Callable | None) -> list[dict]:
    if args.skip_bench or args.skip_sweep or do_bench is None:
        return []
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
    return sweep


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m linattn_lib.experiments.gpu_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_results", help="folder for results.json and results.md")
    parser.add_argument("--skip-tests", action="store_true", help="only run the benchmark")
    parser.add_argument("--skip-bench", action="store_true", help="only run the kernel checks")
    parser.add_argument("--skip-sweep", action="store_true",
                        help="skip the launch-config sweep (it compiles about 40 kernel variants)")
    parser.add_argument("--pytest", metavar="PATH", nargs="+", default=None,
                        help="also run these pytest files with CUDA tensors (a checkout's tests/test_kernels_*.py)")
    parser.add_argument("--quick", action="store_true", help="a few self-test cases only (a smoke test)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the checks and the benchmark; the exit status (see the module docstring)."""
    args = _parser().parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        checks = _not_run_without_cuda(args)
        _report_not_run(checks)
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}, CUDA build {torch.version.cuda}): "
              f"{', '.join(checks) or 'nothing'} did not run. On CPU the tests run the kernels in the Triton "
              "interpreter (`make test`); this check needs a CUDA GPU.", file=sys.stderr)
        return exit_status(checks)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = _environment()
    print(f"gpu_check: {env['gpu']} (sm_{env['capability'].replace('.', '')}), torch {env['torch']}, triton {env['triton']}")
    checks = _run_checks(args, out)
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    bench = _run_bench(args, do_bench)
    sweep = _run_sweep(args, do_bench)
    (out / "results.json").write_text(json.dumps(
        {"environment": env, "checks": checks, "benchmark": bench, "config_sweep": sweep}, indent=2))
    (out / "results.md").write_text(_markdown(env, checks, bench, sweep))
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}")
    _report_not_run(checks)
    status = exit_status(checks)
    if status == 1:
        print("gpu_check: FAILED: " + ", ".join(w for w, r in checks.items() if r.get("status") == FAILED), file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
