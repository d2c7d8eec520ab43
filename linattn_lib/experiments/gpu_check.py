"""The GPU check: a bare GPU machine, one call, under six minutes, results written as it goes.

On the GPU machine (python3 with torch and Triton, no install, no network), from the checkout:

    PYTHONPATH=. python3 -m linattn_lib.experiments.gpu_check --out $OUT --budget-s 330

(`make gpu-check` runs the same here; `make gpu-deps` puts fla's wheel into .whl/, which must
travel with the checkout: carry `.whl`). The sections, in order, each with a time cap, all
within --budget-s (a section that reaches its cap or the budget is cut, and says so):

    setup         the wheels of .whl/ installed into a temporary folder (fla; missing: no fla rows)
    environment   versions, GPU, clocks, achieved copy bandwidth and bf16 matmul rate       25 s
    precompile    every kernel launch of ours the benchmark and profile make, compiled on all
                  cores into Triton's cache (gpu_plan: the dry run's plan), while fla's
                  autotuning candidates compile in worker processes (gpu_fla_warm)         60 s
    benchmark     ours (public API and op), fla, SDPA: gpu_bench, row by row; then the configs
                  fla's autotuners chose and their timings of every candidate               150 s
    profile       torch.profiler per kernel of one fwd+bwd beside the model's per-launch
                  predictions (normalised; unnormalised with a per-token decay, then under
                  the whole-op sweep's PROFILED_CANDIDATE too)                               40 s
    extras        the parallel kernels with rounded operands, alone and in the whole op (and
                  chunk_dqk without its register cap); the op replayed from a CUDA graph;
                  decoding step, FAVOR+ map, launch-config sweep (gpu_extras)               60 s
    selftest      the kernel self-test (kernel_selftest), quick subset first               60 s
    kernel tests  the checkout's kernel test files with CUDA tensors (pytest)        what is left

Out ($OUT): gpu_check.json (rewritten after every section and benchmark row), gpu_check.md,
kernel_tests.log and kernel_tests.xml. `--dry-run` rehearses it on a CPU (gpu_dryrun): the
same imports, every launch recorded and compiled for sm_90, nothing run.

Exit status: 0 when every section that ran passed (cut sections are reported, not failed);
1 when a check failed (self-test, kernel tests, a kernel of ours that did not compile or
run in the benchmark, a section that raised); 2 when the checks could not run (no CUDA
device: then nothing touches a GPU driver and nothing is written).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from .gpu_extras import (  # noqa: F401  (their home was this module; tests import them from here)
    OVERRIDE_SETS,
    PREDICTED_AS,
    attach_predictions,
    candidate_configs,
    extras_markdown,
    run_config_sweep,
    run_decode_benchmark,
    run_favor_benchmark,
    run_graph_benchmark,
    run_operand_sweep,
    run_override_sweep,
    run_split_sweep,
    run_stage_sweep,
)
from .gpu_limits import Timeout, time_limit
from .kernel_selftest import FAILED, NOT_RUN, PASSED

SKIPPED, CUT = "skipped", "cut"
DEFAULT_BUDGET_S = 330.0
SECTION_CAPS = {"setup": 30.0, "environment": 25.0, "precompile": 60.0, "benchmark": 150.0, "profile": 40.0,
                "extras": 60.0, "selftest": 60.0, "kernel tests": None}
# a resumed run's extras (its sweeps compile a dozen variants) and its profile (fla autotunes)
RESUMED_CAPS = {"profile": 50.0, "extras": 90.0}
KERNEL_TEST_FILES = ("tests/test_kernels_interpret.py", "tests/test_kernels_two_phase.py",
                     "tests/test_kernels_delta.py")
_markdown = extras_markdown  # the old name of the legacy tables
BACKSTOP_S = 5.0  # a section past its cap by this much is stopped (it stops itself at its cap)
MIN_SECTION_S = 5.0  # a section with less time left than this is not started


class Report:
    """The results so far, written to out/gpu_check.json and gpu_check.md after every change."""

    def __init__(self, out: Path, meta: dict) -> None:
        self.out, self.data = out, {**meta, "sections": {}}
        out.mkdir(parents=True, exist_ok=True)

    def put(self, name: str, result: dict) -> None:
        """Set one section's result and write both files (the JSON atomically)."""
        self.data["sections"][name] = result
        tmp = self.out / "gpu_check.json.tmp"
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.out / "gpu_check.json")
        from .gpu_report import markdown

        try:
            (self.out / "gpu_check.md").write_text(markdown(self.data))
        except Exception as e:  # the JSON is what counts
            (self.out / "gpu_check.md").write_text(f"markdown failed: {type(e).__name__}: {e}\n")


