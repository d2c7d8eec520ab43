"""The performance model's predictions, saved for the book (appendix A.5).

    LINATTN_FLA_SOURCE=<a checkout of fla-org/flash-linear-attention> \\
        python -m linattn_lib.experiments.perf_predictions --out book/results/perf_model.json

runs `linattn_lib.chapters.perf_model` (ours and flash-linear-attention's decomposition on every
GPU it knows, B in {1, 4}, H = 16, T = 16384, D = 128, bf16) and writes its printed report and
the predicted milliseconds per row as JSON, with the commits and the Triton version they were
made with. It compiles every kernel variant (about two minutes cold); the book reads the file
instead of recompiling. Without fla's source its kernels are counted by analogy with ours
(the report says so).

    LINATTN_FLA_SOURCE=<checkout> python -m linattn_lib.experiments.perf_predictions --calibrate
    python -m linattn_lib.experiments.perf_predictions --calibrate --refit

hold the model to the published H100 times (book/results/published_h100.json) and calibrate it
(`linattn_lib.chapters.perf_calibration`): the model's components of fla's two published ops
and of ours at fla's six registry shapes and at the benchmark shapes, the fitted constants,
the leave-one-shape-out errors, ours restated beside fla's and Helion's published times,
written to book/results/perf_calibration.json (default --out). The components need fla's
source and compile (several minutes on two cores); --refit refits from the components
already in the file instead, with no compiling.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
from pathlib import Path

from ..chapters import perf_calibration as pc
from ..chapters import perf_fla
from ..chapters import perf_model as pm
from ..results import load_result


def _commit(git_dir: str | None = None) -> str:
    cmd = ["git"] + ([f"--git-dir={git_dir}"] if git_dir else []) + ["rev-parse", "--short", "HEAD"]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def split_gain(B: int, T: int, H: int, D: int, gpu: pm.GPU | str = "H100 SXM", *, stats: pm.Stats | None = None,
               normalize: bool = True, decay: str | None = None) -> dict:
    """What split-T buys at a shape: predicted seconds {"forward", "backward", "total"} of our
    causal op with the state passes walked whole ("one walk") and split as the launcher splits
    them on `gpu` ("split"), and "runs": the forward state pass's runs per sequence."""
    gpu = pm.GPUS[gpu] if isinstance(gpu, str) else gpu
    out = {}
    for name, sms in (("one walk", None), ("split", gpu.sms)):
        calls = pm.census(B, H, T, D, normalize=normalize, decay=decay, target=gpu.target, sms=sms)
        out[name] = pm._totals({part: pm.predict([pm.launch_of(c, gpu, stats) for c in cs], gpu)
                             for part, cs in calls.items()})
        if sms:
            state = next(c for c in calls["forward"] if c.kernel == "chunk_state_kernel")
            out["runs"] = state.args["n_splits"]
    return out


# heads at B = 1 where the state pass has too few programs for the GPU (split-T's rows)
SPLIT_HEADS = (1, 2, 4)


def predictions(Bs: tuple[int, ...] = (1, 4), T: int = 16384, H: int = 16, D: int = 128) -> dict:
    """{"report": the CLI's lines, "ms": {"<GPU>, B=<b>": {row: {forward, backward, total, x_roof}}},
    "split_T": {"<GPU>, B=1 H=<h>": {"runs", "one walk", "split"}}: our normalised op's ms with the
    state passes walked whole and split (`split_gain`) at the `SPLIT_HEADS`}."""
    import triton

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        pm.main([])
    ms = {}
    for gpu in pm.GPUS:
        for B in Bs:
            r = pm.compare(B, T, H, D, gpu)
            ms[f"{gpu}, B={B}"] = {label: {**{p: round(t[p] * 1e3, 4) for p in pm.PARTS},
                                           "x_roof": round(r["x_roof"][label], 3)}
                                   for label, t in r["times"].items()}
    split = {}
    for gpu in pm.GPUS:
        for heads in SPLIT_HEADS:
            r = split_gain(1, T, heads, D, gpu)
            split[f"{gpu}, B=1 H={heads}"] = {"runs": r["runs"], **{
                name: {p: round(r[name][p] * 1e3, 4) for p in pm.PARTS} for name in ("one walk", "split")}}
    fla = os.environ.get("LINATTN_FLA_SOURCE")
    fla_git = None if fla is None else (fla if fla.endswith((".git", "repo")) else str(Path(fla) / ".git"))
    return {"command": "python -m linattn_lib.experiments.perf_predictions --out book/results/perf_model.json",
            "linattn_commit": _commit(), "fla_commit": _commit(fla_git) if fla else "none (by analogy)",
            "triton": triton.__version__, "shape": f"H={H} T={T} D={D} bf16",
            "report": buf.getvalue().rstrip("\n").split("\n"), "ms": ms, "split_T": split}


