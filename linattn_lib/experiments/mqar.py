"""Multi-query associative recall (MQAR): can a model look up what it was told earlier?

A sequence first lists n key-value pairs, then asks for keys again; after each queried key the
model must produce that key's value:

    k1 v1 k2 v2 ... kn vn | q1 v(q1) q2 v(q2) ...      (loss and accuracy only on the v(q))

Softmax attention can look the pair up exactly. A linear-attention layer must store all n pairs
in its fixed-size state S = sum_j phi(k_j) v_j^T; once n exceeds what the state can hold
without interference, recall degrades (Arora et al. 2023, "Zoology"). This module generates
MQAR data on the fly and trains the zoo's models on it.

CLI: `python -m linattn_lib.experiments.mqar --out book/results/mqar.json` (full sweep) or
`--quick` (a smoke run in seconds).
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from ..models import ModelConfig, TinyLM
from .common import progress_bar, run_metadata, seed_everything, train, write_json

IGNORE = -100


@dataclass
class MQARConfig:
    """One MQAR run: the task (pairs, length, vocabulary) and the model trained on it."""

    attention: str = "linear"
    num_pairs: int = 8
    seq_len: int = 64
    vocab_size: int = 128  # keys use the lower half, values the upper half
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 2
    softmax_layers: tuple = ()
    steps: int = 600
    batch_size: int = 32
    lr: float = 3e-3
    seed: int = 0
    eval_batches: int = 8


def make_mqar_batch(batch: int, num_pairs: int, seq_len: int, vocab_size: int, *, generator: torch.Generator):
    """(inputs, targets) of shape (batch, seq_len - 1); targets are -100 except after query keys.

    Keys are drawn without replacement from [0, vocab_size/2), values with replacement from
    [vocab_size/2, vocab_size). The query section fills the rest of the sequence with keys drawn
    (with replacement) from the listed ones, each followed by its value.
    """
    half = vocab_size // 2
    if num_pairs > half:
        raise ValueError(f"make_mqar_batch: num_pairs={num_pairs} needs vocab_size >= {2 * num_pairs}, got {vocab_size}")
    n_queries = (seq_len - 2 * num_pairs) // 2
    if n_queries < 1:
        raise ValueError(f"make_mqar_batch: seq_len={seq_len} leaves no room for queries after {num_pairs} pairs")
    keys = torch.argsort(torch.rand(batch, half, generator=generator), dim=1)[:, :num_pairs]
    values = torch.randint(half, vocab_size, (batch, num_pairs), generator=generator)
    which = torch.randint(0, num_pairs, (batch, n_queries), generator=generator)
    q_keys, q_vals = keys.gather(1, which), values.gather(1, which)
    context = torch.stack([keys, values], dim=2).reshape(batch, 2 * num_pairs)
    queries = torch.stack([q_keys, q_vals], dim=2).reshape(batch, 2 * n_queries)
    seq = torch.cat([context, queries], dim=1)
    pad = seq_len - seq.shape[1]
    if pad:
        seq = torch.cat([torch.zeros(batch, pad, dtype=seq.dtype), seq], dim=1)  # left-pad with key 0
    inputs, targets = seq[:, :-1], seq[:, 1:].clone()
    mask = torch.zeros_like(targets, dtype=torch.bool)
    first_answer = pad + 2 * num_pairs  # index in `seq` of the first queried key
    mask[:, first_answer::2] = True  # targets[t] = seq[t+1]: the value right after a queried key
    targets[~mask] = IGNORE
    return inputs, targets


def recall_accuracy(model: TinyLM, inputs: torch.Tensor, targets: torch.Tensor) -> float:
    """Fraction of queried values predicted exactly (argmax) at the answer positions."""
    with torch.no_grad():
        pred = model(inputs).argmax(-1)
    mask = targets != IGNORE
    return (pred[mask] == targets[mask]).float().mean().item()


def state_numbers(cfg: MQARConfig) -> int:
    """Numbers a linear layer's recurrent state holds per layer (all heads; S and z)."""
    d_head = cfg.d_model // cfg.n_head
    feat = {"linear": d_head, "cosformer": 2 * d_head, "retnet": d_head, "ssd": d_head}
    if cfg.attention == "performer":
        from ..features import default_num_features

        feat["performer"] = default_num_features(d_head)
    if cfg.attention not in feat:  # softmax: the KV cache at this length
        return 2 * cfg.seq_len * cfg.d_model
    return cfg.n_head * feat[cfg.attention] * (d_head + 1)