def run_section(report: Report, name: str, deadline: float, fn: Callable[[float, Callable[[dict], None]], dict],
                caps: dict = SECTION_CAPS) -> dict:
    """Run one section under its cap and the overall deadline; its result (status, seconds) is
    written even when it raises or is cut; partial results it `put` are kept when it is cut."""
    cap = caps.get(name)
    left = deadline - time.monotonic()
    if left < MIN_SECTION_S:
        result = {"status": CUT, "reason": "the time budget was spent before this section"}
        report.put(name, result)
        return result
    limit = min(cap, left) if cap else left
    end, t0, partial = time.monotonic() + limit, time.monotonic(), {}

    def put(result: dict) -> None:
        partial.clear()
        partial.update(result)
        report.put(name, dict(result, status="running"))

    try:
        with time_limit(limit + BACKSTOP_S):  # the section checks `end` itself; this is the backstop
            result = fn(end, put)
        result.setdefault("status", PASSED)
    except Timeout:
        result = dict(partial, status=CUT, reason=f"stopped at its limit of {limit:.0f} s")
    except Exception as e:  # recorded; the next sections still run
        result = dict(partial, status=FAILED, error=f"{type(e).__name__}: {e}"[:800],
                      traceback=traceback.format_exc()[-3000:])
    result["seconds"] = round(time.monotonic() - t0, 1)
    report.put(name, result)
    print(f"gpu_check: {name}: {result['status']} in {result['seconds']} s", flush=True)
    return result


def exit_status(checks: dict) -> int:
    """0 when every section or check passed, was cut or skipped; 1 when one failed; 2 when one did not run."""
    states = {res.get("status") for res in checks.values()}
    return 1 if FAILED in states else 2 if NOT_RUN in states else 0


def _previous(path: str | None) -> dict:
    """The sections of an earlier run's gpu_check.json (--resume), or {}."""
    return json.loads(Path(path).read_text())["sections"] if path else {}


def resumed_cases(previous: dict) -> list | None:
    """The benchmark rows an earlier run did not measure (None: no earlier run): ours and fla at
    the registry shapes first, then what was left at the main shapes. A row whose first call ran
    into its own cap (`gpu_bench.FIRST_CALL_CAP`: fla autotuning for longer than that) is not
    tried again; one cut shorter by the budget is."""
    from .gpu_bench import FIRST_CALL_CAP, MAIN_D, MAIN_H, MAIN_T, benchmark_cases

    if not previous:
        return None

    def settled(r: dict) -> bool:
        if "forward_ms" in r and "error" not in r:
            return True
        timed_out = re.match(r"timed out after (\d+) s", r.get("error", ""))
        return bool(timed_out) and float(timed_out[1]) >= FIRST_CALL_CAP[r["provider"].split(":")[0]]

    done = {(r["shape"], r["variant"], r["provider"]) for r in previous.get("benchmark", {}).get("rows", [])
            if settled(r)}
    left = [c for c in benchmark_cases() if (c.shape, c.variant, c.provider) not in done]
    return sorted(left, key=lambda c: (c.T, c.H, c.D) == (MAIN_T, MAIN_H, MAIN_D))


def passed_checks(previous: dict) -> set[tuple[str, str]]:
    """(name, dtype) of the self-test checks an earlier run passed."""
    return {(c["name"], c["dtype"]) for c in previous.get("selftest", {}).get("checks", [])
            if c.get("status") == PASSED}


