"""The GPU check's benchmark: ours, flash-linear-attention (fla) and SDPA on the same values, timed fairly.

    from linattn_lib.experiments.gpu_bench import benchmark_cases, time_case
    for case in benchmark_cases():
        row = time_case(case, do_bench)

What is compared, bf16, forward (under no_grad) and forward+backward (`torch.autograd.grad`
of every input, no accumulation), median of `triton.testing.do_bench` after a first call
that compiles (and, for fla, autotunes) off the timer:

* the shapes: B in {2, 1, 4} at H=16, T=16384, D=128 (B=2 first: the row fla and Helion
  publish), then fla's six registry shapes (`REGISTRY_SHAPES`, fla's
  benchmarks/ops/registry.py `SHAPE_CONFIGS`, the shapes of pytorch/helion's
  examples/fla/BENCHMARKS.md), so the table lines up with the published one;
* the variants (`VARIANTS`): normalised (positive features) against fla's
  chunk_linear_attn(normalize=True); unnormalised without decay against
  chunk_linear_attn(normalize=False) (Helion's "vanilla"); unnormalised with a per-token
  log-decay against chunk_simple_gla(g); a fixed per-head decay (RetNet's, `retnet_log_decay`)
  against chunk_retention (fla's g_gamma);
* the providers: ours through the public API (`linear_attention(..., backend="triton")`,
  its dispatch and checks included) and through the op (`torch.ops.linattn.causal_fwd`, the
  custom op the API calls); fla with its inputs in its native (B, T, H, D) layout, made
  once, off the timer; torch's SDPA (causal softmax, flash) once per shape as the baseline.

Signed features are pre-scaled by D^-1/2 off the timer for ours (our op takes features as
given), and fla gets scale=D^-1/2 (applied inside its kernels, free): the same function.
`plan_calls` gives the same calls of ours on CPU tensors, for the dry run's launch record.
"""
from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..core.linear import linear_attention
from ..core.ssm import retnet_log_decay
from ..core.state import DEFAULT_EPS
from ..results import load_result
from .gpu_limits import Timeout, time_limit

DTYPE = torch.bfloat16
MAIN_BATCHES = (2, 1, 4)
MAIN_H, MAIN_T, MAIN_D = 16, 16384, 128


def _published_h100() -> tuple[tuple, dict, str]:
    """fla's registry shapes (B, T, H, D) and the measured H100 ms published for them, by our
    variant: {variant: {(B, T, H, D): (fla fwd, fla fwd+bwd, Helion fwd, Helion fwd+bwd)}}, for
    fla's chunk_linear_attn(normalize=False) and chunk_retention; from book/results/
    published_h100.json (pytorch/helion examples/fla/BENCHMARKS.md, its commit recorded there),
    and that source in a line."""
    data = load_result("published_h100.json")
    shape = {name: (s["B"], s["T"], s["H"], s["D"]) for name, s in data["shapes"].items()}
    variant = {"linear_attn": "unnormalised", "retention": "per-head decay"}
    table: dict = {v: {} for v in variant.values()}
    for r in data["rows"]:
        table[variant[r["op"]]][shape[r["shape"]]] = (r["fla"]["fwd"], r["fla"]["fwd+bwd"], r["helion"]["fwd"],
                                                      r["helion"]["fwd+bwd"])
    src = data["source"]
    return tuple(shape.values()), table, f"{src['repository']} {src['path']} @ {src['commit'][:8]} (H100, bf16, fla vs Helion)"


REGISTRY_SHAPES, PUBLISHED_H100, PUBLISHED_SOURCE = _published_h100()


@dataclass(frozen=True)
class Variant:
    """One operation, as ours computes it and as fla's `fla_op` does."""

    name: str
    normalize: bool
    decay: str | None  # None, "token" (B, H, T) or "head" (RetNet's fixed per-head decay)
    fla_op: str


