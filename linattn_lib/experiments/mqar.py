"""Multi-query associative recall (MQAR): can a model look up what it was told earlier?

A sequence lists n key-value pairs, then asks for the keys again; at each query the model must
produce that key's value. Softmax attention can look a pair up exactly; a linear-attention
layer must hold all n pairs in its fixed-size state S = sum_j phi(k_j) v_j^T, and once n
exceeds what it holds without interference, recall degrades (Arora et al. 2023, "Zoology").
This module generates MQAR data on the fly, trains the zoo's models on it, and sweeps the
number of pairs and the model width (hence the state size).

Every model gets the same *token shift* in front of its first layer, e_t + W e_{t-1} (RWKV's token
shift; H3, Mamba and Based use short convolutions for the same purpose): a value token then
carries its key, so one attention layer can bind the pair. Without it or `short_conv`, recall stays low.

Two generators. `make_zoology_batch` ("zoology", `--task zoology`, chapter 7's sweep) is Zoology's
`multiquery_ar`: each key queried once at power-law gaps among random filler, answers never fed
as inputs, a vocabulary larger than the sequence. `make_mqar_batch` ("legacy", the default, the
task of book/results/mqar.json) fills the tail with consecutive
queries drawn with replacement, each followed by its answer, in a vocabulary of 128: most
answers are visible before they are asked for (`answer_visible_share`), so its curve mixes
recall with short-range copying.

CLI: `python -m linattn_lib.experiments.mqar --out book/results/mqar.json` (the legacy sweep),
`--quick` (seconds); `linattn_lib.results.COMMANDS["mqar_zoology.json"]` is chapter 7's sweep.
Each finished run is saved to <out>.partial at once; a stopped sweep resumes from there.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..measure import torch_threads
from ..nn.conv import ShiftedEmbedding  # noqa: F401  (its home before nn/conv.py)
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
# The kinds of the legacy sweep (book/results/mqar.json holds exactly these), then the
# delta-rule kinds (chapter 10). Every function and the CLI accept ALL_KINDS.
KINDS = ("softmax", "performer", "linear", "cosformer", "retnet", "ssd", "hybrid")
DELTA_KINDS = ("deltanet", "gated_deltanet")
# GLA (a vector gate per key channel, `GatedLinearAttention`) runs in the Zoology sweep only
ALL_KINDS = KINDS + DELTA_KINDS + ("gla",)
# chapter 7's Zoology-task sweep (book/results/mqar_zoology.json): the whole zoo
ZOOLOGY_KINDS = ("softmax", "hybrid", "linear", "performer", "cosformer", "retnet", "ssd", "gla",
                 "deltanet", "gated_deltanet")


@dataclass
class MQARConfig:
    """One MQAR run: the task (pairs, length, vocabulary), the model and its training.

    The vocabulary is split in two halves: keys are drawn from [0, vocab_size/2), values from
    [vocab_size/2, vocab_size). `kind` is an attention kind of the zoo or "hybrid" (linear
    attention with the layers in `softmax_layers` using softmax; default: the first layer).
    token_shift adds a learned mix of the previous token's embedding to every token's (see
    `ShiftedEmbedding`); short_conv gives every linear layer a short causal convolution on q, k, v.
    Each training batch mixes the pair counts in `train_pairs`; accuracy is reported for each
    count in `eval_pairs`. `task` picks the generator: "legacy" (`make_mqar_batch`, the task of
    book/results/mqar.json) or "zoology" (`make_zoology_batch`, Zoology's own, chapter 7's).
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
    short_conv: bool = False    # LinearAttention(short_conv=True): a kernel-4 causal conv on q, k, v
    write: str = "delta"        # the delta kinds' write rule; "additive": S += beta k v^T (chapter 10)
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


class GatedLinearAttention(nn.Module):
    """GLA (Yang et al. 2024) as a TinyLM layer: S_t = diag(exp(g_t)) S_{t-1} + k_t v_t^T.

    The log-gate has one entry per key channel, g_t = logsigmoid(W_g x_t + b) / 16 (GLA's
    normaliser tau = 16, full rank here instead of GLA's low-rank W_g), so a fresh gate keeps
    about 0.96 of the state per token. q is scaled by d_head^-0.5, each head's output is RMS
    normalised (as the zoo's unnormalised kinds), and the layer runs `gla_chunkwise`.
    """

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head, self.d_head = n_head, d_model // n_head
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.gate = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.out_norm = nn.Parameter(torch.ones(self.d_head))

    def _forward(self, x: Tensor, *, state=None, pos_offset: int = 0, return_state: bool = False):
        from ..core.gla import gla_chunkwise

        B, T, _ = x.shape
        heads = lambda t: t.reshape(B, T, self.n_head, self.d_head).transpose(1, 2)
        q, k, v = (heads(t) for t in self.qkv(x).chunk(3, dim=-1))
        g = heads(F.logsigmoid(self.gate(x)) / 16)
        o, new_state = gla_chunkwise(q * self.d_head**-0.5, k, v, g, chunk_size=32, initial_state=state,
                                     return_state=True)  # chunks of 32: MQAR's short sequences pad less
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-6) * self.out_norm
        y = self.proj(o.transpose(1, 2).reshape(B, T, -1))
        return (y, new_state) if return_state else y

    def check_state(self, fn: str, name: str, state: object, *, batch: int, device: torch.device) -> None:
        """MQAR never resumes a state; refuse one rather than check it half-way."""
        raise NotImplementedError(f"{fn}: `{name}`: the MQAR GLA layer runs in parallel form only")


