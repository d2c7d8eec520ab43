"""The GPU check's extra measurements: the decoding step, the FAVOR+ feature map and the
launch-config sweep of the two-phase kernels (`gpu_check`'s "extras" section), and the
committed model's predictions beside benchmark rows.

* `run_decode_benchmark`: one decoding step at a batch whose fp32 states dwarf the caches;
* `run_favor_benchmark`: the FAVOR+ feature map in torch against the fused kernel;
* `run_graph_benchmark`: the op's forward+backward as called and replayed from a CUDA graph;
* `run_config_sweep`: each kernel of the two-phase engine alone under every candidate config
  (`candidate_configs`) at the benchmark shape, and the state pass split-T (`run_split_sweep`):
  the configs in kernels/configs.py were chosen without a GPU; these numbers choose them;
* `attach_predictions`: the committed model's (book/results/perf_model.json) forward and
  forward+backward ms beside the rows it has a prediction for.

Each takes `do_bench` and `device`, so that the CPU tests run them in the interpreter with a
stand-in timer (tests/test_kernels_interpret.py).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from .kernel_selftest import FAILED

if TYPE_CHECKING:
    import torch


def _bench(fn, do_bench) -> float:
    return float(do_bench(fn, warmup=25, rep=100))


def _fwd_bwd(fn, inputs):
    """fn's forward and backward with a fixed random output gradient."""
    import torch

    with torch.no_grad():
        do = torch.randn_like(fn())

    def run():
        for x in inputs:
            x.grad = None
        fn().backward(do)

    return run


# benchmark row -> the performance model's row (book/results/perf_model.json, same shape)
PREDICTED_AS = {
    "linattn triton (normalised)": "ours, normalised, no decay",
    "linattn triton (unnormalised, per-token decay)": "ours, unnormalised, per-token decay",
    "fla chunk_simple_gla (unnormalised, per-token decay)": "fla chunk_simple_gla (per-token decay g)",
    "fla chunk_linear_attn (normalised)": "fla chunk_linear_attn(normalize=True)",
}


def attach_predictions(rows: list[dict], gpu_name: str, B: int = 1) -> list[dict]:
    """Put the performance model's predicted forward and forward+backward ms beside each
    benchmark row it has a prediction for (the committed book/results/perf_model.json, for
    the H100 or H200 the name says; other GPUs get none). Returns the rows."""
    from ..results import load_result

    pred = load_result("perf_model.json", default=None)
    gpu = next((g for g in ("H100", "H200") if g in gpu_name), None)
    if pred is None or gpu is None:
        return rows
    table = pred["ms"].get(f"{gpu} SXM, B={B}", {})
    for row in rows:
        model = table.get(PREDICTED_AS.get(row["name"], ""))
        if model is not None:
            row["predicted_forward_ms"] = model["forward"]
            row["predicted_forward_backward_ms"] = model["total"]
    return rows


def _time_candidate(name, fn, inputs, shape, do_bench, dtype: str = "bfloat16") -> dict:
    import torch

    row = {"name": name, "shape": shape, "dtype": dtype}
    try:
        with torch.no_grad():
            row["forward_ms"] = round(_bench(fn, do_bench), 3)
        row["forward_backward_ms"] = round(_bench(_fwd_bwd(fn, inputs), do_bench), 3)
    except Exception as e:  # one failing candidate must not hide the others
        row["error"] = f"{type(e).__name__}: {e}"[:500]
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def run_favor_benchmark(B: int, H: int, T: int, d: int = 64, m: int = 256, *, do_bench: Callable,
                        device: str = "cuda") -> list[dict]:
    """The FAVOR+ feature map of keys (global stabiliser: the two-launch case) and queries (row
    stabiliser), torch against the fused kernel (kernels/favor.py), bf16, forward and
    forward+backward: the measurement that decides whether the fused map should become the
    default on CUDA."""
    import torch

    from ..core.features import positive_random_features, random_projection

    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter has no bf16
    x = (torch.randn(B, H, T, d, device=device) * 1.5).to(dtype).requires_grad_()
    W = random_projection(m, d, seed=0).to(device=device, dtype=dtype)
    s, shape = d**-0.25, f"B={B} H={H} T={T} d={d} m={m}"
    rows = []
    for stabilize, who in (("global", "keys"), ("row", "queries")):
        for backend in ("torch", "triton"):
            def fn(stabilize=stabilize, backend=backend):
                return positive_random_features(x, W, input_scale=s, stabilize=stabilize, backend=backend)

            name = f"FAVOR+ features of {who} ({stabilize} max), {backend}"
            rows.append(_time_candidate(name, fn, [x], shape, do_bench, dtype=str(dtype).replace("torch.", "")))
    return rows