# in the order they are timed: the two that fla and Helion publish first; the normalised one last
# (fla normalises with extra cumsum kernels, each autotuned per B and H)
VARIANTS = {v.name: v for v in (
    Variant("unnormalised", False, None, "chunk_linear_attn(normalize=False)"),
    Variant("per-head decay", False, "head", "chunk_retention"),
    Variant("per-token decay", False, "token", "chunk_simple_gla(g)"),
    Variant("normalised", True, None, "chunk_linear_attn(normalize=True)"),
)}
KEPT = "ours: op, kept states"  # causal_fwd_keep: the forward's chunk states kept for the backward
PROVIDERS = ("ours: linear_attention", "ours: op", KEPT, "fla", "sdpa")
PROFILED = ("per-token decay", "normalised")  # gpu_check's profiled fwd+bwd (ours, the op, B=2 of the main shape)


@dataclass(frozen=True)
class Case:
    """One row of the table: a shape (B, T, H, D), a variant and a provider."""

    B: int
    T: int
    H: int
    D: int
    variant: str
    provider: str

    @property
    def shape(self) -> str:
        return f"B={self.B} T={self.T} H={self.H} D={self.D}"

    @property
    def label(self) -> str:
        what = "softmax (flash)" if self.provider == "sdpa" else self.variant
        return f"{self.shape} {what}: {self.provider}"


def benchmark_shapes() -> list[tuple[int, int, int, int]]:
    """(B, T, H, D) in the order they are timed: the main shapes, then the other registry shapes
    (head dim 128 first: fla's autotuning at new head dims costs the most)."""
    main = [(B, MAIN_T, MAIN_H, MAIN_D) for B in MAIN_BATCHES]
    rest = [s for s in REGISTRY_SHAPES if s not in main]
    return main + sorted(rest, key=lambda s: s[3] != 128)


def benchmark_cases(providers: tuple[str, ...] = PROVIDERS) -> list[Case]:
    """Every row, in the order timed: ours at the main shapes (all four variants) and SDPA, then
    fla there (its first calls compile and autotune: whatever the budget leaves, ours is measured),
    then the other registry shapes, ours before fla, in the two variants Helion publishes."""
    main, rest = [], []
    for B, T, H, D in benchmark_shapes():
        if (T, H, D) == (MAIN_T, MAIN_H, MAIN_D):
            main += [(B, T, H, D, v) for v in VARIANTS]
        else:
            rest += [(B, T, H, D, v) for v in ("unnormalised", "per-head decay")]
    ours = [p for p in providers if p.startswith("ours") and p != KEPT]
    # keep_chunk_states beside the op (same inputs), at the main shapes in the profiled variants
    kept = lambda s: [KEPT] if s[4] in PROFILED and KEPT in providers else []
    cases = [Case(*s, p) for s in main for p in ours + kept(s)]
    cases += [Case(B, T, H, D, "normalised", "sdpa") for B, T, H, D, v in main if v == "normalised" and "sdpa" in providers]
    for part in (main, rest) if "fla" in providers else (main,):
        cases += [Case(*s, "fla") for s in part]
        if part is main:
            cases += [Case(*s, p) for s in rest for p in ours]
    return cases


def make_inputs(B: int, T: int, H: int, D: int, variant: Variant, device: str | torch.device, *,
                fill: str = "random", seed: int = 0) -> dict[str, torch.Tensor]:
    """Ours' inputs in (B, H, T, D), bf16 leaves: q, k (positive when normalised, signed and q
    pre-scaled by D^-1/2 otherwise), v, the output gradient do, the log-decay g (fp32; (B, H, T)
    per token, (H,) per head, fixed). fill "zeros" or "empty" (never read): the dry run's stand-ins."""
    gen = torch.Generator(device=device).manual_seed(seed)  # drawn where they live: seconds on a CPU at B=4
    random = fill == "random"

    def draw(*shape, positive=False):
        if not random:
            return (torch.zeros if fill == "zeros" else torch.empty)(shape, dtype=DTYPE, device=device)
        x = (torch.rand if positive else torch.randn)(shape, generator=gen, device=device)
        return x.to(DTYPE)

    q, k = draw(B, H, T, D, positive=variant.normalize), draw(B, H, T, D, positive=variant.normalize)
    if not variant.normalize:
        q = q * D**-0.5
    x = {"q": q, "k": k, "v": draw(B, H, T, D), "do": draw(B, H, T, D)}
    if variant.decay == "token":
        g = -0.1 * torch.rand(B, H, T, generator=gen, device=device) if random else torch.full((B, H, T), -0.05)
        x["g"] = g.to(device)
    elif variant.decay == "head":
        x["g"] = retnet_log_decay(H, device=device)
    for name in ("q", "k", "v") + (("g",) if variant.decay == "token" else ()):
        x[name].requires_grad_()
    return x