def build_model(cfg: MQARConfig) -> TinyLM:
    """The zoo's TinyLM for `cfg` (seeded), with the token shift when cfg.token_shift.

    "gla" is not a TinyLM kind: its model is built as "linear" and every linear layer's
    attention is then replaced, under the same seed, by a `GatedLinearAttention`.
    """
    opts = dict(short_conv=True) if cfg.short_conv else {}
    model = TinyLM(ModelConfig(
        vocab_size=cfg.vocab_size, block_size=cfg.seq_len, n_layer=cfg.n_layer, n_head=cfg.n_head,
        d_model=cfg.d_model, attention="linear" if cfg.attention == "gla" else cfg.attention, seed=cfg.seed,
        softmax_layers=cfg.hybrid_layers, layer_options=opts if cfg.write == "delta" else dict(opts, write=cfg.write)))
    if cfg.attention == "gla":
        torch.manual_seed(cfg.seed + 2)
        for i, block in enumerate(model.blocks):
            if i not in cfg.hybrid_layers:
                block.attn = GatedLinearAttention(cfg.d_model, cfg.n_head)
                for w in (block.attn.qkv.weight, block.attn.proj.weight):
                    nn.init.normal_(w, std=0.02)
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
    kind, d, seed, lr, common = job
    with torch_threads(1):  # restored: with --jobs 1 this is the caller's process
        return run(config_for(kind, d_model=d, seed=seed, **dict(common, lr=lr)))


def _key(r: dict) -> tuple:
    return r["kind"], r["d_model"], r["config"]["seed"], r["config"]["lr"]


def _finished_runs(path: Path, common: dict, lrs: Sequence[float]) -> dict[tuple, dict]:
    """The runs a stopped sweep left in its checkpoint `path`, keyed (kind, d_model, seed, lr):
    those at one of `lrs` whose recorded config is exactly the one this sweep would train."""
    finished = {}
    for r in json.loads(path.read_text())["results"] if path.exists() else []:
        kind, d, seed, lr = _key(r)
        want = asdict(config_for(kind, d_model=d, seed=seed, **dict(common, lr=lr)))
        if lr in lrs and r["config"] == json.loads(json.dumps(want)):  # as JSON stores it: lists
            finished[_key(r)] = r
    return finished


def _train(jobs: list[tuple], done: dict, common: dict, jobs_in_parallel: int, save, progress: bool) -> None:
    """Train the (kind, d_model, seed, lr) jobs that are not in `done`; save() after each run."""
    todo = [(*j, common) for j in jobs if j not in done]
    pool = None
    if jobs_in_parallel > 1 and todo:
        import multiprocessing as mp

        pool = mp.get_context("spawn").Pool(jobs_in_parallel)
    try:
        stream = pool.imap_unordered(_run_one, todo) if pool else map(_run_one, todo)
        for r in progress_bar(stream, desc="MQAR sweep", total=len(todo), enabled=progress):
            done[_key(r)] = r
            save()
    finally:
        if pool is not None:
            pool.terminate()


def _pick_rates(cells: list, lrs: list, fallback: float | None, first: int, chance: float, done: dict,
                train_) -> tuple[dict, dict]:
    """The learning rate of each (kind, width) in `cells`: of its trials on the seed `first`, the
    one with the higher mean accuracy over the pair counts (the first on a tie). A cell whose
    every trial stayed on the loss plateau (mean below 5x chance) also tries `fallback`.
    Returns ({(kind, d): lr}, {kind: {d: {lr: accuracies and cpu_seconds}}})."""
    trial = lambda k, d, lr: done[(k, d, first, lr)]
    mean = lambda r: sum(r["accuracy"].values()) / len(r["accuracy"])
    train_([(k, d, first, lr) for k, d in cells for lr in lrs])
    stuck = [(k, d) for k, d in cells if fallback and all(mean(trial(k, d, lr)) < 5 * chance for lr in lrs)]
    train_([(k, d, first, fallback) for k, d in stuck])
    chosen, record = {}, {}
    for k, d in cells:
        tried = lrs + [fallback] * ((k, d) in stuck)
        chosen[(k, d)] = max(tried, key=lambda lr: mean(trial(k, d, lr)))
        record.setdefault(k, {})[str(d)] = {
            str(lr): dict(trial(k, d, lr)["accuracy"], cpu_seconds=trial(k, d, lr)["train_cpu_seconds"]) for lr in tried}
    return chosen, record


