"""Character-level language models on a corpus every machine has offline: the docstrings of
Python's standard library.

The corpus is built deterministically (a fixed list of modules, their source parsed with `ast`,
docstrings in source order, ASCII only), so its size and SHA-256 identify it; results record
both. The split is by position: the first 90% trains, the last 10% validates, no overlap.

The zoo's models (softmax, Performer, elu+1 linear, cosFormer and a data-dependent decay in the
style of Mamba-2's SSD) are trained as small character models at a few context lengths and
seeds, with the same number of tokens per step at every length, and compared by validation
perplexity on the whole validation split (bits per character are log2 of it). Every run is
single-threaded, so its numbers do not depend on how many runs share the machine.

CLI: `python -m linattn_lib.experiments.charlm --out book/results/charlm.json` runs the full
sweep: 5 kinds x 2 context lengths x 3 seeds, 5000 steps of 1024 characters each, about 85
CPU-minutes of single-thread runs (the committed run: 5096 CPU-seconds, 60 minutes on a
shared 2-core machine with the default two workers; its meta records both). `--quick` is a
smoke run of a few seconds.
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..measure import torch_threads
from ..nn.models import ModelConfig, TinyLM
from . import ngram
from .common import parse_cli, run_metadata, seed_everything, train, write_json

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

# The sweep's attention kinds (TinyLM names) and the names the book uses for them.
KINDS = ("softmax", "performer", "linear", "cosformer", "ssd")
LABELS = {
    "softmax": "softmax", "performer": "Performer", "linear": "linear (elu+1)",
    "cosformer": "cosFormer", "ssd": "decayed (SSD)", "retnet": "decayed (RetNet)",
}


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


def build_corpus(modules: Sequence[str] = CORPUS_MODULES) -> str:
    """The corpus text: every docstring of `modules`, separated by blank lines, ASCII only.

    The text depends on the Python version (docstrings change between releases); `corpus_info`
    records the version, size and hash with every result.
    """
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
        "modules": len(CORPUS_MODULES),
    }


class CharData:
    """Encodes the corpus and serves random training windows and a fixed validation set."""

    def __init__(self, text: str, *, val_fraction: float = 0.1, chars: Sequence[str] | None = None):
        """`chars`: a saved model's vocabulary (ids in its order); characters of `text` outside
        it are dropped, so a model trained on another Python's corpus still reads this one."""
        if chars is not None:
            keep = set(chars)
            text = "".join(c for c in text if c in keep)
        self.chars = sorted(set(text)) if chars is None else list(chars)
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)
        n_val = max(1, int(len(data) * val_fraction))
        if n_val >= len(data):
            raise ValueError(f"CharData: val_fraction={val_fraction} leaves no training text in {len(data)} characters")
        # the split is by position: no overlap (data[:-0] would be empty, hence the explicit end)
        self.train, self.val = data[: len(data) - n_val], data[len(data) - n_val :]

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        return "".join(self.chars[int(i)] for i in ids)

    def encode(self, s: str) -> torch.Tensor:
        return torch.tensor([self.stoi[c] for c in s if c in self.stoi], dtype=torch.long)

    def batch(self, batch_size: int, ctx: int, *, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """`batch_size` random training windows of `ctx` characters and their next characters."""
        ix = torch.randint(0, len(self.train) - ctx - 1, (batch_size,), generator=generator)
        x = torch.stack([self.train[i : i + ctx] for i in ix.tolist()])
        y = torch.stack([self.train[i + 1 : i + ctx + 1] for i in ix.tolist()])
        return x, y

    def val_windows(self, ctx: int, max_windows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Consecutive non-overlapping validation windows (deterministic); all that fit by default."""
        n = (len(self.val) - 1) // ctx
        if max_windows is not None:
            n = min(n, max_windows)
        x = self.val[: n * ctx].view(n, ctx)
        y = self.val[1 : n * ctx + 1].view(n, ctx)
        return x, y


@torch.no_grad()
def validation_loss(model: TinyLM, data: CharData, ctx: int, *, max_windows: int | None = None, batch: int = 16) -> float:
    """Mean cross-entropy (nats per character) over the validation windows of length `ctx`.

    Every window starts from an empty context, so the mean covers positions 0 .. ctx-1: longer
    windows give the model more context on average (the usual perplexity at context length ctx).
    """
    was_training = model.training
    model.eval()
    x, y = data.val_windows(ctx, max_windows)
    total, count = 0.0, 0
    for i in range(0, len(x), batch):
        logits = model(x[i : i + batch])
        total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y[i : i + batch].reshape(-1), reduction="sum").item()
        count += y[i : i + batch].numel()
    model.train(was_training)
    return total / count


@dataclass
class CharLMConfig:
    """One training run. The batch holds `tokens_per_step // ctx` windows, so every context
    length sees the same number of characters per step and in total."""

    attention: str = "softmax"
    ctx: int = 256
    d_model: int = 64
    n_layer: int = 2
    n_head: int = 4
    steps: int = 5000
    tokens_per_step: int = 1024
    lr: float = 3e-3
    warmup: int = 200
    weight_decay: float = 0.0
    pos_init: str = "sinusoidal"
    pos_scale: float = 0.1
    seed: int = 0
    softmax_layers: tuple = ()  # a hybrid: these layers softmax, the others `attention`

    @property
    def batch_size(self) -> int:
        return max(1, self.tokens_per_step // self.ctx)


POS_INITS = ("normal", "sinusoidal")
VAL_EVERY = 500  # the sweep's validation curve: a point every 500 steps


def sinusoidal_positions(n: int, d: int, *, scale: float = 0.1) -> torch.Tensor:
    """The (n, d) table of Vaswani et al.: sin and cos of position / 10000^(2i/d), interleaved,
    scaled so that its entries have the root mean square `scale`.

    TinyLM draws its learned positions like every other weight (std 0.02). Starting them from
    this table instead gives every window positions whose dot products depend only on their
    offset, which attention can use from the first step; in trial runs of softmax at context
    256 a scale of 0.1 (five times the token embeddings' 0.02) left the bigram plateau about
    three times sooner than a random table or the table at scale 0.02, and 0.2-0.3 was worse.
    """
    pos = torch.arange(n, dtype=torch.float64)[:, None]
    freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    table = torch.zeros(n, d, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)[:, : d // 2]
    return (table * scale * math.sqrt(2.0)).float()


def make_model(cfg: CharLMConfig, vocab_size: int) -> TinyLM:
    """The run's TinyLM (its initialisation is seeded by cfg.seed); with
    cfg.pos_init="sinusoidal" its learned positions start from `sinusoidal_positions`."""
    if cfg.pos_init not in POS_INITS:
        raise ValueError(f"make_model: `pos_init` must be one of {POS_INITS}, got {cfg.pos_init!r}")
    model = TinyLM(ModelConfig(
        vocab_size=vocab_size, block_size=cfg.ctx, n_layer=cfg.n_layer, n_head=cfg.n_head,
        d_model=cfg.d_model, attention=cfg.attention, seed=cfg.seed, softmax_layers=tuple(cfg.softmax_layers),
    ))
    if cfg.pos_init == "sinusoidal":
        with torch.no_grad():
            model.pos.weight.copy_(sinusoidal_positions(cfg.ctx, cfg.d_model, scale=cfg.pos_scale))
    return model


def sample_text(model: TinyLM, data: CharData, prompt: str, length: int, *, seed: int = 0, temperature: float = 0.8) -> str:
    """Continue `prompt` by up to `length` characters with `TinyLM.generate`: the prompt is read
    in parallel, then every character is produced from the recurrent state (a KV cache for
    softmax). Sampling is seeded, so the text is reproducible."""
    ids = data.encode(prompt)[None]
    n = max(0, min(length, model.cfg.block_size - ids.shape[1]))
    out = model.generate(ids, n, temperature=temperature, generator=torch.Generator().manual_seed(seed))
    return data.decode(out[0])


@torch.no_grad()
def generation_state_bytes(model: TinyLM, T: int) -> int:
    """Bytes of the per-layer generation states after reading T tokens (batch 1): a KV cache
    (grows with T) for softmax layers, a constant-size (S, z) state for linear ones."""
    _, states = model(torch.zeros(1, T, dtype=torch.long), return_states=True)
    return model.state_nbytes(states)


def run(
    cfg: CharLMConfig,
    data: CharData,
    *,
    sample_prompt: str | None = "Return the ",
    sample_len: int = 200,
    curve_every: int = 25,
    val_every: int | None = None,
    val_curve_chars: int = 16384,
    progress: bool = False,
    return_model: bool = False,
) -> dict | tuple[dict, TinyLM]:
    """Train one model; return validation loss, perplexity, bits per character, a sample and costs.

    The result holds the config, the parameter count, the training-loss curve (means over
    blocks of `curve_every` steps), CPU and wall seconds, and the bytes of the generation state
    after `ctx` tokens. With `val_every` it also holds a validation curve: every `val_every`
    steps, the loss on the first `val_curve_chars` characters of the validation split (the
    final `val_loss` is always on all of it). With `return_model=True` the trained model comes
    back too: (result, model).
    """
    gen = seed_everything(cfg.seed)
    model = make_model(cfg, data.vocab_size)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.steps, desc=f"{cfg.attention} ctx={cfg.ctx} seed={cfg.seed}", file=sys.stderr, leave=False, dynamic_ncols=True)
    val_curve: list[list[float]] = []
    curve_windows = max(1, val_curve_chars // cfg.ctx)
    eval_cpu = [0.0]  # CPU seconds spent on the validation curve, kept out of the step time

    def tick(step: int, loss: float) -> None:
        if bar is not None:
            bar.update(1)
            if step % 20 == 0:
                bar.set_postfix(bpc=f"{loss / math.log(2):.2f}")
        if val_every and (step + 1) % val_every == 0 and step + 1 < cfg.steps:
            t0 = time.process_time()
            val_curve.append([step + 1, validation_loss(model, data, cfg.ctx, max_windows=curve_windows)])
            eval_cpu[0] += time.process_time() - t0

    cpu0, wall0 = time.process_time(), time.perf_counter()
    losses = train(
        model, lambda s: data.batch(cfg.batch_size, cfg.ctx, generator=gen), steps=cfg.steps, lr=cfg.lr, warmup=cfg.warmup, weight_decay=cfg.weight_decay,
        progress=tick if (bar or val_every) else None,
    )
    cpu_train, wall_train = time.process_time() - cpu0 - eval_cpu[0], time.perf_counter() - wall0
    if bar is not None:
        bar.close()
    if val_every:
        val_curve.append([cfg.steps, validation_loss(model, data, cfg.ctx, max_windows=curve_windows)])
    out = _summary(cfg, model, losses, validation_loss(model, data, cfg.ctx), curve_every, cpu_train, wall_train)
    if val_every:
        out["val_curve"] = val_curve
        out["val_curve_chars"] = curve_windows * cfg.ctx
    if sample_prompt:
        out["sample_prompt"] = sample_prompt
        out["sample"] = sample_text(model, data, sample_prompt, sample_len, seed=cfg.seed)
    out["cpu_seconds_total"] = time.process_time() - cpu0
    return (out, model) if return_model else out


def _summary(cfg: CharLMConfig, model: TinyLM, losses: list[float], val: float, curve_every: int,
             cpu_train: float, wall_train: float) -> dict:
    """`run`'s result before the optional parts: config, size, curves, losses and costs."""
    curve = [sum(losses[i : i + curve_every]) / len(losses[i : i + curve_every]) for i in range(0, len(losses), curve_every)]
    return {
        "kind": cfg.attention,
        "config": {**asdict(cfg), "batch_size": cfg.batch_size},
        "parameters": model.num_parameters(),
        "train_tokens": cfg.steps * cfg.batch_size * cfg.ctx,
        "train_curve": curve,
        "curve_every": curve_every,
        "train_loss_first": losses[0],
        "train_loss_last": sum(losses[-curve_every:]) / len(losses[-curve_every:]),
        "val_loss": val,
        "val_perplexity": math.exp(val),
        "bits_per_char": val / math.log(2),
        "cpu_seconds_train": cpu_train,
        "wall_seconds_train": wall_train,
        "ms_per_step_cpu": 1000 * cpu_train / max(1, cfg.steps),
        "state_bytes_at_ctx": generation_state_bytes(model, cfg.ctx),
    }


# ------------------------------------------------------------------------------------------
# the sweep
# ------------------------------------------------------------------------------------------

_WORKER_DATA: CharData | None = None


def _worker_init() -> None:
    global _WORKER_DATA
    torch.set_num_threads(1)
    _WORKER_DATA = CharData(build_corpus())


def _run_in_worker(cfg_dict: dict, val_every: int) -> dict:
    torch.set_num_threads(1)
    return run(CharLMConfig(**cfg_dict), _WORKER_DATA, val_every=val_every or None)


def sweep_configs(
    kinds: Sequence[str], ctxs: Sequence[int], seeds: Sequence[int], **overrides: object,
) -> list[CharLMConfig]:
    """The grid of runs, in a fixed order (kind, context length, seed)."""
    return [CharLMConfig(attention=k, ctx=c, seed=s, **overrides) for k in kinds for c in ctxs for s in seeds]


def summarize(results: list[dict]) -> dict:
    """{kind: {ctx: {"bpc_mean", "bpc_std", "ppl_mean", "ppl_std", "n"}}} over seeds."""
    table: dict = {}
    for r in results:
        table.setdefault(r["kind"], {}).setdefault(str(r["config"]["ctx"]), []).append(r)
    out: dict = {}
    for kind, by_ctx in table.items():
        out[kind] = {}
        for ctx, rs in by_ctx.items():
            bpc = [r["bits_per_char"] for r in rs]
            ppl = [r["val_perplexity"] for r in rs]
            out[kind][ctx] = {
                "bpc_mean": sum(bpc) / len(bpc),
                "bpc_std": _std(bpc),
                "ppl_mean": sum(ppl) / len(ppl),
                "ppl_std": _std(ppl),
                "n": len(rs),
            }
    return out


def _std(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m linattn_lib.experiments.charlm", description=__doc__.split("\n\n")[0])
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=("softmax", "performer", "linear", "cosformer", "retnet", "ssd"))
    p.add_argument("--ctx", nargs="+", type=int, default=[64, 256], help="context lengths")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=CharLMConfig.steps)
    p.add_argument("--d-model", type=int, default=CharLMConfig.d_model)
    p.add_argument("--layers", type=int, default=CharLMConfig.n_layer)
    p.add_argument("--tokens-per-step", type=int, default=CharLMConfig.tokens_per_step)
    p.add_argument("--lr", type=float, default=CharLMConfig.lr)
    p.add_argument("--warmup", type=int, default=CharLMConfig.warmup, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=float, default=CharLMConfig.weight_decay)
    p.add_argument("--pos-init", default=CharLMConfig.pos_init, choices=POS_INITS, help="initial learned positions")
    p.add_argument("--pos-scale", type=float, default=CharLMConfig.pos_scale, help="RMS of the sinusoidal initial positions")
    p.add_argument("--val-every", type=int, default=VAL_EVERY, help="steps between points of the validation curve (0: none)")
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1), help="runs in parallel (one thread each)")
    p.add_argument("--resume", action="store_true", help="keep finished runs found in --out, run only the rest")
    return p


