"""Each parallel kernel's time on the H200, fitted on what the GPU check measured (book/results/gpu/).

The raw model (perf_model.py) lets an SM issue 4 warp instructions a cycle. On the H200 every
launch of ours took 2.3-2.8x its prediction, and the sweeps of tile widths, warps and pipelining
depth (B=1 H=16 T=16384 D=128 bf16) moved the kernels by up to 2.5x where the raw model's
ranking did not follow. Here the parallel kernels (chunk_output, chunk_dqk, chunk_dv: programs
that do not wait on each other) are refitted on those measured launches:

    t = HBM bytes / BW + I / (SMs x ipc(w) x clock) + 3 us,   ipc(w) = ipc16 x min(1, w / 16)^alpha

I: warp instructions the launch issues (programs x warps x SASS instructions of a warp, compiled
as the GPU's Triton compiled them); BW: the device-to-device copy the same GPU measured; w: warps
resident per SM (CTAs per SM by registers and shared memory, at most the programs per SM, times
warps per CTA). Two constants, fitted on log ratios; `leave_one_out` predicts each measured launch
from a fit without it. The state walks are not in the fit: they are a chain of 256 dependent steps
(T / 64), measured at 1.2-1.5 us a step in the profiled ops (`walk_steps`; fla's forward walk: 0.73).

`collect` compiles (minutes; run it under the Triton the GPU ran: `make gpu-deps` fills
.venv-gpu) and stores the rows in book/results/gpu/kernel_fit.json with `predictions`: the op's
parallel kernels at B=2 T=16384 H=16 D=128 under the configs as chosen and under the changes the
GPU check's whole-op sweep times (`gpu_extras.OVERRIDE_SETS`), so the appendix and the tests rerun
from the file. It compiles the measured launches from the current source too, so once a kernel
changes, only `predict` (`--predict`) runs: the measured rows keep the instructions of the code
the GPU ran. `python -m linattn_lib.experiments.kernel_fit [--collect | --predict]`.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

from ..chapters import perf_fla
from ..chapters import perf_model as pm
from . import gpu_extras

RESULTS = Path(__file__).resolve().parents[2] / "book" / "results" / "gpu"
STORED = RESULTS / "kernel_fit.json"
PARALLEL = ("chunk_output_kernel", "chunk_dqk_kernel", "chunk_dv_kernel", "chunk_dqkv_kernel")
# the measured launches: (file, section of "extras" or "profile" name); da24ccc, Triton 3.6.0, no cap
SWEEPS = (("gpu_check.json", "config_sweep"), ("gpu_check_resumed.json", "stage_sweep"))
PROFILES = (("gpu_check.json", "per-token decay", (False, "token")), ("gpu_check.json", "normalised", (True, None)),
            ("gpu_check_resumed.json", "unnormalised", (False, None)))
FLA_PROFILE = ("gpu_check_resumed.json", "unnormalised, fla")
# the launches as the GPU ran them (da24ccc): chunk_dqk without its register cap, no rounded operands,
# chunk_dv in two value tiles
AS_MEASURED = {"chunk_dqk": {"maxnreg": None, "round_operands": False},
               "chunk_dv": {"BK": 32, "BV": 64, "num_warps": 4, "maxnreg": None, "round_operands": False}}
SMS, CLOCK = 132, 1.755e9
GRID = (np.arange(0.8, 3.5001, 0.01), np.arange(0.0, 1.5001, 0.05))   # ipc16, alpha
VARIANTS = {"unnormalised": (False, None), "per-head decay": (False, "head"),
            "per-token decay": (False, "token"), "normalised": (True, None)}


def features(launch: pm.Launch) -> dict:
    """What the fit reads of a `perf_model.Launch`."""
    return {"kernel": launch.kernel, "instr": launch.programs * launch.num_warps * launch.instr_per_warp,
            "hbm": launch.bytes_hbm, "programs": launch.programs, "num_warps": launch.num_warps,
            "ctas_per_sm": launch.ctas_per_sm, "steps": launch.steps, "instr_per_warp": launch.instr_per_warp}


def warps_per_sm(row: dict) -> int:
    return min(row["ctas_per_sm"], math.ceil(row["programs"] / SMS)) * row["num_warps"]


def predict_us(row: dict, ipc16: float, alpha: float, bandwidth: float) -> float:
    """The fitted model's microseconds for one launch (a row of `features` plus the GPU's copy
    bandwidth in bytes/s)."""
    ipc = ipc16 * min(1.0, warps_per_sm(row) / 16) ** alpha
    return (row["hbm"] / bandwidth + row["instr"] / (SMS * ipc * CLOCK)) * 1e6 + 3.0


def fit(rows: list[dict], bandwidth: float) -> tuple[float, float]:
    """(ipc16, alpha) minimising the squared log ratios predicted / measured over `GRID`."""
    ipc, alpha = np.meshgrid(*GRID, indexing="ij")
    total = np.zeros_like(ipc)
    for r in rows:
        w = min(1.0, warps_per_sm(r) / 16)
        t = (r["hbm"] / bandwidth + r["instr"] / (SMS * ipc * w ** alpha * CLOCK)) * 1e6 + 3.0
        total += np.log(t / r["us"]) ** 2
    i, j = np.unravel_index(np.argmin(total), total.shape)
    return float(GRID[0][i]), float(GRID[1][j])


def fitted(data: dict) -> list[dict]:
    """The rows the fit uses: our parallel kernels' measured launches."""
    return [r for r in data["rows"] if r["who"] == "ours" and r["kernel"] in PARALLEL]