def _dirty() -> bool | None:
    """Whether the library's or the kernels' sources differ from the commit (None: no git)."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", "kernels", "linattn_lib"], capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return bool(out.strip())


def _fla_commit() -> str:
    fla = os.environ.get("LINATTN_FLA_SOURCE")
    fla_git = None if fla is None else (fla if fla.endswith((".git", "repo")) else str(Path(fla) / ".git"))
    return _commit(fla_git) if fla else "none"


def calibration_components(published: dict) -> dict:
    """{(label, shape): `perf_calibration.components`} of fla's published ops and of ours (`pc.OURS`)
    at the published shapes, and of the `pc.HEAD_TO_HEAD` pairs at the benchmark shapes (compiles)."""
    if perf_fla.fla_source() is None:
        raise SystemExit("--calibrate needs fla's kernels: set LINATTN_FLA_SOURCE to a checkout of "
                         "fla-org/flash-linear-attention (or use --refit to reuse the stored components)")
    wanted = [(label, shape) for label in (*pc.OPS.values(), *pc.OURS.values()) for shape in published["shapes"]]
    wanted += [(label, pc.shape_name(B, 16384, 16, 128)) for B in pc.HEAD_TO_HEAD_B for pair in pc.HEAD_TO_HEAD
               for label in pair]
    return {key: pc.components(key[0], *pc.parse_shape(key[1])) for key in dict.fromkeys(wanted)}


def calibration(stored: dict | None = None) -> dict:
    """The calibration's record (book/results/perf_calibration.json): the fit, its leave-one-out
    errors, the tables, and the components they came from (computed, or `stored`'s when given)."""
    import triton

    published = load_result("published_h100.json")
    if stored is None:
        comps = calibration_components(published)
        made = {"linattn_commit": _commit(), "uncommitted_changes": _dirty(), "fla_commit": _fla_commit(),
                "triton": triton.__version__}
    else:
        comps = {(label, shape): c for label, by in stored["components"].items() for shape, c in by.items()}
        made = stored["components_made_at"]
    cal = pc.calibrate(published, comps)
    c = pc.Constants(**cal["constants"])
    second = [{**r, "calibrated_ms": round(pc.predicted_ms(comps, r, c), 4)}
              for r in pc.published_rows(published["second_run"])]
    result = {"command": "python -m linattn_lib.experiments.perf_predictions --calibrate",
              "components_made_at": made, "fit_made_at": {"linattn_commit": _commit(), "triton": triton.__version__},
              "gpu": pc.GPU, "published": published["source"], "bounds": pc.BOUNDS, **cal,
              "constants_readable": c.readable(), "restated": pc.restate(published, comps, cal),
              "head_to_head": pc.head_to_head(comps, cal), "second_run": second}
    result["report"] = calibration_report(result)
    by_label: dict[str, dict] = {}
    for (label, shape), comp in comps.items():
        by_label.setdefault(label, {})[shape] = comp
    return {**result, "components": by_label}


def refit_report(rows: list[dict], stored: dict, gpu: str = pc.GPU) -> tuple[list[str], dict]:
    """`perf_calibration.refit_measured` on measured rows (a GPU check's, on `gpu`), with the stored
    components (others computed: fla's need $LINATTN_FLA_SOURCE) carried to that GPU, beside the
    constants fitted on the published rows. Returns the printed lines and a record: the constants,
    and every row with the refitted model's error and the published-fitted model's (predicted /
    measured - 1)."""
    comps = {(label, shape): c for label, by in stored["components"].items() for shape, c in by.items()}
    published = pc.Constants(**stored["constants"])
    pc.refit_measured(rows, comps, fit_fn=lambda *_: published)  # computes what is missing into comps
    comps = pc.on_gpu(comps, gpu)
    _, before = pc.refit_measured(rows, comps, fit_fn=lambda *_: published)
    c, errors = pc.refit_measured(rows, comps)
    old = published.readable()
    lines = [f"on the {gpu} (the H100's components, HBM at its bandwidth)",
             f"refitted on {len(rows)} measured rows: " + ", ".join(f"{k} {v:g}" for k, v in c.readable().items()),
             "  (on the published rows: " + ", ".join(f"{k} {v:g}" for k, v in old.items()) + ")",
             "  error (predicted / measured - 1): refitted, fitted on the published rows"]
    lines += [f"  {r.get('op', r.get('kernel'))[:34]:34} {pc.shape_name(*pc.parse_shape(r['shape'])):19} "
              f"{r.get('timed', r.get('part')):8} {r['measured_ms']:>8.3f} ms  {pc._pct(e):>5} {pc._pct(b):>5}"
              for r, e, b in zip(rows, errors, before)]
    record = {"gpu": gpu, "constants": c.readable(), "published_constants": old,
              "rows": [{"op": r.get("op", r.get("kernel")), "shape": pc.shape_name(*pc.parse_shape(r["shape"])),
                        "timed": r.get("timed", r.get("part")), "measured_ms": r["measured_ms"],
                        "refit_error": round(e, 4), "published_fit_error": round(b, 4)}
                       for r, e, b in zip(rows, errors, before)]}
    return lines, record


def calibration_report(result: dict) -> list[str]:
    """The CLI's lines of a `calibration` record."""
    lines = [f"fla's published H100 times ({result['published']['repository']} {result['published']['path']} "
             f"at {result['published']['commit'][:8]}) beside the model (ms)", *pc.table_lines(result), "",
             "ours, calibrated, beside the published times (interval: the leave-one-out band)",
             *pc.restate_lines(result["restated"]), "",
             "head to head at H=16 T=16384 D=128, calibrated (both sides predicted), ours / fla:"]
    lines += [f"  {r['shape']:19}{r['timed']:8}{r['ours'].removeprefix('ours, '):30}{r['ratio']:>6.2f}"
              for r in result["head_to_head"]]
    goal = next(r for r in result["head_to_head"] if r["shape"] == "B2_T16384_H16_D128" and r["timed"] == "fwd+bwd"
                and r["ours"] == "ours, unnormalised, per-token decay")
    lines.append("ours, per-token decay, fwd+bwd at B2_T16384_H16_D128: {:.2f} ms [{:.2f}, {:.2f}]; Helion's "
                 "published (no decay) 1.355 ms".format(goal["ours_ms"], *goal["ours_interval_ms"]))
    first = {(r["op"], r["shape"], r["timed"]): r["published_ms"] for r in result["table"]}
    lines.append("a second published H100 run of fla (not fitted), large shapes: from the first run; calibrated model")
    for t in pc.TIMED:
        rows = [r for r in result["second_run"] if r["timed"] == t and r["shape"] in pc.LARGE]
        spread = [r["ms"] / first[r["op"], r["shape"], t] - 1 for r in rows]
        err = [r["calibrated_ms"] / r["ms"] - 1 for r in rows]
        lines.append(f"  {t:8} {pc._pct(min(spread))} to {pc._pct(max(spread))}; "
                     f"{pc._pct(min(err))} to {pc._pct(max(err))}")
    return lines


# the published tables (book/results/published_h100.json): pytorch/helion's H100 runs of fla and Helion
HELION = "pytorch/helion"
FIRST_RUN = ("fea89d20151c4b1c180eda5000cc79f6b13ed240", "examples/fla/BENCHMARKS.md",
             {"linear_attn (vanilla)": "linear_attn", "retention": "retention"})
SECOND_RUN = ("f881d9bc9468277d2a0c2b022c08411d1df3aa90", "BENCHMARKS.md",
              {"vanilla_linear_attn": "linear_attn", "retention": "retention"})
_ROW = re.compile(r"\| (B\d+_T\d+_H\d+_D\d+) \|[^|]*\| ([\d.]+)ms \| ([\d.]+)ms \|[^|]*\| ([\d.]+)ms \| ([\d.]+)ms \|")


def parse_benchmarks(markdown: str, sections: dict[str, str], gpu: str = "# H100") -> list[dict]:
    """The rows of Helion's BENCHMARKS.md tables under the `gpu` heading, in the sections named by
    `sections` (heading -> op): {"op", "shape", "helion": {"fwd", "fwd+bwd"}, "fla": {...}} in ms."""
    rows, section, inside = [], None, False
    for line in markdown.splitlines():
        if line.startswith("# "):
            inside = line.startswith(gpu)
        elif line.startswith("## "):
            section = sections.get(line[3:].strip()) if inside else None
        elif section and (m := _ROW.match(line)):
            hf, ff, hb, fb = (float(x) for x in m.groups()[1:])
            rows.append({"op": section, "shape": m.group(1), "fla": {"fwd": ff, "fwd+bwd": fb},
                         "helion": {"fwd": hf, "fwd+bwd": hb}})
    return rows


def registry_shapes(text: str) -> dict[str, dict[str, int]]:
    """fla's benchmarks/ops/registry.py SHAPE_CONFIGS (read with ast, never imported)."""
    import ast

    node = next(n for n in ast.parse(text).body if isinstance(n, ast.Assign)
                and any(getattr(t, "id", None) == "SHAPE_CONFIGS" for t in n.targets))
    return ast.literal_eval(node.value)


def published(helion_git: str, fla_git: str) -> dict:
    """published_h100.json from git directories of pytorch/helion and fla-org/flash-linear-attention."""
    show = lambda git, spec: subprocess.run(["git", f"--git-dir={git}", "show", spec], capture_output=True,
                                            text=True, check=True).stdout
    fla_commit = subprocess.run(["git", f"--git-dir={fla_git}", "rev-parse", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    (c1, p1, s1), (c2, p2, s2) = FIRST_RUN, SECOND_RUN
    return {"what": "Measured H100 times (ms) published by pytorch/helion: fla's chunk_linear_attn(normalize=False) "
                    "('linear_attn') and chunk_retention ('retention') and Helion's kernels of the same ops, forward "
                    "and forward+backward, bf16, D = DV, fla's layout (B, T, H, D) made off the timer; "
                    "helion._testing.do_bench",
            "source": {"repository": HELION, "path": p1, "commit": c1, "tables": "# H100 (sm_90)",
                       "harness": "benchmarks/run_linattn.py at the same commit",
                       "caveats": "the file's own: times from the earlier per-example bench.py scripts; Helion's "
                                  "configs from 'quick' autotuning; the fla version is not recorded"},
            "gpu": "H100 (sm_90)", "dtype": "bf16",
            "registry": {"repository": "fla-org/flash-linear-attention", "path": "benchmarks/ops/registry.py",
                         "commit": fla_commit, "name": "SHAPE_CONFIGS"},
            "shapes": registry_shapes(show(fla_git, "HEAD:benchmarks/ops/registry.py")),
            "rows": parse_benchmarks(show(helion_git, f"{c1}:{p1}"), s1),
            "second_run": {"what": "another published H100 run of the same harness (NVIDIA H100 80GB HBM3), later "
                                   "dropped from the repository as stale: for the run-to-run spread, not fitted",
                           "repository": HELION, "path": p2, "commit": c2,
                           "rows": parse_benchmarks(show(helion_git, f"{c2}:{p2}"), s2)}}


def dumps(result: dict) -> str:
    """JSON, indented, each list of numbers on one line."""
    text = json.dumps(result, indent=1)
    return re.sub(r"\[\s*((?:-?[\d.e+-]+,\s*)*-?[\d.e+-]+)\s*\]",
                  lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Write the predictions (or with --calibrate the calibration) to --out (JSON) and print the report."""
    parser = argparse.ArgumentParser(prog="python -m linattn_lib.experiments.perf_predictions")
    parser.add_argument("--out", default=None, help="default: book/results/perf_model.json "
                        "(--calibrate: book/results/perf_calibration.json)")
    parser.add_argument("--calibrate", action="store_true", help="hold the model to the published times, calibrate")
    parser.add_argument("--refit", action="store_true", help="with --calibrate: refit from the stored components")
    parser.add_argument("--measured", metavar="ROWS_JSON", nargs="+", help="with --calibrate: refit on measured "
                        "rows, each file a JSON list of {op, shape, timed, measured_ms} or a GPU check's "
                        "gpu_check.json (printed; written to --out when given)")
    parser.add_argument("--published", metavar="HELION_GIT_DIR", help="write published_h100.json from a git "
                        "directory of pytorch/helion (fla's registry from $LINATTN_FLA_SOURCE's git directory)")
    args = parser.parse_args(argv)
    if args.published:
        out = args.out or "book/results/published_h100.json"
        fla = os.environ.get("LINATTN_FLA_SOURCE", "")
        fla_git = fla if fla.endswith((".git", "repo")) else str(Path(fla) / ".git")
        Path(out).write_text(json.dumps(published(args.published, fla_git), indent=1) + "\n")
        print(f"wrote {out}")
        return
    if args.calibrate and args.measured:
        rows, gpu = [], pc.GPU
        for path in args.measured:
            got = json.loads(Path(path).read_text())
            if isinstance(got, dict):  # a GPU check's gpu_check.json, or {"rows": [...]}
                gpu = pc.gpu_of(got) if "sections" in got else gpu
                got = pc.rows_from_gpu_check(got) if "sections" in got else got["rows"]
            rows += got
        lines, result = refit_report(rows, load_result("perf_calibration.json"), gpu)
        print("\n".join(lines))
        if args.out:
            cmd = "python -m linattn_lib.experiments.perf_predictions --calibrate --measured"
            result["command"] = " ".join([cmd, *args.measured, "--out", args.out])
            Path(args.out).write_text(dumps(result))
            print(f"wrote {args.out}")
        return
    if args.calibrate:
        out = args.out or "book/results/perf_calibration.json"
        result = calibration(load_result("perf_calibration.json") if args.refit else None)
    else:
        out = args.out or "book/results/perf_model.json"
        result = predictions()
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(dumps(result))
    print("\n".join(result["report"]))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