def _sweep(args: argparse.Namespace, argv: list[str] | None, common: dict) -> dict:
    """Train the grid, checkpointing after every run to <out>.partial; resume from it if present.

    With several --lrs, every (kind, width) of the grid first trains on the first seed with each
    rate and keeps one for all seeds (`_pick_rates`; the trial at that rate is the first seed's
    run); meta["lr_selection"] records every trial (Zoology, too, reports each model's best rate).
    """
    lrs = args.lrs or [args.lr]
    checkpoint = Path(str(args.out) + ".partial")
    done = _finished_runs(checkpoint, common, lrs + [args.fallback_lr])
    previous = json.loads(checkpoint.read_text())["meta"]["sweep_seconds"] if done else 0.0
    meta = run_metadata("linattn_lib.experiments.mqar", argv, device="cpu")
    meta.update(jobs=args.jobs, threads_per_job=1, cpu_count=os.cpu_count(), seeds=args.seeds,
                config={k: v for k, v in vars(args).items() if k not in ("out", "no_progress")})
    t0, first = time.perf_counter(), args.seeds[0]

    def save(results=None) -> dict:
        meta["sweep_seconds"] = round(previous + time.perf_counter() - t0, 1)
        payload = {"meta": meta, "results": list(done.values()) if results is None else results}
        write_json(checkpoint if results is None else args.out, payload)
        return payload

    # seed by seed (a stopped sweep has whole seeds), in each every kind at --d-model first, then
    # the widest (slowest) runs, so parallel workers finish together; the results keep grid order
    slow = lambda kind: 3 if kind == "gla" else 2 if kind in ("performer",) + DELTA_KINDS else 1
    order = lambda jobs: sorted(jobs, key=lambda j: (args.seeds.index(j[2]), j[1] != args.d_model, -j[1] * slow(j[0])))
    train_ = lambda jobs: _train(order(jobs), done, common, args.jobs, save, not args.no_progress)
    grid = sweep_grid(args.kinds, args.d_models, args.state_kinds, args.seeds, args.d_model)
    cells = sorted({(k, d) for k, d, _ in grid}, key=lambda c: (args.kinds.index(c[0]), c[1]))
    chosen = dict.fromkeys(cells, lrs[0])
    if len(lrs) > 1:
        chosen, meta["lr_selection"] = _pick_rates(cells, lrs, args.fallback_lr, first, 2 / args.vocab_size, done,
                                                   train_)
    meta["lr"] = {k: {str(d): chosen[(k, d)] for kk, d in cells if kk == k} for k in args.kinds}
    runs = [(k, d, s, chosen[(k, d)]) for k, d, s in grid]
    train_(runs)
    out = save([done[j] for j in runs])
    checkpoint.unlink(missing_ok=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    """Run the sweep and write JSON: {"meta": command, versions, hardware, runtime, "results": [...]}.

    Every finished run is saved at once to <out>.partial; a sweep that stops resumes from there
    when started again with the same arguments (runs whose config differs are trained anew).
    """
    p = argparse.ArgumentParser(prog="python -m linattn_lib.experiments.mqar", description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=ALL_KINDS,
                   help="default: the legacy sweep's kinds (KINDS); ZOOLOGY_KINDS for the zoology sweep")
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
    p.add_argument("--lrs", nargs="*", type=float, default=[], help="pick each kind's rate among these (see _sweep)")
    p.add_argument("--fallback-lr", type=float, default=None, help="with --lrs: tried where all of them fail")
    p.add_argument("--task", default=MQARConfig.task, choices=TASKS,
                   help="legacy: the old, easier generator; zoology: Zoology's multiquery_ar (needs --vocab-size > --seq-len)")
    p.add_argument("--power-a", type=float, default=MQARConfig.power_a, help="zoology: power law of the query gaps")
    p.add_argument("--write", default="delta", choices=("delta", "additive"),
                   help="the delta kinds' write rule; additive: S += beta k v^T, their layer otherwise unchanged")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="runs in parallel, one thread each")
    p.add_argument("--no-progress", action="store_true")
    args = parse_cli(p, argv, "book/results/mqar.json")
    if args.quick:
        args.kinds, args.pairs, args.d_models, args.state_kinds = ["softmax", "linear"], [2, 3], [16], []
        args.d_model, args.steps, args.seq_len, args.vocab_size, args.batch_size, args.jobs = 16, 5, 16, 16, 8, 1
        if args.task == "zoology":
            args.pairs, args.seq_len, args.vocab_size = [2, 4], 16, 32
    common = dict(
        train_pairs=tuple(args.pairs), eval_pairs=tuple(args.pairs), seq_len=args.seq_len, vocab_size=args.vocab_size,
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, task=args.task, power_a=args.power_a,
        write=args.write,
    )
    payload = _sweep(args, argv, common)
    print(f"wrote {len(payload['results'])} runs to {args.out} in {payload['meta']['sweep_seconds']:.0f} s")
    return payload


if __name__ == "__main__":
    main()
