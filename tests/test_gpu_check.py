"""The GPU check's machinery on a CPU, cheaply (the full dry run is `make gpu-rehearsal`).

* the launch plan: the dry run records the benchmark's calls of ours and turns each launch
  into what Triton's JIT would compile; the public API launches nothing the op does not;
* the report: JSON written after every section, even when a later one raises or is cut;
* the wheels: a wheel carried in a folder installs (pip --target, or unzipped) and imports;
* the exit statuses: no CUDA -> 2; a failed compile in the dry run -> 1; the time limits;
* a resumed run (--resume): what the earlier run measured or passed is not repeated.
"""
from __future__ import annotations

import base64
import hashlib
import importlib
import json
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import pytest
import torch

from linattn_lib.core.triton_ops import triton_available

needs_triton = pytest.mark.skipif(not triton_available(), reason="the Triton kernels do not import here")


# --------------------------------------------------------------------------- the plan


def _small_cases():
    from linattn_lib.experiments.gpu_bench import VARIANTS, Case

    return [Case(2, 128, 2, 32, v, p) for v in VARIANTS for p in ("ours: linear_attention", "ours: op")]


@needs_triton
def test_the_whole_op_sweep_is_precompiled_with_its_changes():
    """The precompile plan (`gpu_plan.planned_calls`) ends with the whole-op sweep's calls, one per
    variant and changed set, recorded under their changes: the plain walks at 2 and 4 stages
    where the op runs them 3 deep, chunk_output and chunk_dv in two value tiles, chunk_dqk in one
    key tile, decayed walks 3 deep, dq, dk, dv in one kernel (small stand-in shape)."""
    from linattn_lib.experiments import gpu_extras
    from linattn_lib.experiments.gpu_plan import record_plan

    calls = list(gpu_extras.override_plan_calls(B=1, T=256, H=2, D=128))
    changed = [n for n, c in gpu_extras.OVERRIDE_SETS.items() if c]
    variants = ("per-token decay", "unnormalised", "normalised")
    assert [label for label, _ in calls] == [f"{v}, {n}" for v in variants for n in changed]
    launches, _ = record_plan(calls[len(changed):2 * len(changed)])  # unnormalised
    by_set = {}
    for launch in launches:
        by_set.setdefault(launch["call"].split(", ", 1)[1], []).append(launch)
    walks = lambda name: {x["num_stages"] for x in by_set[name] if x["kernel"] == "chunk_state_kernel"}
    assert walks("plain state walks at 2 stages") == {2} and walks("chunk_dqk in one key tile") == {3}
    assert walks("plain state walks at 4 stages") == {4}
    tiles = lambda name: {x["grid"][0] for x in by_set[name] if x["kernel"] == "chunk_output_kernel"}
    # chunk_output and chunk_dv: one value tile a chunk on sm_90 (D = 128), two as before
    assert tiles("chunk_output in two value tiles (before)") == {2} and tiles("operands rounded to bf16") == {1}
    dv = lambda name: {x["grid"][0] for x in by_set[name] if x["kernel"] == "chunk_dv_kernel"}
    assert dv("chunk_dv in two value tiles (before)") == {2} and dv("operands rounded to bf16") == {1}
    dqk = lambda name: {x["grid"][0] for x in by_set[name] if x["kernel"] == "chunk_dqk_kernel"}
    assert dqk("chunk_dqk in one key tile") == {1} and dqk("operands rounded to bf16") == {2}
    # dq, dk, dv in one kernel: one program per chunk, in place of both kernels
    kernels = lambda name: {x["kernel"] for x in by_set[name]}
    assert "chunk_dqkv_kernel" in kernels("dq, dk, dv in one kernel")
    assert not {"chunk_dqk_kernel", "chunk_dv_kernel"} & kernels("dq, dk, dv in one kernel")
    assert {x["grid"][0] for x in by_set["dq, dk, dv in one kernel"] if x["kernel"] == "chunk_dqkv_kernel"} == {1}
    assert "chunk_dqkv_kernel" not in kernels("operands rounded to bf16")
    # with a per-token decay, the walks reading their keys transposed run as deep as plain ones
    token, _ = record_plan(calls[:len(changed)])
    deep = lambda name: {x["num_stages"] for x in token
                         if x["kernel"] == "chunk_state_kernel" and x["call"].endswith(name)}
    assert deep("decayed walks read their keys transposed") == {3} and deep("operands rounded to bf16") == {2}