def _benchmark(args, do_bench) -> Callable:
    from . import gpu_bench, gpu_plan

    def section(end: float, put: Callable[[dict], None]) -> dict:
        before = gpu_plan.cached_kernels()
        result = gpu_bench.run_benchmark(end, put, do_bench, resumed_cases(_previous(args.resume)))
        ours = [r for r in result["rows"] if r["provider"].startswith("ours")]
        bad = [r for r in ours if "error" in r and "timed out" not in r["error"] or "backward_error" in r]
        result["plan_misses"] = gpu_plan.plan_misses(before, gpu_plan.our_kernel_names())
        if "fla" in sys.modules:  # the configs fla ran at, and how its autotuner timed the others
            from .gpu_fla_warm import autotuned

            result["fla_autotuned"] = autotuned()
        result["status"] = FAILED if bad else CUT if "cut" in result else PASSED
        return result

    return section


def _precompile(args) -> Callable:
    def section(end: float, put: Callable[[dict], None]) -> dict:
        from . import gpu_fla_warm, gpu_plan

        warm = gpu_fla_warm.start_workers(args.fla_workers) if args.fla_workers and _has_fla() else []
        result = gpu_plan.precompile(end - 2, args.workers)
        put(result)
        if warm:
            result["fla_warm"] = gpu_fla_warm.finish_workers(warm, end - 1)
        result["status"] = FAILED if result["failed"] else PASSED
        return result

    return section


def _has_fla() -> bool:
    import importlib.util

    return importlib.util.find_spec("fla") is not None


# the whole-op sweep's candidate also profiled kernel by kernel (ours, the first profiled variant):
# its own time, beside the model's, for kernel_fit to fit on
PROFILED_CANDIDATE = "dq, dk, dv in one kernel"


def _profile(args) -> Callable:
    def section(end: float, put: Callable[[dict], None]) -> dict:
        from .. import kernels as K
        from .gpu_bench import MAIN_D, MAIN_H, MAIN_T, PROFILED
        from .gpu_sections import profile_fwd_bwd

        result: dict = {}
        # resumed: where we trail fla most, ours and fla's kernels side by side
        todo = ([(v, "ours: op", None) for v in PROFILED] + [(PROFILED[0], "ours: op", PROFILED_CANDIDATE)]
                if not args.resume else [("unnormalised", "ours: op", None), ("unnormalised", "fla", None)])
        for variant, provider, candidate in todo:
            share = (end - time.monotonic()) / (len(todo) - len(result))
            key = variant if provider == "ours: op" else f"{variant}, {provider}"
            with K.overridden(OVERRIDE_SETS[candidate] if candidate else {}):
                result[key if candidate is None else f"{key}, {candidate}"] = profile_fwd_bwd(
                    variant, 2, MAIN_T, MAIN_H, MAIN_D, time.monotonic() + share, provider)
            put(result)
        return result

    return section


def _extras(args, do_bench) -> Callable:
    def section(end: float, put: Callable[[dict], None]) -> dict:
        import torch

        from .gpu_bench import MAIN_D, MAIN_H, MAIN_T

        # first: are fp32 operands why the parallel kernels trail fla's (book/results/gpu/)?
        result = {"operand_sweep": run_operand_sweep(do_bench=do_bench, deadline=end - 3)}
        put(result)
        result["override_sweep"] = run_override_sweep(do_bench=do_bench, deadline=end - 3)
        put(result)
        if time.monotonic() < end - 10:  # what CUDA graphs remove (host_overhead could not say)
            result["cuda_graph"] = run_graph_benchmark(do_bench=do_bench)
            put(result)
        if args.resume:  # what the first run's numbers asked: pipelining depth, split-T
            result["stage_sweep"] = run_stage_sweep(do_bench=do_bench, deadline=end - 3)
            put(result)
            result["split_sweep"] = []
            for B in (1, 2):
                if time.monotonic() > end - 10:
                    break
                result["split_sweep"] += run_split_sweep(B, MAIN_H, MAIN_T, MAIN_D, dtype=torch.bfloat16,
                                                         do_bench=do_bench, splits=(1, 2, 4, 8))
                put(result)
            return result
        result["decode"] = run_decode_benchmark(do_bench=do_bench)
        put(result)
        result["favor"] = run_favor_benchmark(1, 16, 16384, do_bench=do_bench)
        put(result)
        result["config_sweep"] = run_config_sweep(do_bench=do_bench, deadline=end - 3)
        return result

    return section


