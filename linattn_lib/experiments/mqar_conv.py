"""MQAR with and without the short convolution: what the convolution in front of q, k, v does.

Chapter 7's Zoology task and training, exactly as book/results/mqar_zoology.json ran them
(same pairs, length, vocabulary, steps, batch, and each kind at the learning rate that sweep
picked for its width), with three front ends for each linear kind:

* "shift": RWKV's token shift on the embeddings (e_t + W e_{t-1}) in front of the first layer,
  no convolution: the committed sweep's own runs, read from mqar_zoology.json, not retrained;
* "conv": no token shift; every linear layer runs `LinearAttention(short_conv=True)`, a
  kernel-4 causal depthwise convolution on its q, k, v (fla's layers, Mamba, H3, Based);
* "none": neither, the bare mechanism: one layer must learn to bind a key to the value
  after it through attention alone.

CLI: `python -m linattn_lib.experiments.mqar_conv --out book/results/mqar_conv.json` (36 runs,
about 40 CPU-minutes), `--quick` (seconds). A stopped sweep resumes from <out>.partial.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path

from ..measure import torch_threads
from .common import parse_cli, progress_bar, run_metadata, write_json
from .mqar import config_for, run

VARIANTS = ("none", "conv")  # trained here; "shift" is read from the committed sweep
KINDS = ("linear", "deltanet", "gated_deltanet")
BASE = Path(__file__).resolve().parents[2] / "book" / "results" / "mqar_zoology.json"


def _train_one(job: tuple) -> dict:
    kind, d, seed, variant, common = job
    with torch_threads(1):
        cfg = config_for(kind, d_model=d, seed=seed, token_shift=False, short_conv=variant == "conv", **common)
        return dict(run(cfg), variant=variant)


def _key(r: dict) -> tuple:
    return r["variant"], r["kind"], r["d_model"], r["config"]["seed"]


def jobs_for(base: dict, kinds: Sequence[str], d_models: Sequence[int], seeds: Sequence[int],
             variants: Sequence[str], **override: object) -> list[tuple]:
    """(kind, d_model, seed, variant, settings) of every run, each at the base sweep's rate."""
    c = base["meta"]["config"]
    common = dict(train_pairs=tuple(c["pairs"]), eval_pairs=tuple(c["pairs"]), seq_len=c["seq_len"],
                  vocab_size=c["vocab_size"], steps=c["steps"], batch_size=c["batch_size"], task=c["task"],
                  power_a=c["power_a"])
    common.update(override)
    return [(k, d, s, v, dict(common, lr=override.get("lr", base["meta"]["lr"][k][str(d)])))
            for s in seeds for v in variants for k in kinds for d in d_models]


def shift_runs(base: dict, kinds: Sequence[str], d_models: Sequence[int], seeds: Sequence[int]) -> list[dict]:
    """The committed sweep's runs of these cells: the "shift" variant."""
    return [dict(r, variant="shift") for r in base["results"]
            if r["kind"] in kinds and r["d_model"] in d_models and r["config"]["seed"] in seeds]


def summary(results: list[dict]) -> dict:
    """{variant: {kind: {d_model: {pairs: [accuracy per seed]}}}}, seeds in order."""
    out: dict = {}
    for r in sorted(results, key=lambda r: r["config"]["seed"]):
        cell = out.setdefault(r["variant"], {}).setdefault(r["kind"], {}).setdefault(str(r["d_model"]), {})
        for n, a in r["accuracy"].items():
            cell.setdefault(n, []).append(a)
    return out


def sweep(args: argparse.Namespace, argv: list[str] | None) -> dict:
    base = json.loads(Path(args.base).read_text())
    override = dict(steps=5, batch_size=6, lr=3e-3) if args.quick else {}
    jobs = jobs_for(base, args.kinds, args.d_models, args.seeds, VARIANTS, **override)
    checkpoint = Path(str(args.out) + ".partial")
    done = {_key(r): r for r in (json.loads(checkpoint.read_text())["results"] if checkpoint.exists() else [])}
    meta = run_metadata("linattn_lib.experiments.mqar_conv", argv, device="cpu")
    meta.update(jobs=args.jobs, threads_per_job=1, cpu_count=os.cpu_count(), base=base["meta"]["command"],
                kinds=list(args.kinds), d_models=list(args.d_models), seeds=list(args.seeds))
    t0 = time.perf_counter()
    todo = [j for j in jobs if (j[3], j[0], j[1], j[2]) not in done]
    pool = None
    if args.jobs > 1 and len(todo) > 1:
        import multiprocessing as mp

        pool = mp.get_context("spawn").Pool(args.jobs)
    try:
        stream = pool.imap_unordered(_train_one, todo) if pool else map(_train_one, todo)
        for r in progress_bar(stream, desc="MQAR conv", total=len(todo), enabled=not args.no_progress):
            done[_key(r)] = r
            write_json(checkpoint, {"meta": meta, "results": list(done.values())})
    finally:
        if pool is not None:
            pool.terminate()
    meta["sweep_seconds"] = round(time.perf_counter() - t0, 1)
    results = shift_runs(base, args.kinds, args.d_models, args.seeds) + [done[(j[3], j[0], j[1], j[2])] for j in jobs]
    payload = {"meta": meta, "summary": summary(results), "results": results}
    write_json(args.out, payload)
    checkpoint.unlink(missing_ok=True)
    return payload


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m linattn_lib.experiments.mqar_conv",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", nargs="+", default=list(KINDS))
    p.add_argument("--d-models", nargs="+", type=int, default=[16, 32])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--base", default=str(BASE), help="the committed Zoology sweep (settings, rates, shift runs)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="runs in parallel, one thread each")
    p.add_argument("--no-progress", action="store_true")
    args = parse_cli(p, argv, "book/results/mqar_conv.json")
    if args.quick:
        args.kinds, args.d_models, args.seeds, args.jobs = ["linear"], [16], [0], 1
    payload = sweep(args, argv)
    print(f"wrote {len(payload['results'])} runs to {args.out} in {payload['meta']['sweep_seconds']:.0f} s")
    return payload


if __name__ == "__main__":
    main()