def run_decode_benchmark(B: int = 64, H: int = 16, D: int = 128, *, do_bench: Callable,
                         device: str = "cuda") -> dict:
    """One decoding step (normalised, per-head decay) at a batch whose fp32 states (B H D^2 x 4
    bytes, 64 MiB here) dwarf the caches: the step reads and writes every state once, so its
    time is set by that traffic. Returns ms, the state bytes moved and the bandwidth reached."""
    import torch

    from .. import kernels as K

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.rand(B, H, D, device=device, dtype=dtype) for _ in range(3))
    S = torch.zeros(B, H, D, D, device=device)
    z = torch.zeros(B, H, D, device=device)
    g = -torch.rand(H, device=device) * 0.1
    ms = float(do_bench(lambda: K.decode_step(q, k, v, S, z, log_decay=g), warmup=25, rep=100))
    moved = 2 * (S.numel() + z.numel()) * 4
    return {"name": "decode step (state read + write)", "shape": f"B={B} H={H} D={D}", "ms": round(ms, 4),
            "state_bytes": moved, "GB_per_s": round(moved / (ms * 1e-3) / 1e9, 1)}


# the CUDA-graph row (`run_graph_benchmark`): the main shape's B and H (its configs, its compiled
# kernels) at an eighth of its length, where the kernels take about as long as the host's Python
GRAPH_SHAPE = (2, 2048, 16, 128)  # B, T, H, D


def host_ms(fn: Callable[[], object], sync: Callable[[], None], calls: int = 20) -> float:
    """Median CPU time (ms) the calling thread spends in fn(): the Python, checks, autograd and
    launches that a GPU waits on when it is faster than they are (it runs the launched work
    meanwhile). `sync` after each call, off the clock, keeps the launch queue from filling:
    a full queue would make a launch wait for the GPU. fn has run before (compiled, warm).
    `host_overhead` estimates the same without a GPU, with the same clock (`_median_times`)."""
    from .host_overhead import _median_times

    sync()
    return round(_median_times({"call": fn}, calls, after=sync, warmup=0)["call"] / 1e3, 4)


def run_graph_benchmark(variant: str = "per-token decay", shape: tuple[int, int, int, int] = GRAPH_SHAPE, *,
                        do_bench: Callable, device: str = "cuda", capture: Callable | None = None,
                        host_calls: int = 20) -> dict:
    """What a CUDA graph removes: `linear_attention` forward+backward timed as called (its Python,
    checks and launches every time: about 0.5 ms of host time on a 2-core cloud CPU,
    `host_overhead`) and replayed from the graphs `torch.cuda.make_graphed_callables` captures of its forward and backward. Capture fails
    if the hot path synchronises or copies from the host; the replay's gradients must equal the
    eager ones (`max_rel_diff`). Also the host's own time per call of each (`host_ms`):
    "eager_host_ms", "graphed_host_ms", medians of `host_calls` calls. capture: stands in for
    make_graphed_callables (CPU tests)."""
    import torch

    from ..core.linear import linear_attention
    from . import gpu_bench as gb

    B, T, H, D = shape
    var = gb.VARIANTS[variant]
    x = gb.make_inputs(B, T, H, D, var, device)
    names = [n for n in ("q", "k", "v", "g") if n in x and x[n].requires_grad]
    leaves = [x[n] for n in names]

    def attend(*xs):
        a = {**x, **dict(zip(names, xs))}
        return linear_attention(a["q"], a["k"], a["v"], normalize=var.normalize, log_decay=a.get("g"),
                                backend="triton")

    row = {"name": "linear_attention fwd+bwd, eager and from a CUDA graph", "variant": variant,
           "shape": f"B={B} T={T} H={H} D={D}"}
    try:
        eager = gb.fwd_bwd(lambda: attend(*leaves), leaves, x["do"])
        row["eager_ms"] = round(float(do_bench(eager, warmup=10, rep=50)), 4)
        sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
        row["eager_host_ms"] = host_ms(eager, sync, host_calls)
        try:
            graphed = (capture or torch.cuda.make_graphed_callables)(attend, tuple(leaves))
        except Exception as e:  # what made capture fail is the finding
            return dict(row, error=f"capture: {type(e).__name__}: {e}"[:300])
        replay = gb.fwd_bwd(lambda: graphed(*leaves), leaves, x["do"])
        row["graphed_ms"] = round(float(do_bench(replay, warmup=10, rep=50)), 4)
        row["graphed_host_ms"] = host_ms(replay, sync, host_calls)
        row["max_rel_diff"] = max(gb._rel(a, b) for a, b in zip(replay(), eager()))
    except Exception as e:  # recorded; the next extras still run
        row["error"] = f"{type(e).__name__}: {e}"[:300]
    return row