def test_every_benchmark_row_of_ours_is_in_the_plan():
    """plan_calls makes a forward and a forward+backward of every (shape, variant) the benchmark
    times with ours (the op everywhere, the public API at B=2 of the main shape)."""
    from linattn_lib.experiments.gpu_bench import MAIN_T, benchmark_cases

    cases = benchmark_cases()
    ours = [c for c in cases if c.provider.startswith("ours")]
    labels = set()
    for c in ours:
        if c.provider != "ours: linear_attention" or (c.B == 2 and c.T == MAIN_T):
            labels |= {f"{c.label} forward", f"{c.label} forward+backward"}
    from linattn_lib.experiments import gpu_bench  # its stand-ins are made when a call runs, not here

    planned = {label for label, _ in gpu_bench.plan_calls(cases)}
    assert planned == labels
    shapes = {(c.B, c.T, c.H, c.D) for c in cases}
    assert {(2, 16384, 16, 128), (1, 16384, 16, 128), (4, 16384, 16, 128)} <= shapes
    assert {(1, 8192, 96, 128), (8, 2048, 32, 256), (8, 1024, 8, 64)} <= shapes  # fla's registry shapes
    assert {c.provider for c in cases} == {"ours: linear_attention", "ours: op", "ours: op, kept states", "fla",
                                           "sdpa"}
    kept = [c for c in cases if c.provider == "ours: op, kept states"]
    assert sorted((c.B, c.variant) for c in kept) == sorted(
        (B, v) for B in (1, 2, 4) for v in ("per-token decay", "normalised"))


@needs_triton
def test_the_plan_holds_what_the_jit_would_compile():
    """Each recorded launch becomes the JIT's specialisation: bf16 pointers, 16-byte alignment,
    the launch's warps and constexprs; equal launches share a key, and the public API launches
    exactly the op's kernels."""
    from linattn_lib.experiments import gpu_bench, gpu_plan

    cases = _small_cases()
    launches, jobs = gpu_plan.record_plan(gpu_bench.plan_calls(cases, api=lambda case: True))
    by_call: dict = {}
    for launch in launches:
        by_call.setdefault(launch["call"], []).append(launch["key"])
    for c in cases:
        if c.provider == "ours: op":
            api = c.label.replace("ours: op", "ours: linear_attention")
            for part in ("forward", "forward+backward"):
                assert by_call[f"{c.label} {part}"] == by_call[f"{api} {part}"]
    assert len({j["key"] for j in jobs}) == len(jobs) and sum(j["calls"] for j in jobs) == len(launches)
    state = next(j for j in jobs if j["kernel"] == "chunk_state_kernel")
    pointers = [t for t in state["signature"].values() if t.startswith("*")]
    assert "*bf16" in pointers and state["options"]["num_warps"] in (1, 2, 4, 8)
    assert state["constexprs"] and sum(v == "constexpr" for v in state["signature"].values()) == len(state["constexprs"])
    assert any(a == [["tt.divisibility", 16]] for a in state["attrs"].values())  # aligned pointers
    assert {"chunk_state_kernel", "chunk_output_kernel", "chunk_dqk_kernel", "chunk_dv_kernel"} <= {j["kernel"] for j in jobs}
    assert {j["kernel"] for j in jobs} <= gpu_plan.our_kernel_names()


@needs_triton
def test_a_plan_job_compiles_for_sm90():
    """One job compiled in this process, as a pool worker would: shared memory and warps read back."""
    from linattn_lib.experiments import gpu_bench, gpu_plan

    case = [c for c in _small_cases() if c.variant == "unnormalised" and c.provider == "ours: op"]
    _, jobs = gpu_plan.record_plan([next(gpu_bench.plan_calls(case))])  # the forward
    job = min(jobs, key=lambda j: len(j["signature"]))
    res = gpu_plan.compile_job(job)
    assert res["ok"], res.get("error")
    assert res["shared"] >= 0 and res["num_warps"] == job["options"]["num_warps"]
    bad = gpu_plan.compile_job(dict(job, qualname="no_such_kernel"))
    assert not bad["ok"] and "AttributeError" in bad["error"]


def test_bf16_passes_the_cpu_check_only_while_planning():
    from linattn_lib import linear_attention
    from linattn_lib.experiments.gpu_plan import bf16_as_on_cuda

    q = torch.zeros(1, 1, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="bfloat16 on CPU"):
        linear_attention(q, q, q, backend="triton")
    from linattn_lib.core import triton_ops

    with bf16_as_on_cuda():
        triton_ops._check_inputs("x", q, q)  # no error
    with pytest.raises(TypeError, match="bfloat16 on CPU"):
        triton_ops._check_inputs("x", q, q)


# ------------------------------------------------------------------------- the report