def _config_key(c: CharLMConfig) -> str:
    return json.dumps({**asdict(c), "batch_size": c.batch_size}, sort_keys=True)


def _finished_runs(out: str, corpus_sha256: str) -> dict[str, dict]:
    """Runs already in `out` for this corpus, keyed like `_config_key` (for --resume)."""
    if not Path(out).exists():
        return {}
    old = json.loads(Path(out).read_text())
    if old.get("corpus", {}).get("sha256") != corpus_sha256:
        return {}
    return {json.dumps(r["config"], sort_keys=True): r for r in old.get("results", [])}


def _run_all(todo: list[CharLMConfig], text: str, workers: int, on_result: Callable[[CharLMConfig, dict], None], val_every: int = 0) -> None:
    """Train every config of `todo`, in this process or in `workers` spawned ones (one thread each)."""
    from tqdm.auto import tqdm

    bar = tqdm(total=len(todo), desc="char-LM sweep", file=sys.stderr, dynamic_ncols=True)

    def done(cfg: CharLMConfig, r: dict) -> None:
        on_result(cfg, r)
        bar.update(1)
        bar.set_postfix(last=f"{cfg.attention}/{cfg.ctx}/{cfg.seed} bpc={r['bits_per_char']:.2f}")

    if workers <= 1:
        with torch_threads(1):
            data = CharData(text)
            for cfg in todo:
                done(cfg, run(cfg, data, progress=True, val_every=val_every or None))
    else:
        import multiprocessing as mp

        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_worker_init) as ex:
            futures = {ex.submit(_run_in_worker, asdict(c), val_every): c for c in todo}
            for fut in as_completed(futures):
                done(futures[fut], fut.result())
    bar.close()


