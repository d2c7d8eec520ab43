"""Multi-query associative recall (MQAR): can a model look up what it was told earlier?

A sequence first lists n key-value pairs, then asks for keys again; after each queried key the
model must produce that key's value:

    k1 v1 k2 v2 ... kn vn | q1 v(q1) q2 v(q2) ...      (loss and accuracy only on the v(q))

Softmax attention can look a pair up exactly. A linear-attention layer must store all n pairs
in its fixed-size state S = sum_j phi(k_j) v_j^T; once n exceeds what the state can hold
without interference, recall degrades (Arora et al. 2023, "Zoology"; Arora et al. 2024,
"Based"). This module generates MQAR data on the fly, trains the zoo's models on it, and
sweeps the number of pairs and the model width (hence the state size).

Every model gets the same *token shift* in front of its first layer: the embedding of token
t-1, mixed by a learned d x d matrix, is added to the embedding of token t (RWKV's token shift;
H3, Mamba and Based use short convolutions for the same purpose). A value token then carries
its key, so one attention layer can bind the pair; without it a model first has to learn a
previous-token head, which on a CPU budget it does not (see `MQARConfig.token_shift`).

Two generators. `make_mqar_batch` ("legacy", chapter 7's committed sweep) fills the tail with
consecutive queries drawn with replacement, each followed by its answer, in a vocabulary of 128:
most answers are visible before they are asked for (`answer_visible_share`), so its curve mixes
recall with short-range copying. `make_zoology_batch` ("zoology", `--task zoology`) is Zoology's
`multiquery_ar`: each key queried once at power-law gaps among random filler, answers never fed
as inputs, a vocabulary larger than the sequence.

CLI: `python -m linattn_lib.experiments.mqar --out book/results/mqar.json` (the full sweep:
11 runs, about 27 CPU-minutes of training, i.e. ~15 min on two idle cores) or `--quick` (a smoke run
in seconds). Chapter 10's delta-rule sweep (book/results/mqar_delta.json) names its kinds:
`--kinds deltanet gated_deltanet ...` (see the chapter for the exact command).
"""
from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..measure import torch_threads
from ..nn.models import ModelConfig, TinyLM
from .common import (
    parse_cli,
    progress_bar,
    run_metadata,
    seed_everything,
    train,
    write_json,
)

IGNORE = -100
# The kinds of chapter 7's sweep (book/results/mqar.json; the chapter loops over this tuple,
# so it lists exactly the kinds that file holds), then the delta-rule kinds of chapter 10
# (book/results/mqar_delta.json). Every function and the CLI accept ALL_KINDS.
KINDS = ("softmax", "performer", "linear", "cosformer", "retnet", "ssd", "hybrid")
DELTA_KINDS = ("deltanet", "gated_deltanet")
ALL_KINDS = KINDS + DELTA_KINDS


@dataclass
class MQARConfig:
    """One MQAR run: the task (pairs, length, vocabulary), the model and its training.

    The vocabulary is split in two halves: keys are drawn from [0, vocab_size/2), values from
    [vocab_size/2, vocab_size). `kind` is an attention kind of the zoo or "hybrid" (linear
    attention with the layers in `softmax_layers` using softmax; default: the first layer).
    token_shift adds a learned mix of the previous token's embedding to every token's (see
    `ShiftedEmbedding`); without it, no model learned the task within a CPU budget in our trials.
    Each training batch mixes the pair counts in `train_pairs`; accuracy is reported for each
    count in `eval_pairs`. `task` picks the generator: "legacy" (`make_mqar_batch`, the task of
    chapter 7's committed sweep) or "zoology" (`make_zoology_batch`, Zoology's own task).
    """

    kind: str = "linear"
    train_pairs: tuple = (4, 8, 16, 32)
    eval_pairs: tuple = (4, 8, 16, 32)
    seq_len: int = 128
    vocab_size: int = 128
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 2
    softmax_layers: tuple = ()
    token_shift: bool = True
    steps: int = 1500
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 50
    seed: int = 0
    eval_batches: int = 4
    eval_batch_size: int = 128
    task: str = "legacy"        # "legacy" (make_mqar_batch) or "zoology" (make_zoology_batch)
    power_a: float = 0.01       # zoology: the power law of the query gaps

    @property
    def attention(self) -> str:
        return "linear" if self.kind == "hybrid" else self.kind

    @property
    def hybrid_layers(self) -> tuple:
        if self.kind == "hybrid" and not self.softmax_layers:
            return (0,)  # default hybrid: the first layer softmax, the rest linear
        return tuple(self.softmax_layers)


