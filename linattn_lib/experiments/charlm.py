"""Character-level language models on a corpus every machine has offline: the docstrings of
Python's standard library.

The corpus is built deterministically (a fixed list of modules, their source parsed with `ast`,
docstrings in source order), so its size and SHA-256 identify it; results record both. The
zoo's models (softmax, Performer, elu+1 linear, cosFormer, RetNet-style decay) are trained as
small character models at a few context lengths and seeds, and compared by validation
perplexity (bits per character are log2 of it).

CLI: `python -m linattn_lib.experiments.charlm --out book/results/charlm.json` (full sweep) or
`--quick` (a smoke run in seconds).
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import math
import sys
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from ..models import ModelConfig, TinyLM
from .common import progress_bar, run_metadata, seed_everything, train, write_json

# Pure-Python standard-library modules with rich docstrings, present in CPython 3.10-3.13.
CORPUS_MODULES = (
    "argparse", "ast", "base64", "bisect", "calendar", "collections", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "doctest", "email.message",
    "enum", "fractions", "ftplib", "functools", "gettext", "glob", "gzip", "heapq", "hmac",
    "html.parser", "http.client", "http.server", "imaplib", "inspect", "ipaddress", "json.decoder",
    "json.encoder", "logging", "mailbox", "mimetypes", "numbers", "optparse", "pathlib", "pickle",
    "pickletools", "platform", "pprint", "pydoc", "queue", "random", "shlex", "shutil", "smtplib",
    "socketserver", "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap",
    "threading", "timeit", "tokenize", "trace", "traceback", "typing", "unittest.case",
    "urllib.parse", "urllib.request", "uuid", "warnings", "weakref", "xml.dom.minidom", "zipfile",
)


def _docstrings(source: str) -> list[str]:
    """Module, class and function docstrings of one source file, in source order."""
    tree = ast.parse(source)
    nodes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    nodes.sort(key=lambda n: getattr(n, "lineno", 0))
    docs = []
    for node in nodes:
        doc = ast.get_docstring(node, clean=True)
        if doc:
            docs.append(doc)
    return docs


def build_corpus(modules=CORPUS_MODULES) -> str:
    """The corpus text: every docstring of `modules`, separated by blank lines, ASCII only."""
    parts = []
    for name in modules:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        with open(spec.origin, encoding="utf-8") as f:
            parts.extend(_docstrings(f.read()))
    text = "\n\n".join(parts)
    return text.encode("ascii", "ignore").decode("ascii")


def corpus_info(text: str) -> dict:
    """Size, hash and vocabulary of the corpus (recorded with every result)."""
    return {
        "characters": len(text),
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
        "vocab_size": len(set(text)),
        "python_version": sys.version.split()[0],
    }


class CharData:
    """Encodes the corpus and serves random training windows and a fixed validation set."""

    def __init__(self, text: str, *, val_fraction: float = 0.1):
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        n_val = int(len(data) * val_fraction)
        self.train, self.val = data[:-n_val], data[-n_val:]  # the split is by position: no overlap

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def encode(self, s: str) -> torch.Tensor:
        return torch.tensor([self.stoi[c] for c in s if c in self.stoi], dtype=torch.long)

    def batch(self, batch_size: int, ctx: int, *, generator: torch.Generator):
        ix = torch.randint(0, len(self.train) - ctx - 1, (batch_size,), generator=generator)
        x = torch.stack([self.train[i : i + ctx] for i in ix.tolist()])
        y = torch.stack([self.train[i + 1 : i + ctx + 1] for i in ix.tolist()])
        return x, y

    def val_windows(self, ctx: int, max_windows: int):
        """Non-overlapping validation windows (deterministic)."""
        n = min(max_windows, (len(self.val) - 1) // ctx)
        x = self.val[: n * ctx].view(n, ctx)
        y = self.val[1 : n * ctx + 1].view(n, ctx)
        return x, y


@torch.no_grad()
def validation_loss(model: TinyLM, data: CharData, ctx: int, *, max_windows: int = 64, batch: int = 16) -> float:
    """Mean cross-entropy (nats per character) over fixed validation windows."""
    x, y = data.val_windows(ctx, max_windows)
    total, count = 0.0, 0
    for i in range(0, len(x), batch):
        logits = model(x[i : i + batch])
        total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[i : i + batch].reshape(-1), reduction="sum").item()
        count += y[i : i + batch].numel()
    return total / count


@dataclass
class CharLMConfig:
    attention: str = "softmax"
    ctx: int = 128
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    steps: int = 400
    batch_size: int = 16
    lr: float = 3e-3
    seed: int = 0


def run(cfg: CharLMConfig, data: CharData, *, sample_prompt: Optional[str] = "def ", sample_len: int = 80) -> dict:
    """Train one model; return validation perplexity, bits per character and a sample."""
    gen = seed_everything(cfg.seed)
    model = TinyLM(ModelConfig(
        vocab_size=data.vocab_size, block_size=cfg.ctx, n_layer=cfg.n_layer, n_head=cfg.n_head,
        d_model=cfg.d_model, attention=cfg.attention, seed=cfg.seed,
    ))
    losses = train(model, lambda s: data.batch(cfg.batch_size, cfg.ctx, generator=gen), steps=cfg.steps, lr=cfg.lr)
    val = validation_loss(model, data, cfg.ctx)
    out = {
        "config": asdict(cfg),
        "train_loss_first": losses[0],
        "train_loss_last": sum(losses[-20:]) / len(losses[-20:]),
        "val_loss": val,
        "val_perplexity": math.exp(val),
        "bits_per_char": val / math.log(2),
        "parameters": model.num_parameters(),
    }
    if sample_prompt:
        prompt = data.encode(sample_prompt)[None]
        n = min(sample_len, cfg.ctx - prompt.shape[1])
        ids = model.generate(prompt, n, temperature=0.8, generator=torch.Generator().manual_seed(cfg.seed))
        out["sample"] = data.decode(ids[0])
    return out


KINDS = ("softmax", "performer", "linear", "cosformer", "retnet")


def main(argv: Optional[list[str]] = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m linattn_lib.experiments.charlm", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="book/results/charlm.json")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=("softmax", "performer", "linear", "cosformer", "retnet", "ssd"))
    p.add_argument("--ctx", nargs="+", type=int, default=[64, 256])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--quick", action="store_true", help="tiny sweep for a smoke test (seconds)")
    args = p.parse_args(argv)
    if args.quick:
        args.kinds, args.ctx, args.seeds, args.steps = ["softmax", "linear"], [16], [0], 3
    text = build_corpus()
    data = CharData(text)
    grid = [(k, c, s) for k in args.kinds for c in args.ctx for s in args.seeds]
    results = []
    for kind, ctx, seed in progress_bar(grid, desc="char-LM sweep"):
        r = run(CharLMConfig(attention=kind, ctx=ctx, seed=seed, steps=args.steps), data)
        r["kind"] = kind
        results.append(r)
    payload = {"meta": run_metadata("linattn_lib.experiments.charlm", argv), "corpus": corpus_info(text), "results": results}
    write_json(args.out, payload)
    print(f"wrote {len(results)} runs to {args.out}")
    return payload


if __name__ == "__main__":
    main()