def leave_one_out(data: dict) -> list[float]:
    """predicted / measured - 1 for every fitted row, from a fit on the others."""
    rows, bw = fitted(data), data["bandwidth"]
    return [predict_us(r, *fit(rows[:i] + rows[i + 1:], bw), bw) / r["us"] - 1 for i, r in enumerate(rows)]


def error_band(errors: list[float]) -> dict:
    a = np.abs(np.asarray(errors))
    return {"median": float(np.median(a)), "p90": float(np.percentile(a, 90)), "max": float(a.max()),
            "rows": len(a)}


def walk_steps(data: dict) -> list[float]:
    """The state walks' measured microseconds per sequential step (a chunk), in the profiled ops."""
    return [r["us"] / r["steps"] for r in data["rows"]
            if r["kernel"] == "chunk_state_kernel" and r["src"].startswith("profile")]


def _load(file: str) -> dict:
    return json.loads((RESULTS / file).read_text())


def _sweep_rows(gpu: pm.GPU) -> list[dict]:
    """Our kernels alone, as the GPU check's config and stage sweeps timed them (the launch's
    share: the sweep's other launches, the chunk decays, at the raw model's time)."""
    import torch

    from .. import kernels as K
    with pm.recording(), pm._capability("sm_90", SMS):
        calls = gpu_extras._sweep_calls(1, 16, 16384, 128, torch.bfloat16, "meta")
    rows = []
    for file, key in SWEEPS:
        for r in _load(file)["sections"]["extras"][key]:
            if "ms" not in r:
                continue
            with pm.recording() as rec, pm._capability("sm_90", SMS), K.overridden(AS_MEASURED):
                calls[r["kernel"]](r["config"])
            launches = [pm.launch_of(c, gpu) for c in rec if c.fn is not None]
            main = next(x for x in launches if x.kernel == r["kernel"] + "_kernel")
            rest = sum(pm.launch_time(x, gpu)["time"] for x in launches if x is not main) * 1e6
            rows.append({"src": f"{key} {r['shape']}", "who": "ours", "config": r["config"],
                         "us": r["ms"] * 1e3 - rest, **features(main)})
    return rows


def _profile_rows(gpu: pm.GPU) -> list[dict]:
    """Our kernels as torch.profiler timed them in one forward+backward (B=2), matched in order to
    the launches of the op's census (da24ccc ran chunk_dqk without a register cap)."""
    from .. import kernels as K
    rows = []
    for file, name, (normalize, decay) in PROFILES:
        prof = _load(file)["sections"]["profile"][name]
        with K.overridden(AS_MEASURED):
            c = pm.census(2, 16, 16384, 128, normalize=normalize, decay=decay, target="sm_90", sms=SMS)
        launches = [pm.launch_of(x, gpu) for part in ("forward", "backward") for x in c[part] if x.fn is not None]
        seq = [s for s in prof["sequence"] if not s["name"].startswith("void")]
        if [s["name"] for s in seq] != [x.kernel for x in launches]:
            raise ValueError(f"{name}: the profile's kernels are not the census's")
        rows += [{"src": f"profile {name} {prof['shape']}", "who": "ours", "us": s["us"], **features(x)}
                 for s, x in zip(seq, launches) if x.kernel in PARALLEL + ("chunk_state_kernel",)]
    return rows


def _fla_rows(gpu: pm.GPU, root: str | None) -> list[dict]:
    """fla's parallel kernels as profiled beside ours (unnormalised, B=2), under each config its
    autotuner could have picked (which it picked was not recorded): a check, not fitted."""

    kernels = perf_fla.fla_kernels(root)
    if not kernels:
        return []
    file, name = FLA_PROFILE
    measured = {}
    for s in _load(file)["sections"]["profile"][name]["sequence"]:
        measured.setdefault(s["name"], s["us"])
    cands = perf_fla.fla_candidates(128)
    rows = []
    for kname in ("chunk_fwd_kernel_o", "chunk_bwd_kernel_dqkwg", "chunk_bwd_kernel_dv"):
        for cfg in cands[kname]:
            configs = {**{n: opts[0] for n, opts in cands.items()}, kname: cfg}
            calls = pm.replay_calls(2, 16, 16384, 128, (False, None), configs, kernels)
            x = next(pm.launch_of(c, gpu) for part in calls.values() for c in part if c.kernel == kname)
            rows.append({"src": f"profile {name}", "who": "fla", "config": cfg, "us": measured[kname], **features(x)})
    return rows


