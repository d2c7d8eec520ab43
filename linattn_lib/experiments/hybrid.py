"""Hybrid stacks: which layers stay softmax, measured on recall and on decoding cost.

A stack is a string with one letter a layer, from the input up: "S" is softmax attention,
"L" the stack's linear kind (Gated DeltaNet unless told otherwise). The production hybrids
keep a minority of softmax layers: Qwen3-Next and Kimi Linear one in four, MiniMax-01 and
Jamba one in eight. `STACKS` names the ones chapter 11 compares, all eight layers deep, so
that only the mixture changes:

    all softmax  SSSSSSSS        1:7 first   SLLLLLLL
    all linear   LLLLLLLL        1:7 middle  LLLSLLLL
    1:3          LLLSLLLS        1:7 last    LLLLLLLS

Two measurements, each a CLI task:

* ``--task mqar``: chapter 7's Zoology MQAR (its pairs, length, vocabulary, batch and steps,
  token shift in front), every stack at one width, each at its better learning rate, several
  seeds. Recall per
  pair count, the model's generation state in numbers, CPU time.
* ``--task charlm``: chapter 8's character LM (its corpus and split) at a smaller width and
  fewer steps, every stack, several seeds; bits per character beside the n-gram baselines.
* ``--task decode``: untrained stacks of a wider model; for each context length, the bytes
  the per-layer states hold after the prompt (a softmax layer's KV cache grows with the
  context, a linear layer's state does not) and the time per generated token from them.

CLI: `python -m linattn_lib.experiments.hybrid --task mqar --out book/results/hybrid_mqar.json`
(6 stacks x 3 seeds, each stack at the better of two learning rates on seed 0, single-threaded
runs, `--jobs` in parallel; resumes from <out>.partial),
`--task charlm --out book/results/hybrid_charlm.json` (chapter 8's corpus, 6 stacks x 3 seeds,
`CHARLM_SETTINGS`), `--task decode --out book/results/hybrid_decode.json`; `--quick` is a smoke run of seconds.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from .. import _validate as V
from ..measure import torch_threads
from ..nn.models import ModelConfig, TinyLM
from .common import parse_cli, progress_bar, run_metadata, write_json
from .mqar import config_for, run

STACKS = {
    "all softmax": "SSSSSSSS",
    "all linear": "LLLLLLLL",
    "1:3": "LLLSLLLS",
    "1:7 first": "SLLLLLLL",
    "1:7 middle": "LLLSLLLL",
    "1:7 last": "LLLLLLLS",
}
# chapter 7's Zoology task (book/results/mqar_zoology.json), the width where the linear kinds
# alone fall short of softmax
MQAR_SETTINGS = dict(train_pairs=(2, 4, 8), eval_pairs=(2, 4, 8), seq_len=32, vocab_size=256, steps=2000,
                     batch_size=24, task="zoology", power_a=0.01, d_model=16, n_head=2, lr=3e-3)


# Qwen3-Next-80B-A3B's layer shapes (model card config.json): attention layers with 2 KV heads of
# 256; Gated DeltaNet layers with 32 value heads of 128 x 128 (16 query/key heads of 128) and a
# 4-tap convolution over q, k and v, whose cache holds the last 3 inputs
QWEN3_NEXT = dict(kv_heads=2, head_dim=256, heads=32, d_k=128, d_v=128, conv=3 * (2 * 16 * 128 + 32 * 128))


def softmax_positions(pattern: str) -> tuple[int, ...]:
    """The indices of the "S" layers of a stack pattern such as "LLLSLLLS" -> (3, 7)."""
    V.check_instance("softmax_positions", "pattern", pattern, str, "a string of 'S' and 'L'")
    if not pattern or set(pattern) - {"S", "L"}:
        raise ValueError(f"softmax_positions: a stack is a non-empty string of 'S' (softmax) and 'L' (linear) "
                         f"layers, got {pattern!r}")
    return tuple(i for i, c in enumerate(pattern) if c == "S")


def model_config(pattern: str, *, linear_kind: str = "gated_deltanet", **kw: object) -> ModelConfig:
    """The TinyLM config of a stack: `n_layer` = len(pattern), softmax where it says "S"."""
    soft = softmax_positions(pattern)
    attention = "softmax" if len(soft) == len(pattern) else linear_kind
    return ModelConfig(n_layer=len(pattern), attention=attention, softmax_layers=soft if attention != "softmax" else (),
                       **kw)


def cache_numbers(n_softmax: int, n_linear: int, context: int, *, kv_heads: int, head_dim: int, heads: int,
                  d_k: int, d_v: int, conv: int = 0) -> int:
    """Numbers a stack holds for generation after `context` tokens (one sequence):
    2 * context * n_softmax * kv_heads * head_dim (the KV caches) plus
    n_linear * (heads * d_k * d_v + conv) (the states; `conv`: a short convolution's cache)."""
    return 2 * context * n_softmax * kv_heads * head_dim + n_linear * (heads * d_k * d_v + conv)


def crossover(n_softmax: int, n_linear: int, kv_heads: int, head_dim: int, heads: int, d_k: int, d_v: int,
              conv: int = 0) -> float:
    """The context at which the KV caches hold as many numbers as the linear states (inf
    without softmax layers)."""
    if n_softmax == 0:
        return math.inf
    return n_linear * (heads * d_k * d_v + conv) / (2 * n_softmax * kv_heads * head_dim)


def mqar_job(name: str, seed: int, settings: dict, linear_kind: str = "gated_deltanet") -> dict:
    """Train one stack on MQAR (single-threaded) and return mqar.run's result, with the stack."""
    pattern = STACKS.get(name, name)
    soft = softmax_positions(pattern)
    kind = "softmax" if len(soft) == len(pattern) else linear_kind
    with torch_threads(1):
        cfg = config_for(kind, n_layer=len(pattern), softmax_layers=soft if kind != "softmax" else (), seed=seed,
                         **settings)
        return dict(run(cfg), stack=name, pattern=pattern)


def _mqar_worker(job: tuple) -> dict:
    return mqar_job(*job)


def _key(r: dict) -> tuple:
    return r["stack"], r["config"]["seed"], r["config"]["lr"]


def _mean_recall(r: dict) -> float:
    return sum(r["accuracy"].values()) / len(r["accuracy"])


def sweep_mqar(args: argparse.Namespace, argv: list[str] | None) -> dict:
    """Every stack x seed, checkpointed to <out>.partial after each run, resumed from it.

    Deep narrow stacks are sensitive to the learning rate, and not all the same way, so each
    stack first trains on the first seed at every rate in --lrs and keeps the one with the
    higher mean recall over the pair counts for its other seeds (chapter 7's rule, and
    Zoology's: each model at its best rate). meta["lr_selection"] records every trial.
    """
    settings = dict(MQAR_SETTINGS)
    if args.quick:
        settings.update(steps=5, batch_size=6, eval_batches=1, eval_batch_size=8)
    lrs = list(args.lrs)
    checkpoint = Path(str(args.out) + ".partial")
    done = {_key(r): r for r in (json.loads(checkpoint.read_text())["results"] if checkpoint.exists() else [])}
    meta = run_metadata("linattn_lib.experiments.hybrid", argv, device="cpu")
    meta.update(task="mqar", jobs=args.jobs, threads_per_job=1, cpu_count=os.cpu_count(), settings=settings,
                stacks={n: STACKS.get(n, n) for n in args.stacks}, seeds=list(args.seeds), lrs=lrs)
    t0 = time.perf_counter()
    pool = None
    if args.jobs > 1:
        import multiprocessing as mp

        pool = mp.get_context("spawn").Pool(args.jobs)

    def train_(jobs: list[tuple]) -> None:
        todo = [(name, seed, dict(settings, lr=lr)) for name, seed, lr in jobs if (name, seed, lr) not in done]
        stream = pool.imap_unordered(_mqar_worker, todo) if pool and len(todo) > 1 else map(_mqar_worker, todo)
        for r in progress_bar(stream, desc="hybrid MQAR", total=len(todo), enabled=not args.no_progress):
            done[_key(r)] = r
            write_json(checkpoint, {"meta": meta, "results": list(done.values())})

    first = args.seeds[0]
    try:
        train_([(name, first, lr) for name in args.stacks for lr in lrs])
        chosen = {name: max(lrs, key=lambda lr: _mean_recall(done[(name, first, lr)])) for name in args.stacks}
        runs = [(name, seed, chosen[name]) for seed in args.seeds for name in args.stacks]
        train_(runs)
    finally:
        if pool is not None:
            pool.terminate()
    meta["lr"] = chosen
    meta["lr_selection"] = {name: {str(lr): dict(done[(name, first, lr)]["accuracy"]) for lr in lrs}
                            for name in args.stacks}
    meta["sweep_seconds"] = round(time.perf_counter() - t0, 1)
    payload = {"meta": meta, "results": [done[j] for j in runs]}
    write_json(args.out, payload)
    checkpoint.unlink(missing_ok=True)
    return payload


@torch.no_grad()
def decode_cost(pattern: str, contexts: Sequence[int], *, d_model: int = 256, n_head: int = 4,
                vocab_size: int = 256, steps: int = 16, seed: int = 0) -> list[dict]:
    """For each context length L: the bytes of the states after an L-token prompt and the time
    per generated token from them (median of `steps` one-token calls), for an untrained stack
    (in the caller's torch threads)."""
    torch.manual_seed(seed)
    block = max(contexts) + steps
    model = TinyLM(model_config(pattern, vocab_size=vocab_size, block_size=block, n_head=n_head,
                                d_model=d_model, seed=seed)).eval()
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for L in contexts:
        prompt = torch.randint(vocab_size, (1, L), generator=gen)
        logits, states = model(prompt, return_states=True)
        nbytes = model.state_nbytes(states)
        times = []
        for t in range(steps):
            nxt = logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            logits, states = model(nxt, states=states, pos_offset=L + t, return_states=True)
            times.append(time.perf_counter() - t0)
        rows.append({"context": L, "state_bytes": nbytes, "ms_per_token": round(1e3 * statistics.median(times), 3)})
    return rows


def sweep_decode(args: argparse.Namespace, argv: list[str] | None) -> dict:
    contexts = [64, 128] if args.quick else args.contexts
    d_model = 32 if args.quick else args.decode_width
    meta = run_metadata("linattn_lib.experiments.hybrid", argv, device="cpu")
    meta.update(task="decode", d_model=d_model, n_head=4, contexts=contexts, threads=1,
                stacks={n: STACKS.get(n, n) for n in args.stacks})
    results = []
    with torch_threads(1):  # one thread: the time per token of one sequence, as the chapter says
        for name in progress_bar(args.stacks, desc="decode cost", enabled=not args.no_progress):
            pattern = STACKS.get(name, name)
            results.append({"stack": name, "pattern": pattern,
                            "rows": decode_cost(pattern, contexts, d_model=d_model, steps=4 if args.quick else 32)})
    payload = {"meta": meta, "results": results}
    write_json(args.out, payload)
    return payload


# chapter 8's character LM at a size where eight layers train in minutes on one core
CHARLM_SETTINGS = dict(ctx=128, d_model=32, n_head=2, steps=2000, tokens_per_step=1024, lr=3e-3, warmup=100)


def charlm_configs(stacks: Sequence[str], seeds: Sequence[int], settings: dict,
                   linear_kind: str = "gated_deltanet") -> list:
    """The character-LM runs of a stack sweep, one `CharLMConfig` per (seed, stack)."""
    from .charlm import CharLMConfig

    configs = []
    for seed in seeds:
        for name in stacks:
            pattern = STACKS.get(name, name)
            soft = softmax_positions(pattern)
            kind = "softmax" if len(soft) == len(pattern) else linear_kind
            configs.append(CharLMConfig(attention=kind, n_layer=len(pattern), seed=seed,
                                        softmax_layers=soft if kind != "softmax" else (), **settings))
    return configs


def sweep_charlm(args: argparse.Namespace, argv: list[str] | None) -> dict:
    """Every stack x seed on chapter 8's corpus, with its n-gram baselines at the same context;
    checkpointed to <out>.partial after each run and resumed from it."""
    from dataclasses import asdict

    from . import charlm, ngram

    settings = dict(CHARLM_SETTINGS)
    if args.quick:
        settings.update(ctx=16, steps=3, tokens_per_step=64, warmup=1)
    text = charlm.build_corpus()
    data = charlm.CharData(text)
    meta = run_metadata("linattn_lib.experiments.hybrid", argv, device="cpu")
    meta.update(task="charlm", workers=args.jobs, threads_per_run=1, cpu_count=os.cpu_count(), settings=settings,
                stacks={n: STACKS.get(n, n) for n in args.stacks}, seeds=list(args.seeds))
    configs = charlm_configs(args.stacks, args.seeds, settings)
    names = {json.dumps(asdict(c), sort_keys=True): (n, STACKS.get(n, n))
             for c, n in zip(configs, [n for _ in args.seeds for n in args.stacks])}
    payload = {"meta": meta, "corpus": charlm.corpus_info(text),
               "baselines": ngram.baselines(data.train.numpy(), data.val.numpy(), data.vocab_size, [settings["ctx"]]),
               "results": []}
    checkpoint = Path(str(args.out) + ".partial")
    results = {json.dumps(r["config"] | {"batch_size": None}, sort_keys=True): r
               for r in (json.loads(checkpoint.read_text())["results"] if checkpoint.exists() else [])}
    key = lambda cfg: json.dumps(asdict(cfg) | {"batch_size": None}, sort_keys=True)  # noqa: E731

    def on_result(cfg, r: dict) -> None:
        name, pattern = names[json.dumps(asdict(cfg), sort_keys=True)]
        r.pop("val_curve", None)
        results[key(cfg)] = dict(r, stack=name, pattern=pattern)
        write_json(checkpoint, dict(payload, results=list(results.values())))

    t0 = time.perf_counter()
    charlm._run_all([c for c in configs if key(c) not in results], text, args.jobs, on_result)
    meta["sweep_seconds"] = round(time.perf_counter() - t0, 1)
    meta["cpu_seconds_runs"] = round(sum(r["cpu_seconds_total"] for r in results.values()), 1)
    payload["results"] = [results[key(c)] for c in configs]
    write_json(args.out, payload)
    checkpoint.unlink(missing_ok=True)
    return payload


TASKS = ("mqar", "charlm", "decode")


def main(argv: list[str] | None = None) -> dict:
    # each task has its own results file (hybrid_mqar.json, ...): --task is read first
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--task", choices=TASKS, default="mqar")
    task = pre.parse_known_args(argv)[0].task
    p = argparse.ArgumentParser(prog="python -m linattn_lib.experiments.hybrid", description=__doc__.split("\n\n")[0])
    p.add_argument("--task", choices=TASKS, default="mqar")
    p.add_argument("--stacks", nargs="+", default=list(STACKS),
                   help="names in STACKS or patterns of S (softmax) and L (linear) layers")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--lrs", nargs="+", type=float, default=[3e-3, 1e-2],
                   help="mqar: learning rates tried on the first seed; each stack keeps its best")
    p.add_argument("--contexts", nargs="+", type=int, default=[512, 2048, 8192], help="decode: prompt lengths")
    p.add_argument("--decode-width", type=int, default=256, help="decode: d_model of the untrained stacks")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="mqar: runs in parallel, one thread each")
    p.add_argument("--no-progress", action="store_true")
    args = parse_cli(p, argv, f"book/results/hybrid_{task}.json")
    for name in args.stacks:
        softmax_positions(STACKS.get(name, name))
    if args.quick:
        args.stacks, args.seeds, args.jobs = ["all softmax", "1:7 last"], [0], 1
    sweep = {"mqar": sweep_mqar, "charlm": sweep_charlm, "decode": sweep_decode}[args.task]
    payload = sweep(args, argv)
    print(f"wrote {len(payload['results'])} results to {args.out}")
    return payload


if __name__ == "__main__":
    main()
