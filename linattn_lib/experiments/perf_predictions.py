"""The performance model's predictions, saved for the book (appendix A.5).

    LINATTN_FLA_SOURCE=<a checkout of fla-org/flash-linear-attention> \\
        python -m linattn_lib.experiments.perf_predictions --out book/results/perf_model.json

runs `linattn_lib.chapters.perf_model` (ours and flash-linear-attention's decomposition on every
GPU it knows, B in {1, 4}, H = 16, T = 16384, D = 128, bf16) and writes its printed report and
the predicted milliseconds per row as JSON, with the commits and the Triton version they were
made with. It compiles every kernel variant (about two minutes cold); the book reads the file
instead of recompiling. Without fla's source its kernels are counted by analogy with ours
(the report says so).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
from pathlib import Path

from ..chapters import perf_model as pm


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


def main(argv: list[str] | None = None) -> None:
    """Write the predictions to --out (JSON) and print the report."""
    parser = argparse.ArgumentParser(prog="python -m linattn_lib.experiments.perf_predictions")
    parser.add_argument("--out", default="book/results/perf_model.json")
    args = parser.parse_args(argv)
    result = predictions()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(result["report"]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