def main(argv: list[str] | None = None) -> dict:
    """The sweep CLI: train every (kind, context, seed), write JSON after each run."""
    args = parse_cli(_parser(), argv, "book/results/charlm.json")
    if args.quick:
        args.kinds, args.ctx, args.seeds, args.steps, args.tokens_per_step, args.workers = ["softmax", "linear"], [16], [0], 3, 64, 1
        args.val_every = 2
    overrides = {"steps": args.steps, "d_model": args.d_model, "n_layer": args.layers, "tokens_per_step": args.tokens_per_step,
                 "lr": args.lr, "warmup": args.warmup, "weight_decay": args.weight_decay, "pos_init": args.pos_init,
                 "pos_scale": args.pos_scale}
    grid = sweep_configs(args.kinds, args.ctx, args.seeds, **overrides)

    text = build_corpus()
    meta = run_metadata("linattn_lib.experiments.charlm", argv, device="cpu")
    meta.update(workers=args.workers, threads_per_run=1, load_average_start=list(os.getloadavg()))
    payload = {"meta": meta, "corpus": corpus_info(text), "split": {"train_fraction": 0.9, "by": "position"},
               "grid": {"kinds": args.kinds, "ctx": args.ctx, "seeds": args.seeds, **overrides, "val_every": args.val_every},
               "complete": False, "results": []}
    data = CharData(text)
    payload["baselines"] = ngram.baselines(data.train.numpy(), data.val.numpy(), data.vocab_size, args.ctx)
    done = _finished_runs(args.out, payload["corpus"]["sha256"]) if args.resume else {}
    results = {_config_key(c): done[_config_key(c)] for c in grid if _config_key(c) in done}

    def save(complete: bool) -> None:
        payload["results"] = [results[_config_key(c)] for c in grid if _config_key(c) in results]
        payload["complete"] = complete
        write_json(args.out, payload)

    def on_result(cfg: CharLMConfig, r: dict) -> None:
        results[_config_key(cfg)] = r
        save(False)

    wall0 = time.perf_counter()
    _run_all([c for c in grid if _config_key(c) not in done], text, args.workers, on_result, args.val_every)
    meta["wall_seconds_sweep"] = time.perf_counter() - wall0
    meta["cpu_seconds_runs"] = sum(r["cpu_seconds_total"] for r in results.values())
    meta["load_average_end"] = list(os.getloadavg())
    payload["summary"] = summarize([results[_config_key(c)] for c in grid])
    save(True)
    print(f"wrote {len(results)} runs to {args.out} in {meta['wall_seconds_sweep']:.0f} s "
          f"({meta['cpu_seconds_runs']:.0f} CPU s in the runs)", file=sys.stderr)
    return payload


if __name__ == "__main__":
    main()
