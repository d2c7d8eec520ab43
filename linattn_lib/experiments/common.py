"""Shared pieces of the experiment CLIs: seeding, a small training loop, result metadata."""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .. import __version__
from ..measure import device_name

if TYPE_CHECKING:  # matplotlib is imported where a figure is drawn
    from matplotlib.figure import Figure


def seed_everything(seed: int) -> torch.Generator:
    """Seed Python, torch (CPU and CUDA) and return a torch.Generator for data sampling."""
    random.seed(seed)
    torch.manual_seed(seed)
    return torch.Generator().manual_seed(seed)


def run_metadata(module: str, argv: list[str] | None = None, device: str | None = None) -> dict:
    """Everything needed to reproduce a result: command, versions, hardware, time.

    module: the CLI's module, e.g. "linattn_lib.experiments.mqar"; argv: its arguments;
    device: where it computed ("cpu" for the experiments that train on the CPU, so that a run
    on a GPU machine still names the CPU); None: the GPU if there is one, else the CPU.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    return {
        "command": " ".join(["python", "-m", module, *args]),
        "library_version": __version__,
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "hardware": device_name(device),
        "threads": torch.get_num_threads(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def cli_output_path(out: str | None, default: str, quick: bool) -> str:
    """Where a CLI writes its JSON: `out` if given, else `default`, or for a --quick smoke run
    `default` with a "-quick" suffix, so that a smoke test never overwrites the committed
    results the chapters plot (they take tens of CPU-minutes to regenerate)."""
    if out:
        return out
    if not quick:
        return default
    stem, dot, ext = default.rpartition(".")
    return f"{stem}-quick.{ext}" if dot else f"{default}-quick"


def parse_cli(p: argparse.ArgumentParser, argv: list[str] | None, default_out: str) -> argparse.Namespace:
    """Add the --out and --quick options every experiment CLI has, parse `argv`, and resolve
    `args.out` with `cli_output_path` (a --quick run without --out never overwrites
    `default_out`)."""
    quick_out = cli_output_path(None, default_out, quick=True)
    p.add_argument("--out", default=None, help=f"where to write the JSON results (default {default_out}; "
                   f"with --quick, {quick_out})")
    p.add_argument("--quick", action="store_true", help="tiny run for a smoke test (seconds)")
    args = p.parse_args(argv)
    args.out = cli_output_path(args.out, default_out, args.quick)
    return args


def write_json(path: os.PathLike, payload: dict) -> Path:
    """Write JSON atomically (a crash never leaves a half-written results file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=1, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path


def save_figure(fig: Figure, path: os.PathLike, title: str) -> Path:
    """Give a benchmark figure its title, save it as PNG (dpi 110, folders made) and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def train(
    model: torch.nn.Module,
    batches: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    *,
    steps: int,
    lr: float = 3e-3,
    weight_decay: float = 0.0,
    warmup: int = 20,
    grad_clip: float = 1.0,
    progress: Callable[[int, float], None] | None = None,
) -> list[float]:
    """AdamW with linear warm-up and cosine decay; `batches(step)` returns (inputs, targets).

    Targets equal to -100 are ignored by the loss (cross-entropy's ignore_index). Returns the
    training loss of every step.
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * s / steps)).item())
    )
    model.train()
    losses = []
    for step in range(steps):
        x, y = batches(step)
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if progress is not None:
            progress(step, losses[-1])
    model.eval()
    return losses


def progress_bar(iterable: Iterable, *, desc: str, total: int | None = None, enabled: bool = True) -> Iterable:
    """tqdm on stderr for CLIs; a plain iterable when disabled (notebooks stay free of bars)."""
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, file=sys.stderr, dynamic_ncols=True)