def test_the_report_is_written_after_each_section_even_when_one_raises_or_is_cut(tmp_path, monkeypatch):
    from linattn_lib.experiments import gpu_check

    monkeypatch.setattr(gpu_check, "BACKSTOP_S", 0.0)
    monkeypatch.setitem(gpu_check.SECTION_CAPS, "slow", 0.3)
    report = gpu_check.Report(tmp_path, {"command": "test"})
    deadline = time.monotonic() + 60
    read = lambda: json.loads((tmp_path / "gpu_check.json").read_text())["sections"]

    gpu_check.run_section(report, "first", deadline, lambda end, put: {"x": 1})
    assert read()["first"]["status"] == "passed" and read()["first"]["x"] == 1

    def raises(end, put):
        put({"rows": [1]})
        raise ValueError("boom")

    gpu_check.run_section(report, "second", deadline, raises)
    assert read()["second"]["status"] == "failed" and "boom" in read()["second"]["error"]
    assert read()["second"]["rows"] == [1] and read()["first"]["x"] == 1

    def slow(end, put):
        put({"rows": [1, 2]})
        time.sleep(5)
        return {"never": True}

    t0 = time.monotonic()
    gpu_check.run_section(report, "slow", deadline, slow)
    assert time.monotonic() - t0 < 3
    assert read()["slow"]["status"] == "cut" and read()["slow"]["rows"] == [1, 2]
    gpu_check.run_section(report, "late", time.monotonic() + 1, lambda end, put: {"ran": True})
    assert read()["late"]["status"] == "cut" and "ran" not in read()["late"]
    assert "| second | failed |" in (tmp_path / "gpu_check.md").read_text()
    assert gpu_check.exit_status(read()) == 1
    assert gpu_check.exit_status({k: v for k, v in read().items() if k != "second"}) == 0


def test_time_limits_nest():
    from linattn_lib.experiments.gpu_limits import Timeout, time_limit

    t0 = time.monotonic()
    with pytest.raises(Timeout):
        with time_limit(0.2):
            with time_limit(10):  # the outer one ends sooner and stays in force
                time.sleep(2)
    assert time.monotonic() - t0 < 1.5
    with pytest.raises(Timeout):
        with time_limit(1.0):
            try:
                with time_limit(0.1):
                    time.sleep(1)
            except Timeout:
                pass
            time.sleep(10)  # the outer one was re-armed
    assert time.monotonic() - t0 < 4


def test_launches_pair_by_name_and_occurrence():
    from linattn_lib.experiments.gpu_sections import pair_launches

    measured = [{"name": "a", "us": 1.0}, {"name": "b", "us": 2.0}, {"name": "a", "us": 3.0}, {"name": "elementwise", "us": 9}]
    predicted = [{"kernel": "a", "predicted_us": 1.5}, {"kernel": "a", "predicted_us": 2.5},
                 {"kernel": "torch:aten.sum", "predicted_us": 1.0}, {"kernel": "b", "predicted_us": 0.5},
                 {"kernel": "b", "predicted_us": 0.5}]
    assert [r["measured_us"] for r in pair_launches(measured, predicted)] == [1.0, 3.0, None, 2.0, None]


@needs_triton
def test_fla_autotuned_configs_are_recorded(monkeypatch):
    """The benchmark keeps what fla's autotuners chose (found in fla's loaded modules, through
    the heuristics around them) and how the last tuning timed every candidate: the configs fla's
    walks ran at, which no profile shows. The report lists them."""
    import types

    import triton
    import triton.language as tl

    from linattn_lib.experiments.gpu_fla_warm import autotuned
    from linattn_lib.experiments.gpu_report import fla_autotuned_lines

    configs = [triton.Config({"BV": bv}, num_warps=w, num_stages=2) for bv in (32, 64) for w in (4, 8)]

    @triton.heuristics({"USE_G": lambda args: args["g"] is not None})
    @triton.autotune(configs=configs, key=["K", "BT"])
    @triton.jit
    def walk_kernel(x, g, K: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, USE_G: tl.constexpr):
        pass

    module = types.ModuleType("fla.ops.fake")
    module.walk_kernel = walk_kernel
    monkeypatch.setitem(sys.modules, "fla.ops.fake", module)
    assert autotuned() == {"chosen": [], "timings": {}}
    tuner = walk_kernel.fn  # as Triton's autotuner fills them after timing at the real shape
    tuner.cache[(128, 64, "torch.bfloat16")] = configs[3]
    tuner.configs_timings = {c: [0.5 - 0.1 * i, 0.4, 0.6] for i, c in enumerate(configs)}
    got = autotuned()
    assert got["chosen"] == [{"kernel": "walk_kernel", "config": {"BV": 64, "num_warps": 8, "num_stages": 2},
                              "key": {"K": "128", "BT": "64", "dtypes": ["torch.bfloat16"]}}]
    assert [r["ms"] for r in got["timings"]["walk_kernel"]] == [0.2, 0.3, 0.4, 0.5]
    assert got["timings"]["walk_kernel"][0]["config"] == got["chosen"][0]["config"]
    json.dumps(got)
    lines = fla_autotuned_lines(got, fastest=2)
    assert "| walk_kernel |" in lines[5] and "0.200 ms" in lines[-1] and "0.400 ms" not in lines[-1]