def candidate_configs(kernel: str, d_whole: int, dtype: torch.dtype, capability: tuple[int, int] | None) -> list[dict]:
    """Launch configs worth timing for `kernel` at one head-dim bucket on this GPU: the chosen
    one first, then its neighbours -- each block width (BK, BV) halved or doubled within 16 to
    64, at its warp count -- and the chosen blocks on the other warp count (4 or 8), at the
    chosen chunk length (the two phases must share it) and pipelining depth: at most ten per
    kernel, so that the sweep's compiles fit the GPU check's time. Which fit the GPU's shared
    memory is decided by the run itself (a config that does not fit fails to launch and is
    reported)."""
    from .. import kernels as K

    chosen = K.select_config(kernel, d_whole, dtype, capability)

    def near(b: int) -> list[int]:
        return [x for x in (b // 2, b, b * 2) if 16 <= x <= 64]

    out = [chosen]
    for BK in near(chosen["BK"]):
        for BV in near(chosen["BV"]):
            out.append(dict(chosen, BK=BK, BV=BV))
    out.append(dict(chosen, num_warps=12 - chosen["num_warps"]))
    return [cfg for i, cfg in enumerate(out) if cfg not in out[:i]]


def _sweep_calls(B: int, H: int, T: int, D: int, dtype, device: str) -> dict:
    """kernel name -> call(config) launching that kernel alone on inputs of the benchmark shape
    (normalised, per-token decay); the state tensors they read are made once, up front."""
    import torch

    from .. import kernels as K

    torch.manual_seed(0)
    q, k = (torch.rand(B, H, T, D, device=device, dtype=dtype) for _ in range(2))
    v, do = (torch.randn(B, H, T, D, device=device, dtype=dtype) for _ in range(2))
    g = -torch.rand(B, H, T, device=device) * 0.1
    o, den, _, _ = K.chunk_fwd_two_phase(q, k, v, log_decay=g)
    r, e, _ = K.chunk_bwd_prep(do, o, den)
    h, hz, _, _ = K.chunk_states(k, v, log_decay=g)
    dh, dhz, _, _ = K.chunk_states(q, do, log_decay=g, reverse=True, key_scale=r, z_weights=e)
    layout = (None, None, None, h.shape[2])
    return {
        "chunk_state": lambda cfg: K.chunk_states(k, v, log_decay=g, config=cfg),
        "chunk_output": lambda cfg: K.chunk_output(q, k, v, h, hz, log_decay=g, config=cfg),
        "chunk_dqk": lambda cfg: K.chunk_dqk(q, k, v, do, g, r, e, (h, hz), (dh, dhz), layout, None, cfg),
        "chunk_dv": lambda cfg: K.chunk_dv(q, k, do, g, r, dh, layout, None, cfg),
    }


def run_config_sweep(B: int = 1, H: int = 16, T: int = 16384, D: int = 128, *, do_bench: Callable,
                     device: str = "cuda", deadline: float | None = None) -> list[dict]:
    """Time each kernel of the two-phase engine alone (chunk_state, chunk_output, chunk_dqk,
    chunk_dv) under every candidate config at the benchmark shape, bf16 (fp16 before sm_80),
    normalised, per-token decay. The configs in kernels/configs.py were chosen without a GPU,
    from compile-time evidence (registers, spills, CTAs per SM: tests/test_kernels_compile.py);
    these numbers are what should replace that evidence. Configs not started by `deadline`
    (time.monotonic()) are reported as cut."""
    import time

    import torch

    from .. import kernels as K

    candidates = lambda kernel, chosen, dtype, cap: candidate_configs(kernel, K.whole_dim(D), dtype, cap)
    rows = _variant_sweep(B, H, T, D, candidates, TWO_PHASE, do_bench=do_bench, device=device, deadline=deadline,
                          cpu_dtype=torch.float32)
    if deadline is not None and time.monotonic() > deadline:
        return rows
    dtype = torch.float32 if device == "cpu" else torch.bfloat16 if _capability(device) >= (8, 0) else torch.float16
    return rows + run_split_sweep(1, max(1, H // 8), T, D, dtype=dtype, do_bench=do_bench, device=device)


def _capability(device: str) -> tuple[int, int] | None:
    import torch

    return torch.cuda.get_device_capability() if device == "cuda" else None


def _variant_sweep(B: int, H: int, T: int, D: int, variants: Callable[..., list[dict]],
                   kernels: tuple[str, ...], *, do_bench: Callable, device: str,
                   deadline: float | None, cpu_dtype=None) -> list[dict]:
    """Each of `kernels` alone (`_sweep_calls`: bf16 on CUDA, fp16 before sm_80; `cpu_dtype`,
    default fp16, in the CPU's interpreter) under every config `variants(kernel, chosen, dtype,
    capability)` makes of its chosen one; configs not started by `deadline` (time.monotonic())
    are reported as cut."""
    import time

    import torch

    from .. import kernels as K

    cap = _capability(device)
    if cap is None:
        dtype = cpu_dtype or torch.float16
    else:
        dtype = torch.bfloat16 if cap >= (8, 0) else torch.float16
    rows = []
    for kernel, call in _sweep_calls(B, H, T, D, dtype, device).items():
        if kernel not in kernels:
            continue
        chosen = K.select_config(kernel, D, dtype, cap)
        for cfg in variants(kernel, chosen, dtype, cap):
            row = {"kernel": kernel, "config": cfg, "chosen": cfg == chosen, "shape": f"B={B} H={H} T={T} D={D}",
                   "dtype": str(dtype).replace("torch.", "")}
            if deadline is not None and time.monotonic() > deadline:
                rows.append(dict(row, error="cut: the time budget ran out"))
                continue
            try:
                row["ms"] = round(float(do_bench(lambda call=call, cfg=cfg: call(cfg), warmup=10, rep=50)), 4)
            except Exception as e:  # e.g. out of shared memory on this GPU
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
    return rows


TWO_PHASE = ("chunk_state", "chunk_output", "chunk_dqk", "chunk_dv")


def run_stage_sweep(B: int = 1, H: int = 16, T: int = 16384, D: int = 128, *, do_bench: Callable,
                    device: str = "cuda", deadline: float | None = None,
                    stages: tuple[int, ...] = (1, 3, 4)) -> list[dict]:
    """Each kernel of the two-phase engine alone, as run_config_sweep times it, under its chosen
    config at other software-pipelining depths (num_stages): the first GPU run measured every
    kernel at 2-3x the model's HBM-bound time whatever its tile widths."""
    return _variant_sweep(B, H, T, D, lambda k, c, *_: [dict(c, num_stages=n) for n in stages], TWO_PHASE,
                          do_bench=do_bench, device=device, deadline=deadline)


def run_operand_sweep(B: int = 1, H: int = 16, T: int = 16384, D: int = 128, *, do_bench: Callable,
                      device: str = "cuda", deadline: float | None = None) -> list[dict]:
    """The three parallel kernels under their chosen config, as they are and with the rounding of
    their fp32 operands to bf16 before the in-chunk products (`kernels.rounds_operands`, fla's
    choice) flipped: chunk_dqk and chunk_dv round by default on sm_90 since the fitted model
    (experiments/kernel_fit.py) predicted them 11-25% faster so; this measures it."""
    from .. import kernels as K

    flip = lambda k, c, dtype, cap: [c, dict(c, round_operands=not K.rounds_operands(c, dtype))]
    return _variant_sweep(B, H, T, D, flip, TWO_PHASE[1:], do_bench=do_bench, device=device, deadline=deadline)


# whole-op experiments (run_override_sweep), most telling first: name -> `kernels.overridden` changes
_ROUNDED = {k: {"round_operands": True} for k in TWO_PHASE[1:]}
OVERRIDE_SETS = {
    "as chosen": {},
    # chunk_dqk and chunk_dv round by default on sm_90 since the fitted model (kernel_fit.py)
    "operands not rounded (before the fitted model)": {k: {"round_operands": False} for k in TWO_PHASE[1:]},
    # plain walks (no decay: both operands copied asynchronously) at the depth the others keep
    "plain state walks at 2 stages": {"chunk_state": {"plain_stages": 2}},
    # and one chunk deeper: a walk step took 1.2-1.5 us, fla's 0.73 with the same loop (SASS): is
    # the chain waiting on loads issued too few chunks ahead?
    "plain state walks at 4 stages": {"chunk_state": {"plain_stages": 4}},
    # chunk_dv and chunk_output run one program per chunk on sm_90 since the fitted model (8 warps
    # capped at 128 registers): back to two value tiles
    "chunk_dv in two value tiles (before)": {"chunk_dv": {"BK": 32, "BV": 64, "num_warps": 4, "maxnreg": None}},
    "chunk_output in two value tiles (before)": {"chunk_output": {"BK": 32, "BV": 64, "maxnreg": None}},
    # another: dq, dk in one key tile per chunk (dO v^T and the decays formed once, as fla's dqkwg on
    # Hopper), capped for 2 CTAs per SM: spills 2-4 registers with a decay; predicted ~17% faster
    "chunk_dqk in one key tile": {"chunk_dqk": {"BK": 128, "BV": 32}},
    # and the walks': with a decay, keys read transposed (copied ahead, 3 stages; decayed in the
    # product's operand layout: 235 SASS a chunk, not 129), as plain walks read them
    "decayed walks read their keys transposed": {"chunk_state": {"decayed_keys_t": True}},
    # and the backward's: chunk_dqk's and chunk_dv's work for a chunk in one program (its dO v^T and
    # decays formed once; q, k, dO, dH_n read once from HBM, again from L2): 0.9-1.1 GB less traffic
    "dq, dk, dv in one kernel": {"chunk_dqk": {"fused_dqkv": True}},
    "operands rounded to bf16": _ROUNDED,
    "chunk_dqk without its register cap": {"chunk_dqk": {"maxnreg": None}},
}


# the whole-op sweep's variants, the goal's first (the issue's: a decay per token)
SWEPT_VARIANTS = ("per-token decay", "unnormalised", "normalised")


def override_plan_calls(variants: tuple[str, ...] = SWEPT_VARIANTS, B: int = 2,
                        T: int = 16384, H: int = 16, D: int = 128) -> Iterator[tuple[str, Callable[[], object]]]:
    """(label, call) of `run_override_sweep`'s forward+backward under each changed set, on CPU
    stand-ins (for `gpu_plan.record_plan`): the precompile builds their kernels with the rest, on
    all cores, instead of the extras compiling them one by one inside their minute."""
    from .. import kernels as K
    from . import gpu_bench as gb

    for variant in variants:
        x = gb.make_inputs(B, T, H, D, gb.VARIANTS[variant], "cpu", fill="empty")
        for name, changes in OVERRIDE_SETS.items():
            if changes:
                def call(variant=variant, changes=changes, x=x):
                    with K.overridden(changes):
                        return gb.fwd_bwd(*gb.case_call(gb.Case(B, T, H, D, variant, "ours: op"), x))()

                yield f"{variant}, {name}", call


def run_override_sweep(variants: tuple[str, ...] = SWEPT_VARIANTS, B: int = 2, T: int = 16384,
                       H: int = 16, D: int = 128, *, do_bench: Callable, device: str = "cuda",
                       deadline: float | None = None) -> list[dict]:
    """Forward+backward of ours through the op, as the benchmark times it, under each of
    `OVERRIDE_SETS`: the decisions taken without a GPU since the first run (rounded operands in
    chunk_dqk and chunk_dv, plain walks 3 deep, chunk_dv and chunk_output in one value tile,
    chunk_dqk capped at 128 registers) undone one at a time, and the next candidates (plain walks
    4 deep, chunk_dqk in one key tile, decayed walks reading their keys transposed, dq, dk and dv
    in one kernel)."""
    import time

    from .. import kernels as K
    from . import gpu_bench as gb

    rows = []
    for variant in variants:
        x = gb.make_inputs(B, T, H, D, gb.VARIANTS[variant], device)
        step = gb.fwd_bwd(*gb.case_call(gb.Case(B, T, H, D, variant, "ours: op"), x))
        for name, changes in OVERRIDE_SETS.items():
            row = {"variant": variant, "shape": f"B={B} T={T} H={H} D={D}", "override": name}
            if deadline is not None and time.monotonic() > deadline:
                rows.append(dict(row, error="cut: the time budget ran out"))
                continue
            try:
                with K.overridden(changes):
                    row["forward_backward_ms"] = round(float(do_bench(step, warmup=10, rep=50)), 4)
            except Exception as e:  # recorded; the next set still runs
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
    return rows


def run_split_sweep(B: int, H: int, T: int, D: int, *, dtype: torch.dtype, do_bench: Callable,
                    device: str = "cuda", splits: tuple[int, ...] | None = None) -> list[dict]:
    """The state pass (normalised, per-token decay) where its grid is small (B * H = 2 at the
    benchmark shape): walked whole, in the runs the launcher picks (split-T), and in twice as
    many, or in each count of `splits`; the model's predictions are in
    book/results/perf_model.json ("split_T")."""
    import torch

    from .. import kernels as K

    torch.manual_seed(0)
    k = torch.rand(B, H, T, D, device=device, dtype=dtype)
    v = torch.randn(B, H, T, D, device=device, dtype=dtype)
    g = -torch.rand(B, H, T, device=device) * 0.1
    cfg = K.select_config("chunk_state", D, dtype, None if device == "cpu" else torch.device(device))
    programs = -(-D // cfg["BK"]) * (-(-D // cfg["BV"]) + 1) * B * H
    NT = -(-T // cfg["BT"])
    sms = K.configs.multiprocessor_count(device) or 132
    chosen = K.split_count(programs, NT, sms)
    rows = []
    for n in dict.fromkeys(splits or (1, chosen, 2 * chosen)):
        row = {"kernel": f"chunk_state split-T, B={B} H={H}", "config": {"splits": n}, "chosen": n == chosen,
               "shape": f"B={B} H={H} T={T} D={D}", "dtype": str(dtype).replace("torch.", "")}
        call = lambda n=n: K.chunk_states(k, v, log_decay=g, splits=n)
        try:
            row["ms"] = round(float(do_bench(call, warmup=10, rep=50)), 4)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
    return rows


def extras_markdown(env: dict, checks: dict, bench: list[dict], sweep: list[dict] = ()) -> str:
    """The legacy tables: environment, checks, benchmark rows (with the model's), config sweep."""
    lines = ["# GPU check", "", "| | |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in env.items()]
    lines += ["", "## Checks", ""]
    for what, res in checks.items():
        lines.append(f"* {what}: **{res.get('status')}** {res.get('summary', res.get('reason', ''))}")
    failures = [r for r in checks.get("kernel self-test", {}).get("checks", []) if r["status"] == FAILED]
    if failures:
        lines += ["", "| failed check | dtype | problems |", "| --- | --- | --- |"]
        lines += [f"| {r['name']} | {r['dtype']} | {'; '.join(r['problems'])[:200]} |" for r in failures]
    lines += ["", "## Benchmark (median ms, triton.testing.do_bench)", "",
              "| implementation | shape | forward | forward + backward | model: fwd / fwd+bwd |",
              "| --- | --- | ---: | ---: | ---: |"]
    for r in bench:
        if "error" in r:
            lines.append(f"| {r['name']} | {r['shape']} | error: {r['error'][:80]} | | |")
        elif "GB_per_s" in r:
            lines.append(f"| {r['name']} | {r['shape']} | {r['ms']:.4f} ({r['GB_per_s']:.0f} GB/s) | | |")
        else:
            model = (f"{r['predicted_forward_ms']:.2f} / {r['predicted_forward_backward_ms']:.2f}"
                     if "predicted_forward_ms" in r else "")
            lines.append(f"| {r['name']} | {r['shape']} | {r['forward_ms']:.2f} | {r['forward_backward_ms']:.2f} | {model} |")
    if sweep:
        lines += ["", "## Launch configs (median ms; * = the one select_config picks)", "",
                  "| kernel | config | ms |", "| --- | --- | ---: |"]
        for r in sorted(sweep, key=lambda r: (r["kernel"], r.get("ms", float("inf")))):
            cfg = ", ".join(f"{k}={v}" for k, v in r["config"].items())
            ms = f"{r['ms']:.3f}" if "ms" in r else f"error: {r['error'][:60]}"
            lines.append(f"| {r['kernel']}{' *' if r['chosen'] else ''} | {cfg} | {ms} |")
    return "\n".join(lines) + "\n"