# --------------------------------------------------------------------------------------
# the data
# --------------------------------------------------------------------------------------


def num_queries(num_pairs: int, seq_len: int) -> int:
    """Queries that fit after the pairs: (seq_len - 2 n) // 2 (each query is a key and its value)."""
    return (seq_len - 2 * num_pairs) // 2


TASKS = ("legacy", "zoology")


def make_task_batch(
    task: str, batch: int, num_pairs: int, seq_len: int, vocab_size: int, *, generator: torch.Generator,
    power_a: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of `task` ("legacy": `make_mqar_batch`, "zoology": `make_zoology_batch`)."""
    if task == "zoology":
        return make_zoology_batch(batch, num_pairs, seq_len, vocab_size, power_a=power_a, generator=generator)
    if task != "legacy":
        raise ValueError(f"make_task_batch: `task`={task!r} must be one of {TASKS}")
    return make_mqar_batch(batch, num_pairs, seq_len, vocab_size, generator=generator)


def make_mixed_batch(
    batch: int, pairs: Sequence[int], seq_len: int, vocab_size: int, *, generator: torch.Generator,
    task: str = "legacy", power_a: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch whose rows are split evenly over the pair counts in `pairs` (in that order).

    Training on a mixture of difficulties, as Zoology does, lets a model learn the lookup on
    few pairs and use it on many; every step sees every pair count.
    """
    if batch % len(pairs):
        raise ValueError(f"make_mixed_batch: batch={batch} must be a multiple of len(pairs)={len(pairs)}")
    parts = [make_task_batch(task, batch // len(pairs), n, seq_len, vocab_size, generator=generator, power_a=power_a)
             for n in pairs]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def make_mqar_batch(
    batch: int, num_pairs: int, seq_len: int, vocab_size: int, *, generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), both (batch, seq_len - 1); targets are -100 except after queried keys.

    Each sequence lists `num_pairs` distinct keys (drawn without replacement from
    [0, vocab_size/2)) each followed by its value (drawn with replacement from
    [vocab_size/2, vocab_size)), then fills the rest with queries: listed keys drawn with
    replacement, each followed by its value. The target at position t is the next token, kept
    only where token t is a queried key (so the target is that key's value). An odd leftover
    token at the end is a padding 0 with no target.
    """
    half = vocab_size // 2
    if num_pairs < 1 or num_pairs > half:
        raise ValueError(
            f"make_mqar_batch: num_pairs={num_pairs} must be in [1, vocab_size/2 = {half}] (distinct keys)"
        )
    n_q = num_queries(num_pairs, seq_len)
    if n_q < 1:
        raise ValueError(f"make_mqar_batch: seq_len={seq_len} leaves no room for a query after {num_pairs} pairs")
    keys = torch.argsort(torch.rand(batch, half, generator=generator), dim=1)[:, :num_pairs]
    values = torch.randint(half, vocab_size, (batch, num_pairs), generator=generator)
    which = torch.randint(0, num_pairs, (batch, n_q), generator=generator)
    q_keys, q_vals = keys.gather(1, which), values.gather(1, which)
    context = torch.stack([keys, values], dim=2).reshape(batch, 2 * num_pairs)
    queries = torch.stack([q_keys, q_vals], dim=2).reshape(batch, 2 * n_q)
    seq = torch.cat([context, queries], dim=1)
    seq = F.pad(seq, (0, seq_len - seq.shape[1]))  # right-pad: nothing before it changes
    inputs, targets = seq[:, :-1], seq[:, 1:].clone()
    answer = torch.zeros_like(targets, dtype=torch.bool)
    answer[:, 2 * num_pairs : 2 * num_pairs + 2 * n_q : 2] = True  # input = queried key, target = its value
    targets[~answer] = IGNORE
    return inputs, targets


def make_zoology_batch(
    batch: int, num_pairs: int, seq_len: int, vocab_size: int, *, generator: torch.Generator,
    power_a: float = 0.01,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zoology's MQAR (`multiquery_ar` of HazyResearch/zoology): (inputs, targets), (batch, seq_len).

    The sequence lists `num_pairs` keys, distinct and drawn from [1, vocab_size/2), each followed
    by its value, distinct and drawn from [vocab_size/2, vocab_size). The rest is the query
    region: every key is queried exactly once, at an even offset 2 g after the pairs, where the
    gaps g are drawn without replacement from the (seq_len - 2 n) / 2 slots with probabilities
    proportional to g^(power_a - 1) (a power law: most queries come soon after the pairs, some
    far). The token after a query is *not* its value: every position that is not a pair or a
    query holds a random token of the whole vocabulary, so an answer is never fed as an input
    (except by the chance of a random token). The target is the queried key's value at the
    query's position, -100 elsewhere. Zoology asserts vocab_size > seq_len and room for the
    queries (4 n <= seq_len); so does this.
    """
    fn = "make_zoology_batch"
    half, context = vocab_size // 2, 2 * num_pairs
    if seq_len % 2 or vocab_size <= seq_len:
        raise ValueError(f"{fn}: `seq_len`={seq_len} must be even and below `vocab_size`={vocab_size}")
    if num_pairs < 1 or 4 * num_pairs > seq_len or num_pairs > half - 1:
        raise ValueError(f"{fn}: `num_pairs`={num_pairs} must be in [1, min(seq_len / 4, vocab_size / 2 - 1)]")
    if not 0 < power_a <= 1:
        raise ValueError(f"{fn}: `power_a`={power_a} must be in (0, 1] (1: uniform gaps)")
    pick = lambda n, size: torch.argsort(torch.rand(batch, n, generator=generator), dim=1)[:, :size]
    keys, values = pick(half - 1, num_pairs) + 1, pick(vocab_size - half, num_pairs) + half
    space = (seq_len - context) // 2
    p = power_a * torch.arange(1, space + 1, dtype=torch.float64) ** (power_a - 1)
    gaps = torch.multinomial((p / p.sum()).expand(batch, space), num_pairs, replacement=False, generator=generator)
    seq = torch.randint(vocab_size, (batch, seq_len), generator=generator)   # the filler
    seq[:, 0:context:2], seq[:, 1:context:2] = keys, values
    where = context + 2 * gaps
    seq.scatter_(1, where, keys)
    targets = torch.full_like(seq, IGNORE).scatter_(1, where, values)
    return seq, targets


def answer_visible_share(inputs: Tensor, targets: Tensor, num_pairs: int) -> float:
    """Share of the scored queries whose answer already appears as an input token in the query
    region before them: a query that can be answered by copying a nearby token instead of
    recalling the pair (inputs, targets as the generators return them; the first 2 n tokens
    are the pairs)."""
    context = 2 * num_pairs
    rows, cols = (targets != IGNORE).nonzero(as_tuple=True)
    seen = [bool((inputs[r, context:c] == targets[r, c]).any()) for r, c in zip(rows.tolist(), cols.tolist())]
    return sum(seen) / max(len(seen), 1)


# --------------------------------------------------------------------------------------
# the model
# --------------------------------------------------------------------------------------


class ShiftedEmbedding(nn.Module):
    """Token embedding plus a learned mix of the previous token's embedding (a token shift).

    e_t = E[x_t] + W E[x_{t-1}] (E[x_{-1}] = 0). It shares `weight` with the embedding it
    wraps, so a tied output head stays tied. It sees one sequence at a time in parallel form
    only: a model using it must not be run token by token (its generate() would lose the
    shift), which MQAR never does.
    """

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight
        d = embedding.weight.shape[1]
        self.mix = nn.Linear(d, d, bias=False)
        nn.init.normal_(self.mix.weight, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        e = F.embedding(idx, self.weight)
        prev = F.pad(e, (0, 0, 1, 0))[:, :-1]  # e_{t-1}, zero at t = 0
        return e + self.mix(prev)


def build_model(cfg: MQARConfig) -> TinyLM:
    """The zoo's TinyLM for `cfg` (seeded), with the token shift when cfg.token_shift."""
    model = TinyLM(ModelConfig(
        vocab_size=cfg.vocab_size, block_size=cfg.seq_len, n_layer=cfg.n_layer, n_head=cfg.n_head,
        d_model=cfg.d_model, attention=cfg.attention, softmax_layers=cfg.hybrid_layers, seed=cfg.seed,
    ))
    if cfg.token_shift:
        torch.manual_seed(cfg.seed + 1)
        model.tok = ShiftedEmbedding(model.tok)
    return model


def layer_state_numbers(cfg: MQARConfig, kind: str) -> int:
    """Numbers one layer of attention `kind` keeps for generation after cfg.seq_len tokens.

    Softmax: its KV cache, 2 * T * d_model. Linear kinds: the recurrent state of all heads,
    S (m x d_head) and, when normalised, z (m): Performer uses floor(d_head ln d_head) random
    features per head, cosFormer 2 d_head (the cos and sin halves), the others d_head. The
    delta-rule kinds keep S (d_head x d_head) and no z, like retnet and ssd.
    """
    d_head = cfg.d_model // cfg.n_head
    if kind == "softmax":
        return 2 * cfg.seq_len * cfg.d_model
    if kind == "performer":
        from ..core.features import default_num_features

        m = default_num_features(d_head)
    else:
        m = 2 * d_head if kind == "cosformer" else d_head
    normalised = kind in ("performer", "linear", "cosformer")
    return cfg.n_head * m * (d_head + (1 if normalised else 0))


def state_numbers(cfg: MQARConfig) -> int:
    """Numbers the whole model keeps for generation after cfg.seq_len tokens (all layers).

    A hybrid pays a KV cache in its softmax layers and a constant state in the others.
    """
    layers = cfg.hybrid_layers
    return sum(layer_state_numbers(cfg, "softmax" if i in layers else cfg.attention) for i in range(cfg.n_layer))


def recall_accuracy(model: nn.Module, inputs: Tensor, targets: Tensor) -> float:
    """Fraction of queried values predicted exactly (argmax) at the answer positions."""
    with torch.no_grad():
        pred = model(inputs).argmax(-1)
    mask = targets != IGNORE
    return (pred[mask] == targets[mask]).float().mean().item()


def evaluate(model: nn.Module, cfg: MQARConfig, pairs: Sequence[int] | None = None) -> dict[int, float]:
    """Recall accuracy at each pair count (default cfg.eval_pairs) on fresh held-out batches.

    The held-out data come from their own generator, seeded from cfg.seed, never from the
    training stream.
    """
    pairs = cfg.eval_pairs if pairs is None else pairs
    out = {}
    for n in pairs:
        gen = torch.Generator().manual_seed(10_000 + 100 * cfg.seed + n)
        accs = [
            recall_accuracy(model, *make_task_batch(cfg.task, cfg.eval_batch_size, n, cfg.seq_len, cfg.vocab_size,
                                                    generator=gen, power_a=cfg.power_a))
            for _ in range(cfg.eval_batches)
        ]
        out[n] = sum(accs) / len(accs)
    return out


def run(
    cfg: MQARConfig, *, progress: bool = False, return_model: bool = False, eval_every: int = 0,
) -> dict | tuple[dict, TinyLM]:
    """Train one model on fresh mixed MQAR batches; return its recall accuracy per pair count.

    Deterministic for a given cfg (seeded model, data and evaluation) on a given machine and
    thread count. eval_every > 0 also records the accuracy every that many steps
    ("accuracy_curve"). With return_model=True, returns (result, model).
    """
    if cfg.kind not in ALL_KINDS:
        raise ValueError(f"run: kind={cfg.kind!r} is not one of {ALL_KINDS}")
    gen = seed_everything(cfg.seed)
    model = build_model(cfg)
    batches = lambda step: make_mixed_batch(cfg.batch_size, cfg.train_pairs, cfg.seq_len, cfg.vocab_size, generator=gen,
                                            task=cfg.task, power_a=cfg.power_a)
    bar = progress_bar(range(cfg.steps), desc=f"{cfg.kind} d={cfg.d_model}", enabled=progress)
    it = iter(bar)
    curve = []

    def on_step(step: int, loss: float) -> None:
        if progress:
            next(it, None)
        if eval_every and (step + 1) % eval_every == 0:
            model.eval()
            curve.append({"step": step + 1, "accuracy": evaluate(model, cfg)})
            model.train()

    t0, c0 = time.perf_counter(), time.process_time()
    losses = train(model, batches, steps=cfg.steps, lr=cfg.lr, warmup=cfg.warmup, progress=on_step)
    if progress and hasattr(bar, "close"):
        bar.close()
    train_s, train_cpu = time.perf_counter() - t0, time.process_time() - c0
    acc = evaluate(model, cfg)
    tail = losses[-max(1, cfg.steps // 20):]
    result = {
        "kind": cfg.kind,
        "d_model": cfg.d_model,
        "config": asdict(cfg),
        "accuracy": {str(n): round(a, 4) for n, a in acc.items()},
        "chance": 2.0 / cfg.vocab_size,  # a uniform guess among the vocab_size/2 values
        "final_loss": round(sum(tail) / len(tail), 4),
        "first_loss": round(losses[0], 4),
        "loss_curve": [round(sum(losses[i:i + 50]) / len(losses[i:i + 50]), 4) for i in range(0, len(losses), 50)],
        "state_numbers": state_numbers(cfg),
        "parameters": model.num_parameters(),
        "train_seconds": round(train_s, 2),
        "train_cpu_seconds": round(train_cpu, 2),  # CPU time of this process: the wall time on an idle core
    }
    if eval_every:
        result["accuracy_curve"] = [{"step": c["step"], "accuracy": {str(n): round(a, 4) for n, a in c["accuracy"].items()}} for c in curve]
    return (result, model) if return_model else result


def config_for(kind: str, **kw: object) -> MQARConfig:
    """MQARConfig of one of ALL_KINDS ("hybrid": linear attention with its first layer softmax)."""
    if kind not in ALL_KINDS:
        raise ValueError(f"config_for: kind={kind!r} is not one of {ALL_KINDS}")
    return MQARConfig(kind=kind, **kw)


# --------------------------------------------------------------------------------------
# the sweep
# --------------------------------------------------------------------------------------


def sweep_grid(
    kinds: Sequence[str], d_models: Sequence[int], state_kinds: Sequence[str], seeds: Sequence[int],
    base_d_model: int,
) -> list[tuple[str, int, int]]:
    """(kind, d_model, seed) of every run: all kinds at `base_d_model`, and the `state_kinds`
    also at every other width in `d_models` (the state-size axis)."""
    grid = []
    for seed in seeds:
        for kind in kinds:
            for d in sorted(set(d_models) | {base_d_model}) if kind in state_kinds else [base_d_model]:
                grid.append((kind, d, seed))
    return grid


def _run_one(job: tuple) -> dict:
    kind, d, seed, common = job
    common = dict(common)
    with torch_threads(common.pop("threads", 1)):  # restored: with --jobs 1 this is the caller's process
        return run(config_for(kind, d_model=d, seed=seed, **common))


def main(argv: list[str] | None = None) -> dict:
    """Run the sweep and write JSON: {"meta": command, versions, hardware, runtime, "results": [...]}."""
    p = argparse.ArgumentParser(prog="python -m linattn_lib.experiments.mqar", description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=ALL_KINDS,
                   help="default: chapter 7's kinds (KINDS); add deltanet gated_deltanet for chapter 10")
    p.add_argument("--pairs", nargs="+", type=int, default=list(MQARConfig.train_pairs), help="pair counts (trained on as a mixture, evaluated one by one)")
    p.add_argument("--d-model", type=int, default=MQARConfig.d_model, help="width of every kind")
    p.add_argument("--d-models", nargs="+", type=int, default=[32, 64, 128], help="widths of the state-size axis")
    p.add_argument("--state-kinds", nargs="*", default=["linear", "retnet"], choices=ALL_KINDS, help="kinds swept over --d-models")
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--seq-len", type=int, default=MQARConfig.seq_len)
    p.add_argument("--vocab-size", type=int, default=MQARConfig.vocab_size)
    p.add_argument("--steps", type=int, default=MQARConfig.steps)
    p.add_argument("--batch-size", type=int, default=MQARConfig.batch_size)
    p.add_argument("--lr", type=float, default=MQARConfig.lr)
    p.add_argument("--task", default=MQARConfig.task, choices=TASKS,
                   help="legacy: chapter 7's generator; zoology: Zoology's multiquery_ar (needs --vocab-size > --seq-len)")
    p.add_argument("--power-a", type=float, default=MQARConfig.power_a, help="zoology: power law of the query gaps")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="runs in parallel, one thread each")
    p.add_argument("--no-progress", action="store_true")
    args = parse_cli(p, argv, "book/results/mqar.json")
    if args.quick:
        args.kinds, args.pairs, args.d_models, args.state_kinds = ["softmax", "linear"], [2, 3], [16], []
        args.d_model, args.steps, args.seq_len, args.vocab_size, args.batch_size, args.jobs = 16, 5, 16, 16, 8, 1
    common = dict(
        train_pairs=tuple(args.pairs), eval_pairs=tuple(args.pairs), seq_len=args.seq_len, vocab_size=args.vocab_size,
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, task=args.task, power_a=args.power_a,
    )
    grid = sweep_grid(args.kinds, args.d_models, args.state_kinds, args.seeds, args.d_model)
    # the widest (slowest) runs first, so parallel workers finish together; results keep grid order
    order = sorted(range(len(grid)), key=lambda i: -grid[i][1] * (2 if grid[i][0] == "performer" else 1))
    jobs = [(*grid[i], dict(common, threads=1)) for i in order]
    t0 = time.perf_counter()
    if args.jobs > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(args.jobs) as pool:
            done = list(progress_bar(pool.imap(_run_one, jobs), desc="MQAR sweep", total=len(jobs), enabled=not args.no_progress))
    else:
        done = [_run_one(j) for j in progress_bar(jobs, desc="MQAR sweep", enabled=not args.no_progress)]
    results = [None] * len(grid)
    for i, r in zip(order, done):
        results[i] = r
    meta = run_metadata("linattn_lib.experiments.mqar", argv)
    meta.update(
        sweep_seconds=round(time.perf_counter() - t0, 1), jobs=args.jobs, threads_per_job=1,
        cpu_count=os.cpu_count(), seeds=args.seeds,
        config={k: v for k, v in vars(args).items() if k not in ("out", "no_progress")},
    )
    payload = {"meta": meta, "results": results}
    write_json(args.out, payload)
    print(f"wrote {len(results)} runs to {args.out} in {meta['sweep_seconds']:.0f} s")
    return payload


if __name__ == "__main__":
    main()