# ------------------------------------------------------------------------- the wheels


def _fake_wheel(folder: Path, name: str) -> Path:
    files = {f"{name}/__init__.py": "VALUE = 42\n",
             f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{name}-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(t.encode()).digest()).rstrip(b'=').decode()},{len(t)}"
              for p, t in files.items()]
    files[f"{name}-1.0.dist-info/RECORD"] = "\n".join(record + [f"{name}-1.0.dist-info/RECORD,,"]) + "\n"
    wheel = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for p, t in files.items():
            zf.writestr(p, t)
    return wheel


@pytest.mark.parametrize("use_pip", [True, False], ids=["pip", "unzipped"])
def test_a_carried_wheel_installs_and_imports(tmp_path, monkeypatch, use_pip):
    from linattn_lib.experiments.gpu_sections import install_wheels

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "")
    name = f"linattn_fake_wheel_{'pip' if use_pip else 'zip'}"
    (tmp_path / "whl").mkdir()
    _fake_wheel(tmp_path / "whl", name)
    res = install_wheels(tmp_path / "whl", tmp_path / "site", use_pip=use_pip)
    assert res["status"] == "passed" and res["method"] == ("pip" if use_pip else "zipfile"), res
    assert importlib.import_module(name).VALUE == 42
    assert str(tmp_path / "site") in sys.path[0] and str(tmp_path / "site") in __import__("os").environ["PYTHONPATH"]
    sys.modules.pop(name, None)
    assert install_wheels(tmp_path / "none")["status"] == "not run"


# ------------------------------------------------------------------------- exit statuses


