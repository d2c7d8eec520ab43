"""Converting a trained softmax TinyLM into linear attention, measured on chapter 8's corpus.

The recipe of Hedgehog (Zhang et al., 2024) and LoLCATs (Zhang et al., 2025) at laptop size:

1. **Teacher.** A softmax `TinyLM` trained on the character corpus (`train_teacher`; its
   weights are small enough to commit, book/results/convert_teacher.pt).
2. **Swap.** Every attention layer becomes a `ConvertedAttention` that keeps the teacher's
   projections and adds a Hedgehog feature map for queries and one for keys (`convert`).
3. **Attention transfer** (`transfer`). Only the feature maps train. Each layer sees the
   teacher's own input to that layer (teacher-forced), so the layers are independent problems
   and no gradient crosses a layer: one teacher forward per batch, one small backward per
   layer. Hedgehog's loss is the cross-entropy from the teacher's attention weights to the
   student's; LoLCATs' is the mean squared error between the layers' outputs.
4. **Low-rank fine-tuning** (`finetune`). LoRA adapters (rank 8) on the query, key, value
   and output projections, trained on the language-model loss with everything else frozen.

`run_method` measures bits per character after the swap, after transfer and after LoRA, for
"hedgehog" (cross-entropy transfer, linear), "lolcats" (output-MSE transfer, linear) and
"lolcats_window" (output MSE, softmax over the last `window` keys plus linear beyond).
`run_scratch` trains the same linear architecture from random weights for as many steps as
the teacher and the conversion took together ("scratch"), or as the conversion alone took
("scratch_budget").

CLI: `python -m linattn_lib.experiments.convert --out book/results/convert.json` trains the
teacher (or loads --teacher if it exists), then every method and the scratch model for each
seed, single-threaded runs `--jobs` at a time, checkpointing to <out>.partial. `--quick` is a
smoke run of seconds.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..measure import torch_threads
from ..nn.converted import ConvertedAttention, add_lora
from ..nn.layers import SoftmaxAttention, _split_heads
from ..nn.models import TinyLM
from . import charlm
from .common import parse_cli, progress_bar, run_metadata, seed_everything, train, write_json

METHODS = {  # name: (transfer loss, softmax window)
    "hedgehog": ("attention_ce", 0),
    "lolcats": ("output_mse", 0),
    "lolcats_window": ("output_mse", 16),
}


@dataclass
class ConvertConfig:
    """The teacher's size and training, and the conversion's steps and rates."""

    ctx: int = 128
    d_model: int = 64
    n_layer: int = 4
    n_head: int = 4
    tokens_per_step: int = 1024
    teacher_steps: int = 4000
    teacher_lr: float = 3e-3
    teacher_seed: int = 0
    transfer_steps: int = 1000
    transfer_lr: float = 1e-2
    finetune_steps: int = 2000
    finetune_lr: float = 1e-3
    lora_rank: int = 8
    lora_alpha: float = 16.0
    warmup: int = 100

    @property
    def batch_size(self) -> int:
        return max(1, self.tokens_per_step // self.ctx)

    def teacher_config(self) -> charlm.CharLMConfig:
        return charlm.CharLMConfig(attention="softmax", ctx=self.ctx, d_model=self.d_model, n_layer=self.n_layer,
                                   n_head=self.n_head, steps=self.teacher_steps, tokens_per_step=self.tokens_per_step,
                                   lr=self.teacher_lr, warmup=self.warmup, seed=self.teacher_seed)


def bits_per_char(model: TinyLM, data: charlm.CharData, ctx: int) -> float:
    """Bits per character on the whole validation split, windows of `ctx` (chapter 8's measure)."""
    return charlm.validation_loss(model, data, ctx) / torch.log(torch.tensor(2.0)).item()


def train_teacher(cfg: ConvertConfig, data: charlm.CharData) -> tuple[TinyLM, dict]:
    """The softmax teacher, trained as chapter 8 trains its models; returns (model, charlm result)."""
    result, model = charlm.run(cfg.teacher_config(), data, sample_prompt=None, return_model=True)
    return model, result


def save_teacher(path: os.PathLike, model: TinyLM, cfg: ConvertConfig, data: charlm.CharData, result: dict) -> None:
    """The teacher's weights with what is needed to use them: its config and its vocabulary."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    keep = {k: result[k] for k in ("bits_per_char", "cpu_seconds_train", "parameters")}
    torch.save({"config": asdict(cfg), "chars": data.chars, "state_dict": model.state_dict(), "result": keep}, path)


def load_teacher(path: os.PathLike) -> tuple[TinyLM, ConvertConfig, dict]:
    """(teacher, its ConvertConfig, the saved record: "chars", "result") from `save_teacher`'s file."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    cfg = ConvertConfig(**saved["config"])
    model = charlm.make_model(cfg.teacher_config(), len(saved["chars"]))
    model.load_state_dict(saved["state_dict"])
    return model.eval(), cfg, saved


def convert(teacher: TinyLM, *, window: int = 0) -> TinyLM:
    """A copy of `teacher` with every softmax layer a `ConvertedAttention` (identity feature maps)."""
    student = copy.deepcopy(teacher)
    for block in student.blocks:
        if isinstance(block.attn, SoftmaxAttention):
            block.attn = ConvertedAttention(block.attn, window=window)
    return student.eval()


def layer_inputs(model: TinyLM, x: torch.Tensor) -> list[torch.Tensor]:
    """What each block's attention reads on `x`: the output of its first layer norm."""
    seen = []
    hooks = [b.ln1.register_forward_hook(lambda m, i, o: seen.append(o)) for b in model.blocks]
    try:
        model(x)
    finally:
        for h in hooks:
            h.remove()
    return seen


def softmax_weights(layer: SoftmaxAttention, x: torch.Tensor) -> torch.Tensor:
    """The (B, H, T, T) causal softmax attention matrix of a teacher layer on its input x."""
    q, k, _ = (_split_heads(t, layer.n_heads) for t in layer.qkv(x).chunk(3, dim=-1))
    scores = q @ k.transpose(-1, -2) / layer.d_head ** 0.5
    T = x.shape[1]
    future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
    return torch.softmax(scores.masked_fill(future, float("-inf")), -1)


def transfer_loss(teacher_layer: SoftmaxAttention, student_layer: ConvertedAttention, x: torch.Tensor,
                  loss: str) -> torch.Tensor:
    """One layer's attention-transfer loss on its teacher-forced input x (B, T, d_model):
    "attention_ce" = mean over rows of -sum_j a_ij log b_ij (teacher a, student b);
    "output_mse" = mean squared error between the two layers' outputs."""
    if loss == "attention_ce":
        with torch.no_grad():
            a = softmax_weights(teacher_layer, x)
        b = student_layer.weights(x)
        return -(a * torch.log(b.clamp_min(1e-12))).sum(-1).mean()
    if loss == "output_mse":
        with torch.no_grad():
            y = teacher_layer(x)
        return F.mse_loss(student_layer(x), y)
    raise ValueError(f"transfer_loss: `loss` must be 'attention_ce' or 'output_mse', got {loss!r}")


def transfer(teacher: TinyLM, student: TinyLM, data: charlm.CharData, cfg: ConvertConfig, *, loss: str,
             seed: int = 0, steps: int | None = None) -> list[float]:
    """Train the student's feature maps layer by layer against the teacher (teacher-forced).

    Returns the summed per-layer loss of every step. Nothing but the feature maps changes.
    """
    gen = seed_everything(seed)
    for p in student.parameters():
        p.requires_grad_(False)
    pairs = [(t.attn, s.attn) for t, s in zip(teacher.blocks, student.blocks) if isinstance(s.attn, ConvertedAttention)]
    params = [p for _, s in pairs for p in s.feature_parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=cfg.transfer_lr)
    losses = []
    for _ in range(cfg.transfer_steps if steps is None else steps):
        x, _ = data.batch(cfg.batch_size, cfg.ctx, generator=gen)
        with torch.no_grad():
            inputs = layer_inputs(teacher, x)
        total = sum(transfer_loss(t, s, h, loss) for (t, s), h in zip(pairs, inputs))
        opt.zero_grad(set_to_none=True)
        total.backward()
        opt.step()
        losses.append(total.item())
    for p in params:
        p.requires_grad_(False)
    return losses


def finetune(student: TinyLM, data: charlm.CharData, cfg: ConvertConfig, *, seed: int = 0,
             steps: int | None = None) -> list[float]:
    """LoRA on every converted layer's projections, trained on the LM loss; all else frozen."""
    gen = seed_everything(seed)
    for p in student.parameters():
        p.requires_grad_(False)
    for block in student.blocks:
        if isinstance(block.attn, ConvertedAttention):
            add_lora(block.attn, cfg.lora_rank, cfg.lora_alpha, generator=gen)
    steps = cfg.finetune_steps if steps is None else steps
    return train(student, lambda s: data.batch(cfg.batch_size, cfg.ctx, generator=gen), steps=steps,
                 lr=cfg.finetune_lr, warmup=min(cfg.warmup, steps))


def run_method(method: str, seed: int, teacher: TinyLM, data: charlm.CharData, cfg: ConvertConfig) -> dict:
    """Swap, transfer and fine-tune with one of METHODS; bits per character after each stage."""
    loss, window = METHODS[method]
    cpu0 = time.process_time()
    student = convert(teacher, window=window)
    swap = bits_per_char(student, data, cfg.ctx)
    curve = transfer(teacher, student, data, cfg, loss=loss, seed=seed)
    transferred = bits_per_char(student, data, cfg.ctx)
    cpu1 = time.process_time()
    ft = finetune(student, data, cfg, seed=seed)
    return {
        "method": method, "seed": seed, "loss": loss, "window": window,
        "bpc": {"swap": swap, "transfer": transferred, "lora": bits_per_char(student, data, cfg.ctx)},
        "transfer_curve": [round(v, 5) for v in curve[:: max(1, len(curve) // 60)]],
        "finetune_first_last": [ft[0], sum(ft[-50:]) / len(ft[-50:])],
        "lora_parameters": sum(p.numel() for n, p in student.named_parameters() if n.endswith((".down", ".up"))),
        "feature_parameters": sum(p.numel() for b in student.blocks for p in b.attn.feature_parameters()),
        "cpu_seconds": {"transfer": cpu1 - cpu0, "finetune": time.process_time() - cpu1},
    }


SCRATCH = ("scratch", "scratch_budget")


def run_scratch(seed: int, data: charlm.CharData, cfg: ConvertConfig, *, budget: bool = False) -> dict:
    """The converted (linear, Hedgehog feature maps) architecture trained from random weights,
    every parameter trainable: for teacher_steps + transfer_steps + finetune_steps steps (the
    whole bill of teacher and conversion), or with budget=True for the conversion's own
    transfer_steps + finetune_steps (what a team that already has the teacher would spend)."""
    steps = cfg.transfer_steps + cfg.finetune_steps + (0 if budget else cfg.teacher_steps)
    scratch_cfg = dict(asdict(cfg.teacher_config()), seed=seed, steps=steps)
    model = convert(charlm.make_model(charlm.CharLMConfig(**scratch_cfg), data.vocab_size))
    for p in model.parameters():
        p.requires_grad_(True)
    gen = seed_everything(seed)
    cpu0 = time.process_time()
    losses = train(model, lambda s: data.batch(cfg.batch_size, cfg.ctx, generator=gen), steps=steps,
                   lr=cfg.teacher_lr, warmup=cfg.warmup)
    return {"method": SCRATCH[budget], "seed": seed, "steps": steps, "bpc": {"scratch": bits_per_char(model, data, cfg.ctx)},
            "final_train_loss": sum(losses[-50:]) / len(losses[-50:]), "parameters": model.num_parameters(),
            "cpu_seconds": {"train": time.process_time() - cpu0}}


def _job(job: tuple) -> dict:
    method, seed, teacher_path, cfg_dict = job
    with torch_threads(1):
        teacher, _, saved = load_teacher(teacher_path)
        data = charlm.CharData(charlm.build_corpus())
        if data.chars != saved["chars"]:
            raise RuntimeError("convert: this Python's corpus has another vocabulary than the teacher's")
        cfg = ConvertConfig(**cfg_dict)
        if method in SCRATCH:
            return run_scratch(seed, data, cfg, budget=method == "scratch_budget")
        return run_method(method, seed, teacher, data, cfg)


def _teacher(args: argparse.Namespace, cfg: ConvertConfig, data: charlm.CharData) -> dict:
    """Load the teacher at --teacher if it was trained as this config says, else train and save it."""
    path = Path(args.teacher)
    if path.exists():
        _, old_cfg, saved = load_teacher(path)
        if old_cfg.teacher_config() == cfg.teacher_config() and saved["chars"] == data.chars:
            return dict(saved["result"], path=str(path), trained_now=False)
    with torch_threads(1):
        model, result = train_teacher(cfg, data)
    save_teacher(path, model, cfg, data, result)
    return dict(bits_per_char=result["bits_per_char"], cpu_seconds_train=result["cpu_seconds_train"],
                parameters=result["parameters"], path=str(path), trained_now=True)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m linattn_lib.experiments.convert", description=__doc__.split("\n\n")[0])
    p.add_argument("--teacher", default="book/results/convert_teacher.pt", help="the teacher's weights (made if absent)")
    p.add_argument("--methods", nargs="+", default=[*METHODS, *SCRATCH], choices=[*METHODS, *SCRATCH])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    p.add_argument("--no-progress", action="store_true")
    args = parse_cli(p, argv, "book/results/convert.json")
    cfg = ConvertConfig()
    if args.quick:
        cfg = ConvertConfig(ctx=16, d_model=16, n_layer=2, n_head=2, tokens_per_step=64, teacher_steps=3,
                            transfer_steps=2, finetune_steps=2, warmup=1)
        args.seeds, args.jobs = [0], 1
        args.teacher = str(Path(args.out).with_suffix(".pt"))
    text = charlm.build_corpus()
    data = charlm.CharData(text)
    meta = run_metadata("linattn_lib.experiments.convert", argv, device="cpu")
    meta.update(jobs=args.jobs, threads_per_job=1, cpu_count=os.cpu_count(), config=asdict(cfg), seeds=args.seeds)
    teacher = _teacher(args, cfg, data)
    checkpoint = Path(str(args.out) + ".partial")
    done = {(r["method"], r["seed"]): r for r in (json.loads(checkpoint.read_text())["results"]
                                                  if checkpoint.exists() else [])}
    jobs = [(m, s) for s in args.seeds for m in args.methods]
    meta["runs_from_checkpoint"] = sorted([m, s] for m, s in done if (m, s) in jobs)  # a resumed sweep
    todo = [(m, s, args.teacher, asdict(cfg)) for m, s in jobs if (m, s) not in done]
    t0, pool = time.perf_counter(), None
    if args.jobs > 1 and len(todo) > 1:
        import multiprocessing as mp

        pool = mp.get_context("spawn").Pool(args.jobs)
    try:
        stream = pool.imap_unordered(_job, todo) if pool else map(_job, todo)
        for r in progress_bar(stream, desc="conversion", total=len(todo), enabled=not args.no_progress):
            done[(r["method"], r["seed"])] = r
            write_json(checkpoint, {"meta": meta, "teacher": teacher, "results": list(done.values())})
    finally:
        if pool is not None:
            pool.terminate()
    meta["sweep_seconds"] = round(time.perf_counter() - t0, 1)
    payload = {"meta": meta, "corpus": charlm.corpus_info(text), "teacher": teacher,
               "results": [done[j] for j in jobs]}
    write_json(args.out, payload)
    checkpoint.unlink(missing_ok=True)
    print(f"wrote {len(payload['results'])} results to {args.out}")
    return payload


if __name__ == "__main__":
    main()