def run(cfg: MQARConfig, *, progress: bool = False) -> dict:
    """Train one model on fresh MQAR batches; return its final recall accuracy and losses."""
    gen = seed_everything(cfg.seed)
    model = TinyLM(ModelConfig(
        vocab_size=cfg.vocab_size, block_size=cfg.seq_len, n_layer=cfg.n_layer, n_head=cfg.n_head,
        d_model=cfg.d_model, attention=cfg.attention, softmax_layers=tuple(cfg.softmax_layers), seed=cfg.seed,
    ))
    batch = lambda step: make_mqar_batch(cfg.batch_size, cfg.num_pairs, cfg.seq_len, cfg.vocab_size, generator=gen)
    bar = progress_bar(range(cfg.steps), desc=f"{cfg.attention} n={cfg.num_pairs}", enabled=progress)
    it = iter(bar)
    losses = train(model, batch, steps=cfg.steps, lr=cfg.lr, progress=(lambda s, l: next(it, None)) if progress else None)
    if progress and hasattr(bar, "close"):
        bar.close()
    eval_gen = torch.Generator().manual_seed(10_000 + cfg.seed)
    accs = [
        recall_accuracy(model, *make_mqar_batch(cfg.batch_size, cfg.num_pairs, cfg.seq_len, cfg.vocab_size, generator=eval_gen))
        for _ in range(cfg.eval_batches)
    ]
    return {
        "config": asdict(cfg),
        "accuracy": sum(accs) / len(accs),
        "final_loss": sum(losses[-20:]) / len(losses[-20:]),
        "first_loss": losses[0],
        "state_numbers_per_layer": state_numbers(cfg),
        "parameters": model.num_parameters(),
    }


KINDS = ("softmax", "performer", "linear", "cosformer", "retnet", "ssd", "hybrid")


def config_for(kind: str, **kw) -> MQARConfig:
    """`kind` may be "hybrid": linear attention with its first layer softmax."""
    if kind == "hybrid":
        return MQARConfig(attention="linear", softmax_layers=(0,), **kw)
    return MQARConfig(attention=kind, **kw)


def main(argv: Optional[list[str]] = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m linattn_lib.experiments.mqar", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="book/results/mqar.json", help="where to write the JSON results")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--pairs", nargs="+", type=int, default=[4, 8, 16, 24])
    p.add_argument("--d-models", nargs="+", type=int, default=[64])
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--quick", action="store_true", help="tiny sweep for a smoke test (seconds)")
    args = p.parse_args(argv)
    if args.quick:
        args.kinds, args.pairs, args.d_models, args.steps, args.seq_len = ["linear", "softmax"], [2], [16], 5, 16
    grid = [(k, n, d, s) for k in args.kinds for n in args.pairs for d in args.d_models for s in args.seeds]
    results = []
    for kind, n, d, seed in progress_bar(grid, desc="MQAR sweep"):
        cfg = config_for(kind, num_pairs=n, d_model=d, seed=seed, seq_len=args.seq_len, steps=args.steps)
        r = run(cfg)
        r["kind"] = kind
        results.append(r)
    payload = {"meta": run_metadata("linattn_lib.experiments.mqar", argv), "results": results}
    write_json(args.out, payload)
    print(f"wrote {len(results)} runs to {args.out}")
    return payload


if __name__ == "__main__":
    main()