def test_without_cuda_nothing_runs_and_the_status_is_2(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    from linattn_lib.experiments import gpu_check

    assert gpu_check.main(["--out", str(tmp_path / "out")]) == 2
    assert not (tmp_path / "out").exists() and "no CUDA device" in capsys.readouterr().err


@needs_triton
def test_the_dry_run_fails_when_a_compile_fails(monkeypatch, capsys):
    from linattn_lib.experiments import gpu_bench, gpu_check, gpu_dryrun, gpu_plan

    cases = [c for c in _small_cases() if c.variant == "unnormalised"]
    real = gpu_bench.plan_calls
    monkeypatch.setattr(gpu_bench, "plan_calls", lambda: real(cases, api=lambda case: True))
    monkeypatch.setattr(gpu_dryrun, "model_check", lambda launches: (["model: stub"], True))
    ok = lambda jobs, workers=None: [{"key": j["key"], "kernel": j["kernel"], "ok": True, "shared": 0, "seconds": 0.0}
                                     for j in jobs]
    monkeypatch.setattr(gpu_plan, "compile_jobs", ok)
    assert gpu_check.main(["--dry-run", "--wheels", "/nonexistent"]) == 0
    assert "chunk_state(" in capsys.readouterr().out
    monkeypatch.setattr(gpu_plan, "compile_jobs", lambda jobs, workers=None: [dict(r, ok=False, error="ptxas: boom")
                                                                              for r in ok(jobs)])
    assert gpu_check.main(["--dry-run", "--wheels", "/nonexistent"]) == 1
    assert "FAILED: ptxas: boom" in capsys.readouterr().out
    monkeypatch.setattr(gpu_plan, "compile_jobs", ok)
    monkeypatch.setattr(gpu_dryrun, "model_check", lambda launches: (["model: FAILED"], False))
    assert gpu_check.main(["--dry-run", "--wheels", "/nonexistent"]) == 1


def test_kernel_tests_report_failures_and_cuts(tmp_path):
    """The kernel-test runner counts passes and failures from pytest's log, and a run stopped at
    its deadline is reported as cut with what it had done."""
    from linattn_lib.experiments.gpu_sections import run_kernel_tests

    tests = tmp_path / "repo" / "tests"
    tests.mkdir(parents=True)
    (tests / "test_a.py").write_text(textwrap.dedent("""
        import time
        def test_ok(): pass
        def test_bad(): assert False
        def test_slow(): time.sleep(300)
    """))
    out = tmp_path / "out"
    out.mkdir()
    # 20 s: pytest's start must fit in it on a loaded 2-core machine (5 s did not, once)
    res = run_kernel_tests(out, [str(tests / "test_a.py")], time.monotonic() + 20)
    assert res["status"] == "failed" and res["passed"] == 1 and res["failed"] == 1, res
    assert res["returncode"] is None and (out / "kernel_tests.log").exists()
    assert run_kernel_tests(out, [str(tests / "missing.py")], time.monotonic() + 5)["status"] == "not run"


# --------------------------------------------------------------------------- --resume


def test_a_resumed_run_skips_what_the_earlier_one_measured():
    """Rows the earlier run timed are not timed again, nor one whose first call ran into its cap
    (one cut short by the budget is); the rest keep their order except that the main shapes'
    leftovers go last; self-test checks it passed are skipped, one it failed is not."""
    from linattn_lib.experiments import gpu_check
    from linattn_lib.experiments.gpu_bench import MAIN_T, benchmark_cases
    from linattn_lib.experiments.kernel_selftest import _case_name, selftest_plan

    cases = benchmark_cases()
    timed, timed_out = cases[0], cases[1]
    autotuned = next(c for c in cases if c.provider == "fla")
    row = lambda c, **kw: {"shape": c.shape, "variant": c.variant, "provider": c.provider, **kw}
    checks = [(_case_name(k, c), str(d).replace("torch.", "")) for k, c, d in selftest_plan("cpu", False)]
    previous = {"benchmark": {"rows": [row(timed, forward_ms=1.0), row(timed_out, error="timed out after 20 s"),
                                       row(autotuned, error="timed out after 90 s (first call: compiles)")]},
                "selftest": {"checks": [{"name": checks[0][0], "dtype": checks[0][1], "status": "passed"},
                                        {"name": checks[1][0], "dtype": checks[1][1], "status": "failed"}]}}
    left = gpu_check.resumed_cases(previous)
    # cut by the budget: tried again; at its own cap (fla's autotuning): not
    assert timed not in left and timed_out in left and autotuned not in left and len(left) == len(cases) - 2
    main = [c.T == MAIN_T for c in left]
    assert main == sorted(main) and 0 < sum(main) < len(main)
    assert gpu_check.passed_checks(previous) == {checks[0]}
    assert gpu_check.resumed_cases({}) is None and gpu_check.passed_checks({}) == set()


@needs_triton
def test_the_self_test_skips_checks_passed_before():
    """run_kernel_selftest(skip=...) leaves out exactly the named checks."""
    from linattn_lib.experiments.kernel_selftest import _case_name, run_kernel_selftest, selftest_plan

    everything = {(_case_name(k, c), str(d).replace("torch.", "")) for k, c, d in selftest_plan("cpu", True)}
    res = run_kernel_selftest("cpu", quick=True, skip=everything)
    assert res["checks"] == [] and res["status"] == "passed"


def test_the_resume_flag_is_parsed():
    from linattn_lib.experiments import gpu_check

    args = gpu_check._parser().parse_args(["--resume", "x.json"])
    assert args.resume == "x.json" and gpu_check._parser().parse_args([]).resume is None


def test_the_profile_also_profiles_the_candidate_under_its_changes(monkeypatch):
    """gpu_check's profile section: the profiled variants as chosen, then the first of them under
    the whole-op sweep's PROFILED_CANDIDATE (its changes active during that call only), each
    stored under its own key as soon as it is measured."""
    import argparse

    from linattn_lib import kernels as K
    from linattn_lib.experiments import gpu_check, gpu_sections
    from linattn_lib.experiments.gpu_bench import PROFILED

    seen = []

    def fake(variant, B, T, H, D, deadline, provider="ours: op"):
        seen.append((variant, provider, dict(K.configs.OVERRIDES)))
        return {"variant": variant}

    monkeypatch.setattr(gpu_sections, "profile_fwd_bwd", fake)
    stored = []
    result = gpu_check._profile(argparse.Namespace(resume=None))(float("inf"), lambda r: stored.append(dict(r)))
    candidate = gpu_check.PROFILED_CANDIDATE
    assert list(result) == [*PROFILED, f"{PROFILED[0]}, {candidate}"] and len(stored) == len(result)
    assert [s[2] for s in seen] == [{}] * len(PROFILED) + [gpu_check.OVERRIDE_SETS[candidate]]
    assert K.configs.OVERRIDES == {}