def ours_call(x: dict, variant: Variant, via: str) -> Callable[[], torch.Tensor]:
    """Ours on `x`: through the public API (via="api"), the custom op (via="op") or the op that
    keeps the forward's chunk states for the backward (via="keep")."""
    q, k, v, g = x["q"], x["k"], x["v"], x.get("g")
    if via == "api":
        return lambda: linear_attention(q, k, v, normalize=variant.normalize, log_decay=g, backend="triton")
    op = torch.ops.linattn.causal_fwd_keep if via == "keep" else torch.ops.linattn.causal_fwd
    return lambda: op(q, k, v, g, None, None, variant.normalize, DEFAULT_EPS, False)[0]


def fla_call(x: dict, variant: Variant) -> tuple[Callable[[], torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """fla's op for `variant` on copies of x in fla's (B, T, H, D) layout, made here, off the timer:
    (call returning o in (B, T, H, D), its leaves, the output gradient in that layout)."""
    import fla.ops.linear_attn as la
    import fla.ops.retention as ret
    import fla.ops.simple_gla as sg

    D = x["q"].shape[-1]
    t = {n: x[n].detach().transpose(1, 2).contiguous() for n in ("q", "k", "v", "do")}
    q, k, v = (t[n].requires_grad_() for n in ("q", "k", "v"))
    q = (q.detach() * D**0.5).requires_grad_() if not variant.normalize else q  # fla applies the scale itself
    scale = 1.0 if variant.normalize else D**-0.5
    leaves = [q, k, v]
    if variant.decay == "token":
        g = x["g"].detach().transpose(1, 2).contiguous().requires_grad_()
        leaves.append(g)
        return lambda: sg.chunk_simple_gla(q, k, v, g=g, scale=scale)[0], leaves, t["do"]
    if variant.decay == "head":  # fla computes the same log(1 - 2^(-5-h)) inside chunk_retention
        return lambda: ret.chunk_retention(q, k, v, scale=scale)[0], leaves, t["do"]
    return (lambda: la.chunk_linear_attn(q, k, v, scale=scale, normalize=variant.normalize)[0]), leaves, t["do"]


def case_call(case: Case, x: dict) -> tuple[Callable[[], torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """(forward call, the leaves its backward differentiates, the output gradient) of a case."""
    variant = VARIANTS[case.variant]
    if case.provider == "fla":
        return fla_call(x, variant)
    leaves = [x[n] for n in ("q", "k", "v", "g") if n in x and x[n].requires_grad]
    if case.provider == "sdpa":
        import torch.nn.functional as F

        q, k, v = x["q"], x["k"], x["v"]
        return lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), leaves, x["do"]
    via = {"ours: linear_attention": "api", KEPT: "keep"}.get(case.provider, "op")
    return ours_call(x, variant, via), leaves, x["do"]


def fwd_bwd(call: Callable[[], torch.Tensor], leaves: list[torch.Tensor], do: torch.Tensor) -> Callable[[], object]:
    """Forward and the gradients of every leaf (torch.autograd.grad: nothing accumulates)."""
    return lambda: torch.autograd.grad(call(), leaves, do)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def time_call(fn: Callable[[], object], do_bench: Callable, sync: Callable[[], None]) -> tuple[float, float]:
    """(seconds of the first call, compiles and autotuning included; median ms of do_bench after it)."""
    t0 = time.perf_counter()
    fn()
    sync()
    first = time.perf_counter() - t0
    return first, float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def fla_refuses_gated_backward() -> bool:
    """True where fla 0.6 refuses its gated backward (chunk_simple_gla with g): Hopper with
    3.4 <= Triton < 3.7.1 (fla issue #640, a miscompile), unless tilelang is installed."""
    import importlib.util

    import triton

    version = tuple(int(p) for p in re.findall(r"\d+", triton.__version__)[:3])
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
            and (3, 4, 0) <= version < (3, 7, 1) and importlib.util.find_spec("tilelang") is None)


def time_case(case: Case, x: dict, do_bench: Callable, sync: Callable[[], None] = torch.cuda.synchronize,
              reference: torch.Tensor | None = None, skip_backward: str | None = None) -> dict:
    """One row: forward and forward+backward ms (or the error of each), the first calls' seconds,
    fla's published H100 numbers where there are, and, given `reference` (ours' output in (B, H,
    T, D)), the relative RMS difference of this provider's output from it. skip_backward: the
    reason the backward is not attempted (recorded as its error)."""
    row = {"shape": case.shape, "B": case.B, "T": case.T, "H": case.H, "D": case.D, "variant": case.variant,
           "provider": case.provider, "dtype": "bfloat16"}
    if case.provider == "fla":
        row["fla_op"] = VARIANTS[case.variant].fla_op
    published = PUBLISHED_H100.get(case.variant, {}).get((case.B, case.T, case.H, case.D))
    if published and case.provider == "fla":
        row["published_h100_fla_ms"] = {"forward": published[0], "forward_backward": published[1]}
        row["published_h100_helion_ms"] = {"forward": published[2], "forward_backward": published[3]}
    try:
        call, leaves, do = case_call(case, x)
        with torch.no_grad():
            row["first_forward_s"], row["forward_ms"] = time_call(call, do_bench, sync)
            if reference is not None:
                o = call()
                row["rel_diff_from_ours"] = _rel(o.transpose(1, 2) if case.provider == "fla" else o, reference)
    except Exception as e:  # one failing provider must not hide the others
        row["error"] = f"{type(e).__name__}: {e}"[:400]
        return row
    if skip_backward:
        row["backward_error"] = f"not attempted: {skip_backward}"
        return row
    try:
        row["first_forward_backward_s"], row["forward_backward_ms"] = time_call(fwd_bwd(call, leaves, do), do_bench, sync)
    except Exception as e:  # e.g. fla's gated backward refused on Hopper under Triton < 3.7.1 (fla #640)
        row["backward_error"] = f"{type(e).__name__}: {e}"[:400]
    return row


def _api_planned(case: Case) -> bool:
    return case.B == 2 and (case.T, case.H, case.D) == (MAIN_T, MAIN_H, MAIN_D)


def plan_calls(cases: list[Case] | None = None, api: Callable[[Case], bool] = _api_planned
               ) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, call) of every forward and forward+backward of ours that the benchmark makes, on CPU
    stand-ins of the same shapes (for `record_launches(stub=True)`: nothing runs). The public API
    only where `api(case)` (default B=2 of the main shape: it makes the op's launches, and on CPU
    tensors its input checks read every element, seconds at these sizes), the op everywhere."""
    cache: dict = {}

    def inputs_for(case: Case, fill: str) -> dict:
        key = (case.B, case.T, case.H, case.D, case.variant, fill)
        if key not in cache:
            cache.clear()  # one shape at a time: the stand-ins are as large as the real inputs
            cache[key] = make_inputs(case.B, case.T, case.H, case.D, VARIANTS[case.variant], "cpu", fill=fill)
        return cache[key]

    for case in cases or benchmark_cases():
        via_api = case.provider.endswith("linear_attention")
        if not case.provider.startswith("ours") or (via_api and not api(case)):
            continue
        fill = "zeros" if via_api else "empty"  # the API's checks read them; the op never does

        def forward(case=case, fill=fill):
            with torch.no_grad():
                return case_call(case, inputs_for(case, fill))[0]()

        def forward_backward(case=case, fill=fill):
            return fwd_bwd(*case_call(case, inputs_for(case, fill)))()

        yield f"{case.label} forward", forward
        yield f"{case.label} forward+backward", forward_backward


def shape_bytes(B: int, T: int, H: int, D: int) -> int:
    """Bytes of one (B, H, T, D) bf16 tensor."""
    return math.prod((B, T, H, D)) * 2


# (variant, who) -> the row of the committed model (book/results/perf_model.json: B in {1, 4} at the main shape)
MODEL_ROWS = {("normalised", "ours"): "ours, normalised, no decay",
              ("per-token decay", "ours"): "ours, unnormalised, per-token decay",
              ("normalised", "fla"): "fla chunk_linear_attn(normalize=True)",
              ("per-token decay", "fla"): "fla chunk_simple_gla (per-token decay g)"}


def attach_model(row: dict, gpu_name: str, predictions: dict | None) -> dict:
    """The committed model's forward / forward+backward ms beside a row it predicts (same GPU
    kind, shape and op); returns the row."""
    gpu = next((g for g in ("H100", "H200") if g in gpu_name), None)
    if not predictions or gpu is None or (row["T"], row["H"], row["D"]) != (MAIN_T, MAIN_H, MAIN_D):
        return row
    # (kept states: the model's row is of the op that recomputes them, so none beside it)
    who = {"fla": "fla", "ours: linear_attention": "ours", "ours: op": "ours"}.get(row["provider"])
    try:
        model = predictions["ms"].get(f"{gpu} SXM, B={row['B']}", {}).get(MODEL_ROWS.get((row["variant"], who), ""))
    except (AttributeError, KeyError, TypeError):  # another layout of the file: no model beside the row
        return row
    if model:
        row["model_ms"] = {"forward": model["forward"], "forward_backward": model["total"],
                           "linattn_commit": predictions.get("linattn_commit")}
    return row


def _groups(cases: list[Case]) -> Iterator[tuple[tuple, list[Case]]]:
    group: list[Case] = []
    for case in cases:
        if group and (case.B, case.T, case.H, case.D, case.variant) != (group[0].B, group[0].T, group[0].H,
                                                                          group[0].D, group[0].variant):
            yield (group[0].B, group[0].T, group[0].H, group[0].D, group[0].variant), group
            group = []
        group.append(case)
    if group:
        yield (group[0].B, group[0].T, group[0].H, group[0].D, group[0].variant), group


# the longest the first call of one row may take (fla autotunes in it), seconds
FIRST_CALL_CAP = {"fla": 90.0, "ours": 60.0, "sdpa": 30.0}


def run_benchmark(deadline: float, put: Callable[[dict], None], do_bench: Callable,
                  cases: list[Case] | None = None) -> dict:
    """Time every case in order until `deadline` (time.monotonic()), one shape and variant's inputs
    at a time; `put(result)` after every row, so a run stopped at its limit keeps what it measured.
    Each row is cut at its `FIRST_CALL_CAP` (`time_limit`)."""
    from ..results import load_result

    cases = cases or benchmark_cases()
    predictions = load_result("perf_model.json", default=None)
    gpu_name, refuses = torch.cuda.get_device_name(), fla_refuses_gated_backward()
    rows: list[dict] = []
    result = {"rows": rows, "published_source": PUBLISHED_SOURCE, "dtype": "bfloat16",
              "timer": "triton.testing.do_bench(warmup=25, rep=100), median ms; first call excluded"}
    for (B, T, H, D, variant), group in _groups(cases):
        if time.monotonic() > deadline - 3:
            result["cut"] = f"budget spent before {B=} {T=} {H=} {D=} {variant}"
            break
        x = make_inputs(B, T, H, D, VARIANTS[variant], "cuda")
        with torch.no_grad():
            reference = ours_call(x, VARIANTS[variant], "op")()
        for case in group:
            left = deadline - time.monotonic()
            cap = min(FIRST_CALL_CAP[case.provider.split(":")[0]], left)
            skip = ("fla refuses it on Hopper for 3.4 <= Triton < 3.7.1 (fla #640)"
                    if case.provider == "fla" and VARIANTS[variant].decay == "token" and refuses else None)
            try:
                with time_limit(cap):
                    row = time_case(case, x, do_bench, reference=None if case.provider == "sdpa" else reference,
                                    skip_backward=skip)
            except Timeout:  # the row's limit (the section's own ends the loop at its next check)
                row = {"shape": case.shape, "B": B, "T": T, "H": H, "D": D, "variant": variant,
                       "provider": case.provider, "error": f"timed out after {cap:.0f} s (first call: compiles, autotuning)"}
            rows.append(attach_model(row, gpu_name, predictions))
            put(result)
        del x, reference
        torch.cuda.empty_cache()
    return result