def op_kernels(variant: str, changes: dict, gpu: pm.GPU) -> list[dict]:
    """The features of the op's parallel launches at B=2 T=16384 H=16 D=128 (bf16, sm_90), forward
    and backward, with `kernels.overridden(changes)`."""
    from .. import kernels as K
    normalize, decay = VARIANTS[variant]
    with K.overridden(changes):
        c = pm.census(2, 16, 16384, 128, normalize=normalize, decay=decay, target="sm_90", sms=SMS)
    return [features(pm.launch_of(x, gpu)) for part in ("forward", "backward") for x in c[part]
            if x.fn is not None and x.kernel in PARALLEL]


def collect(fla_root: str | None = None) -> dict:
    """Every row and prediction of the stored file, compiled with this environment's Triton. The
    measured rows are compiled from the kernels' current source: right only while it is the source
    the GPU ran (a kernel changed since: `predict`)."""
    gpu = pm.GPUS["H200 SXM"]
    env = _load(SWEEPS[0][0])["sections"]["environment"]
    data = {"command": "python -m linattn_lib.experiments.kernel_fit --collect",
            "measured_triton": env["triton"], "gpu": env["gpu"],
            "bandwidth": env["ceilings"]["copy_TB_per_s"] * 1e12,
            "rows": _sweep_rows(gpu) + _profile_rows(gpu) + _fla_rows(gpu, fla_root)}
    return predict(data)


def predict(data: dict) -> dict:
    """`data` with its predictions compiled from the kernels' current source, its measured rows
    kept as they were compiled (the kernels the GPU ran)."""
    import triton

    from .. import kernels as K
    gpu = pm.GPUS["H200 SXM"]
    sets = gpu_extras.OVERRIDE_SETS
    data = {**data, "triton": triton.__version__}
    data["predictions"] = {v: {name: op_kernels(v, changes, gpu) for name, changes in sets.items()}
                           for v in VARIANTS}
    data["chosen_round_operands"] = {k: K.rounds_operands(K.select_config(k, 128, "bf16", (9, 0)), "bf16")
                                     for k in ("chunk_output", "chunk_dqk", "chunk_dv")}
    return data


def predicted_totals(data: dict, ipc16: float, alpha: float) -> dict[str, dict[str, float]]:
    """variant -> name of `predictions` -> microseconds of its parallel launches, by the fitted model."""
    return {v: {name: sum(predict_us(r, ipc16, alpha, data["bandwidth"]) for r in rows) for name, rows in sets.items()}
            for v, sets in data["predictions"].items()}


def report(data: dict) -> list[str]:
    rows, bw = fitted(data), data["bandwidth"]
    ipc16, alpha = fit(rows, bw)
    band = error_band(leave_one_out(data))
    out = [f"fitted on {band['rows']} measured launches ({data['gpu']}, Triton {data['measured_triton']}; SASS "
           f"from Triton {data['triton']}): ipc16 {ipc16:.2f} warp instructions per SM-cycle at 16 warps "
           f"(the raw model: 4), alpha {alpha:.2f}, copy bandwidth {bw / 1e12:.2f} TB/s",
           f"leave-one-out |error|: median {band['median']:.0%}, 90th percentile {band['p90']:.0%}, "
           f"max {band['max']:.0%}"]
    for r in data["rows"]:
        if r["who"] == "fla":
            out.append(f"  fla {r['kernel']} {r['config']}: measured {r['us']:.0f} us, "
                       f"predicted {predict_us(r, ipc16, alpha, bw):.0f}")
    steps = walk_steps(data)
    out.append(f"state walks of the profiled ops: {min(steps):.2f}-{max(steps):.2f} us a step ({len(steps)} launches)")
    for v, sets in predicted_totals(data, ipc16, alpha).items():
        base = sets["as chosen"]
        out.append(f"  {v}: parallel kernels {base:.0f} us as chosen; " + "; ".join(
            f"{name} {t / base - 1:+.0%}" for name, t in sets.items() if name != "as chosen"))
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--collect", action="store_true", help=f"compile the measured launches, store them in {STORED.name} (minutes)")
    mode.add_argument("--predict", action="store_true", help=f"recompute only the predictions in {STORED.name}")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.collect:
        import os

        data = collect(os.environ.get("LINATTN_FLA_SOURCE"))
        STORED.write_text(json.dumps(data, indent=1) + "\n")
    elif args.predict:
        STORED.write_text(json.dumps(predict(json.loads(STORED.read_text())), indent=1) + "\n")
    print("\n".join(report(json.loads(STORED.read_text()))))


if __name__ == "__main__":
    main()