def _sections(args, out: Path, do_bench) -> list[tuple[str, Callable]]:
    from .gpu_sections import environment, install_wheels, run_kernel_tests
    from .kernel_selftest import run_kernel_selftest

    sections = [("setup", lambda end, put: install_wheels(args.wheels)),
                ("environment", lambda end, put: environment(do_bench))]
    if not args.skip_bench:
        sections += [("precompile", _precompile(args)), ("benchmark", _benchmark(args, do_bench)),
                     ("profile", _profile(args))]
        if not args.skip_extras:
            sections.append(("extras", _extras(args, do_bench)))
    if not args.skip_tests:
        skip = passed_checks(_previous(args.resume))
        sections.append(("selftest", lambda end, put: run_kernel_selftest("cuda", quick=args.quick, log=print,
                                                                          deadline=end - 3, skip=skip)))
        if args.pytest:
            sections.append(("kernel tests", lambda end, put: run_kernel_tests(out, args.pytest, end - 2)))
    return sections


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m linattn_lib.experiments.gpu_check",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_results", help="folder for gpu_check.json, gpu_check.md and the test logs")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help="the whole run's seconds (compiles included); later sections are cut to fit")
    parser.add_argument("--dry-run", action="store_true",
                        help="no GPU: import everything, record every launch, compile each for sm_90, run nothing")
    parser.add_argument("--wheels", default=".whl", help="folder of wheels to install first (make gpu-deps)")
    parser.add_argument("--workers", type=int, default=None, help="compile processes (default: every core)")
    parser.add_argument("--fla-workers", type=int, default=12, help="processes compiling fla's autotuning candidates")
    parser.add_argument("--skip-tests", action="store_true", help="no self-test, no kernel tests")
    parser.add_argument("--skip-bench", action="store_true", help="no precompile, benchmark, profile, extras")
    parser.add_argument("--skip-extras", action="store_true", help="no decode, FAVOR+ and config-sweep timings")
    parser.add_argument("--pytest", metavar="PATH", nargs="*", default=None,
                        help=f"kernel test files run with CUDA tensors (default: {' '.join(KERNEL_TEST_FILES)})")
    parser.add_argument("--quick", action="store_true", help="the self-test's quick subset only")
    parser.add_argument("--resume", metavar="JSON", default=None,
                        help="an earlier run's gpu_check.json: its measured benchmark rows and passed self-test "
                             "checks are not repeated; the profile puts fla's kernels beside ours and the extras "
                             "time pipelining depths and split-T instead")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the sections (or the dry run); the exit status of the module docstring."""
    t_start = time.monotonic()
    args = _parser().parse_args(argv)
    if args.pytest is None:
        args.pytest = [f for f in KERNEL_TEST_FILES if Path(f).is_file()]
    if args.dry_run:
        from .gpu_dryrun import dry_run

        return dry_run(args)
    import torch

    if not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}, CUDA build {torch.version.cuda}): "
              "nothing ran. `--dry-run` rehearses the check on a CPU.", file=sys.stderr)
        return 2
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    report = Report(Path(args.out), {"command": " ".join(["python -m linattn_lib.experiments.gpu_check", *(argv or sys.argv[1:])]),
                                     "budget_s": args.budget_s})
    deadline = t_start + args.budget_s
    for name, fn in _sections(args, Path(args.out), do_bench):
        run_section(report, name, deadline, fn, dict(SECTION_CAPS, **RESUMED_CAPS) if args.resume else SECTION_CAPS)
    report.data["seconds"] = round(time.monotonic() - t_start, 1)
    report.put("summary", {name: r.get("status") for name, r in report.data["sections"].items() if name != "summary"})
    status = exit_status({n: r for n, r in report.data["sections"].items() if n not in ("summary", "setup")})
    print(f"gpu_check: wrote {args.out}/gpu_check.json and gpu_check.md in {report.data['seconds']} s; exit {status}")
    return status


if __name__ == "__main__":
    sys.exit(main())
