"""A performance model of the causal kernels on H100 / H200, beside fla's decomposition.

The appendix's tool; `python -m linattn_lib.chapters.perf_model [--detail]` prints the
benchmark shapes (B in {1, 4}, H = 16, T = 16384, D = 128, bf16). It needs no GPU, uses none.

1. `census` runs our real launchers (`causal_forward`, `causal_backward`) on meta tensors with
   `launchable` replaced by a recorder (`recording`): every launch (kernel, grid, arguments by
   name) and every eager torch op between them is recorded; nothing runs. fla's launches come the
   same way from its launchers replayed (perf_fla.py: `Replay`, `replay_calls`).
2. `launch_of` makes a `Launch` of each: bytes of the tensors it touches (`REREAD`: which its
   programs re-read), steps per program (`STEPS`), SASS instructions of one warp in the loop
   body and outside it (`sass_stats_of`: compiled as the JIT would; the loop found by its
   backward branch), CTAs per SM from that compile.
3. `predict` times each launch; the launches run one after another:

       P = prod(grid);  R = min(CTAs/SM, ceil(P / SMs));  waves W = ceil(P / (SMs R))
       I = steps x body + rest;  c = max(cpi, ceil(R num_warps / 4)) cycles per instruction
       t = max(HBM bytes / bandwidth, W I c / clock, MMA FLOPs / peak) + launch overhead

   A warp alone on its scheduler issues every cpi cycles; warps sharing one of the 4 take
   turns. HBM bytes: each tensor once, plus once per re-reading program unless the programs
   sharing an element run together (spread in launch order <= SMs x CTAs/SM: L2 hits). An
   eager torch op reads and writes each of its tensors once.
4. `compare`: the rows of `ROWS`, pairs of the same op (ours normalised, no decay or a per-head one,
   against fla's chunk_linear_attn(normalize=True); ours with a per-token decay against fla's
   chunk_simple_gla(g)), each beside its fused op's HBM `roofline`; fla's autotuners stood in for by
   the model's fastest of `perf_fla.fla_candidates` (`tuned_launches`); `assumptions`: what it assumes.
"""
from __future__ import annotations

import contextlib
import inspect
import math
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..core import triton_ops
from ..flops import io_bytes
from . import kernel_anatomy as ka
from . import perf_fla
from .sass import (  # noqa: F401 (the model's API)
    SassStats,
    compiled_kernel,
    loop_of,
    parse_sass,
    sass_stats_of,
    sass_weighted,
)


@dataclass(frozen=True)
class GPU:
    """The numbers of one GPU the model uses (sources beside `GPUS`)."""

    name: str
    sms: int
    bandwidth: float            # HBM, bytes/s
    clock: float                # SM clock under load, Hz
    tensor_flops: float         # dense bf16/fp16 tensor-core FLOP/s
    target: str = "sm_90"       # compile target; its occupancy limits: kernel_anatomy.SM_RESOURCES
    issue_per_sm: int = 4       # warp instructions an SM issues per cycle
    cpi: float = 4.0            # cycles between two instructions of a warp alone (assumed)
    launch_overhead: float = 3e-6


# SMs: 132 on H100 SXM5 (NVIDIA H100 Tensor Core GPU Architecture whitepaper, 2022); H200 is
# the same GH100 part with HBM3e (NVIDIA H200 datasheet, 2024). HBM: 3.35 TB/s (H100
# datasheet, book/references.bib nvidia2023h100), 4.8 TB/s (H200 datasheet). Tensor peak:
# 989 TFLOP/s dense bf16 in both datasheets (1,979 "with sparsity") = 132 SMs x 4096 FLOP/clk
# x 1.83 GHz, the whitepaper's boost clock for tensor work. Clock 1.755 GHz: assumed for a
# sustained load (max boost 1.98 GHz). Issue: 4 SM sub-partitions, each scheduler issuing one
# warp instruction per clock (whitepaper). cpi 4 (about the dependent-issue latency of the
# ALU pipes) and the 3 us launch overhead are assumptions, not measurements.
GPUS = {
    "H100 SXM": GPU("H100 SXM", sms=132, bandwidth=3.35e12, clock=1.755e9, tensor_flops=989.4e12),
    "H200 SXM": GPU("H200 SXM", sms=132, bandwidth=4.8e12, clock=1.755e9, tensor_flops=989.4e12),
}
_cdiv = lambda a, b: -(-a // b)


@dataclass
class Call:
    """One recorded launch: a Triton kernel (`fn` its JITFunction, `args` by parameter name),
    or an eager torch op (`fn` None, `args` {"in": tensors, "out": tensors})."""

    kernel: str
    grid: tuple[int, ...]
    args: dict[str, Any]
    num_warps: int = 4
    num_stages: int = 2
    fn: Any = None
    maxnreg: int | None = None  # a cap on registers per thread (configs.MAXNREG)


class _Recorder:
    """Stands in for `launchable(kernel, device)`: `[grid](*args, **kwargs)` records a Call."""

    def __init__(self, kernel: Any, calls: list[Call]) -> None:
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, num_warps: int = 4, num_stages: int = 3, maxnreg: int | None = None,
                   **kwargs: Any) -> None:  # Triton's defaults
            py = getattr(self.kernel, "fn", self.kernel)
            bound = inspect.signature(py).bind(*args, **kwargs)
            bound.apply_defaults()
            g = grid(bound.arguments) if callable(grid) else grid
            self.calls.append(Call(py.__name__, tuple(map(int, g)), dict(bound.arguments), num_warps, num_stages,
                                   self.kernel, maxnreg))
        return launch


_FREE_OPS = ("aten.empty", "aten.scalar_tensor", "aten.lift_fresh", "aten.detach", "aten._local_scalar_dense")


@contextlib.contextmanager
def _eager_ops(calls: list[Call]) -> Iterator[None]:
    """Within the block every eager torch op (not views, allocations) is appended to `calls`."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class TorchOps(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if not func.is_view and not str(func.overloadpacket).startswith(_FREE_OPS):
                tensors = lambda x: [t for t in tree_leaves(x) if isinstance(t, torch.Tensor)]
                ins, outs = tensors((args, kwargs)), tensors(out)
                calls.append(Call(f"torch:{func.overloadpacket}", (), {"in": ins, "out": outs}))
            return out

    with TorchOps():
        yield


@contextlib.contextmanager
def recording() -> Iterator[list[Call]]:
    """Within the block kernel launches and eager torch ops (not views, allocations) are recorded, not
    run. Every kernel module imported `launchable` by name: it is replaced in each, then put back."""
    triton_ops.require_kernels("recording")
    original = sys.modules["linattn_lib.kernels.configs"].launchable
    modules = [m for n, m in list(sys.modules.items())
               if n.startswith("linattn_lib.kernels") and getattr(m, "launchable", None) is original]
    calls: list[Call] = []
    for m in modules:
        m.launchable = lambda kernel, device: _Recorder(kernel, calls)
    try:
        with _eager_ops(calls):
            yield calls
    finally:
        for m in modules:
            m.launchable = original


DECAYS = (None, "head", "token")  # no decay, one log-decay per head (H,), one per token (B, H, T)


@contextlib.contextmanager
def _capability(target: str, sms: int | None = None) -> Iterator[None]:
    """Within the block `select_config` picks `target`'s configs, split-T splits as on `sms` SMs (None: never)."""
    configs = sys.modules["linattn_lib.kernels.configs"]
    state = sys.modules["linattn_lib.kernels.chunk_state"]
    originals = configs.device_capability, state.multiprocessor_count
    configs.device_capability, state.multiprocessor_count = lambda d: configs.TARGETS[target], lambda d: sms
    try:
        yield
    finally:
        configs.device_capability, state.multiprocessor_count = originals


def census(B: int, H: int, T: int, D: int, dtype: torch.dtype = torch.bfloat16, *, normalize: bool = True,
           decay: str | None = None, target: str = "sm_90", sms: int | None = None) -> dict[str, list[Call]]:
    """{"forward": [...], "backward": [...]}: our causal op's launches at (B, H, T, D) from the real
    launchers (no initial state; gradients of q, k, v and of a per-token log-decay, a per-head one
    being fixed) on meta tensors (no memory), with the configs `select_config` picks on `target`
    (default sm_90: an H100 or H200) and the state passes split (split-T) as on a GPU of `sms`
    SMs (None: not split). decay: one of `DECAYS` (fp32)."""
    if decay not in DECAYS:
        raise ValueError(f"census: decay must be one of {DECAYS}, not {decay!r}")
    q, k, v, do = (torch.empty(B, H, T, D, dtype=dtype, device="meta") for _ in range(4))
    g = None if decay is None else torch.empty(*((H,) if decay == "head" else (B, H, T)), device="meta")
    with recording() as fwd, _capability(target, sms):
        o, den, S_T, z_T = triton_ops.causal_forward(q=q, k=k, v=v, g=g, S0=None, z0=None, normalize=normalize,
                                                     eps=1e-6, return_state=False)
    with recording() as bwd, _capability(target, sms):
        triton_ops.causal_backward(q=q, k=k, v=v, g=g, S0=None, z0=None, o=o, den=den, S_T=S_T, z_T=z_T, do=do,
                                   dS_T=None, dz_T=None, normalize=normalize,
                                   needs=(True, True, True, decay == "token", False, False))
    return {"forward": fwd, "backward": bwd}


# kernel -> {argument: grid axes whose programs all read the same elements of it}; any other tensor argument
# is touched once (one program per element). Every kernel the census meets should be listed
# (tests/test_perf_model.py checks), if only to say that it re-reads nothing; fla's come from perf_fla.
# the backward's parallel kernels read a chunk's decays in every program of its axis 0
_DECAY_TABLES = dict.fromkeys(("g_ptr", "hi_ptr", "lo_ptr", "ka_ptr", "kr_ptr"), (0,))
REREAD: dict[str, dict[str, tuple[int, ...]]] = {
    "chunk_state_kernel": {"k_ptr": (1,), "v_ptr": (0,), "ka_ptr": (0, 1), "gl_ptr": (0, 1), "r_ptr": (0, 1),
                           "w_ptr": (0, 1)},
    "chunk_state_merge_kernel": {"e_ptr": (2,), "lg_ptr": (0, 1), "lr_ptr": (0, 1, 2)}, "chunk_decay_kernel": {},
    "chunk_output_kernel": {"q_ptr": (0,), "k_ptr": (0,), "hz_ptr": (0,), "g_ptr": (0,)},
    "chunk_dqk_kernel": {"v_ptr": (0,), "do_ptr": (0,), "r_ptr": (0,), "e_ptr": (0,), **_DECAY_TABLES},
    "chunk_dv_kernel": {"q_ptr": (0,), "k_ptr": (0,), "r_ptr": (0,), **_DECAY_TABLES}, "chunk_bwd_prep_kernel": {},
    "chunk_dqkv_kernel": {},  # one program per chunk: each chunk's tensors read by one program
    "decay_grad_kernel": {}, "live_length_kernel": {}, **perf_fla.REREAD,
}
# kernel -> {argument: the fraction read} of kernels that stop early (the census has no dead tail: P blocks a row)
PART_READ = {"live_length_kernel": {"do_ptr": lambda a: min(1.0, a["P"] * a["BT"] / a["T"])}}

# kernel -> sequential steps of one program (trips of its main loop), from its arguments
STEPS: dict[str, Callable[[dict], int]] = {
    "chunk_state_kernel": lambda a: a["NS"], "chunk_state_merge_kernel": lambda a: a["NS"],  # chunks per run
    "chunk_output_kernel": lambda a: _cdiv(a["Dk"], a["BK"]), "chunk_dqk_kernel": lambda a: _cdiv(a["Dv"], a["BV"]),
    "chunk_dv_kernel": lambda a: _cdiv(a["Dk"], a["BK"]), "decay_grad_kernel": lambda a: _cdiv(a["T"], a["BT"]),
    "live_length_kernel": lambda a: 1, **perf_fla.STEPS,
}
# kernel -> the trips of each loop of its SASS (`sass.loop_spans`, address order), for kernels of
# several loops: the instructions of a warp are then counted loop by loop (`sass.weighted_counts`)
LOOP_TRIPS: dict[str, Callable[[dict], list[int]]] = {
    "chunk_dqkv_kernel": lambda a: [_cdiv(a["Dv"], a["BV"]), _cdiv(a["Dk"], a["BK"]), _cdiv(a["Dv"], a["BV"]),
                                    *[_cdiv(a["Dk"], a["BKV"])] * a["NVO"]],
}


@dataclass(frozen=True)
class Launch:
    """One launch as the model sees it. Instructions are one warp's; bytes_hbm is what HBM
    moves, bytes_requested adds the re-reads L2 serves. An eager torch op has grid ()."""

    kernel: str
    grid: tuple[int, ...]
    num_warps: int
    bytes_hbm: int
    bytes_requested: int
    steps: int
    instr_per_step: int
    instr_fixed: int
    ctas_per_sm: int
    flops: int = 0

    @property
    def programs(self) -> int:
        """Programs (CTAs) in the grid; 0 for an eager torch op."""
        return math.prod(self.grid) if self.grid else 0

    @property
    def instr_per_warp(self) -> int:
        """Instructions one warp of one program issues: steps x loop body + the rest."""
        return self.steps * self.instr_per_step + self.instr_fixed


_nbytes = lambda t: min(t.numel() * t.element_size(), t.untyped_storage().nbytes())


def traffic(call: Call, slots: int) -> tuple[int, int]:
    """(HBM bytes, requested bytes) of a call when `slots` programs run at once (SMs x CTAs/SM). A
    tensor under several names (stand-ins for unused pointers) counts once, least re-read; re-reads
    along `REREAD` axes hit L2 when the sharers are <= `slots` apart in launch order (axis 0 first)."""
    if call.fn is None and "in" in call.args:  # an eager op: its inputs, then its outputs
        b = sum(_nbytes(t) for part in ("in", "out") for t in {id(t): t for t in call.args[part]}.values())
        return b, b
    rules, part, seen = REREAD.get(call.kernel, {}), PART_READ.get(call.kernel, {}), {}
    for name, val in call.args.items():
        if isinstance(val, torch.Tensor):
            axes = rules.get(name, ())
            rep = math.prod(call.grid[a] for a in axes)
            spread = 1 + sum((call.grid[a] - 1) * math.prod(call.grid[:a]) for a in axes)
            if id(val) not in seen or rep < seen[id(val)][1]:
                seen[id(val)] = (int(_nbytes(val) * part.get(name, lambda a: 1)(call.args)), rep, spread)
    hbm = sum(size * (1 if spread <= slots else rep) for size, rep, spread in seen.values())
    return hbm, sum(size * rep for size, rep, _ in seen.values())


Stats = Callable[[Call, str], SassStats]


def analog_stats(call: Call, target: str = "sm_90") -> SassStats:
    """SASS numbers of a kernel without its source (`call.fn` None): those of our kernel of the same
    loop structure (`perf_fla.ANALOGS`; unnormalised, with a per-token decay when the call has its
    USE_G) compiled at the call's BK, BV, warps and stages."""
    decay = "token" if call.args.get("USE_G") else None
    ours = next(c for c in census(1, 1, 128, call.args["K"], normalize=False, decay=decay, target=target)["forward"]
                if c.kernel == perf_fla.ANALOGS[call.kernel])
    return sass_stats_of(replace(ours, args={**ours.args, "BK": call.args["BK"], "BV": call.args["BV"]},
                                 num_warps=call.num_warps, num_stages=call.num_stages), target)


def launch_of(call: Call, gpu: GPU, stats: Stats | None = None) -> Launch:
    """The `Launch` of a recorded call; `stats(call, target)` gives its SASS numbers (default:
    `sass_stats_of`, which compiles it; `analog_stats` for a kernel without its source)."""
    if call.fn is None and "in" in call.args:
        return Launch(call.kernel, (), 0, *traffic(call, 1), 0, 0, 0, 1)
    s = (stats or (analog_stats if call.fn is None and call.kernel in perf_fla.ANALOGS else sass_stats_of))(
        call, gpu.target)
    ctas = ka.ctas_per_sm(s.registers, call.num_warps, s.shared_bytes, gpu.target).ctas
    hbm, requested = traffic(call, gpu.sms * max(ctas, 1))
    if call.kernel in LOOP_TRIPS:  # loop by loop: one step of all of them
        instr, flops = sass_weighted(call, LOOP_TRIPS[call.kernel](call.args), gpu.target)
        return Launch(call.kernel, call.grid, call.num_warps, hbm, requested, 1, instr - (s.total - s.body),
                      s.total - s.body, ctas, call.num_warps * flops * math.prod(call.grid))
    steps = STEPS.get(call.kernel, lambda a: 1)(call.args) if s.body else 0  # no rule: the loop runs once
    flops = call.num_warps * (steps * s.flops_body + s.flops_rest) * math.prod(call.grid)
    return Launch(call.kernel, call.grid, call.num_warps, hbm, requested, steps, s.body, s.total - s.body, ctas, flops)


def launch_time(launch: Launch, gpu: GPU) -> dict:
    """One launch's predicted time and its parts (seconds), by the model of the module docstring."""
    P = launch.programs
    parts = {"hbm": launch.bytes_hbm / gpu.bandwidth, "chain": 0.0, "mma": launch.flops / gpu.tensor_flops}
    waves, interval = 0, 0.0
    if P:
        if launch.ctas_per_sm < 1:
            raise ValueError(f"{launch.kernel}: a block does not fit on an SM")
        resident = min(launch.ctas_per_sm, _cdiv(P, gpu.sms))
        waves = _cdiv(P, gpu.sms * resident)
        interval = max(gpu.cpi, _cdiv(resident * launch.num_warps, gpu.issue_per_sm))
        parts["chain"] = waves * launch.instr_per_warp * interval / gpu.clock
    return {"kernel": launch.kernel, "grid": launch.grid, "programs": P, "ctas_per_sm": launch.ctas_per_sm,
            "waves": waves, "steps": launch.steps, "instr_per_step": launch.instr_per_step,
            "instr_per_warp": launch.instr_per_warp, "interval": interval,
            "bytes_hbm": launch.bytes_hbm, "t_hbm": parts["hbm"], "t_chain": parts["chain"], "t_mma": parts["mma"],
            "bound": max(parts, key=parts.get), "time": max(parts.values()) + gpu.launch_overhead}


def predict(launches: list[Launch], gpu: GPU) -> list[dict]:
    """The table: one `launch_time` row per launch, in order (`total_time` adds them up)."""
    return [launch_time(launch, gpu) for launch in launches]


def total_time(rows: list[dict]) -> float:
    """Seconds of a `predict` table."""
    return sum(r["time"] for r in rows)


def roofline(B: int, H: int, T: int, D: int, itemsize: int, gpu: GPU, *, normalize: bool = True,
             decay: str | None = None) -> dict[str, float]:
    """HBM roofline of the fused op (s), `flops.io_bytes`: q, k, v read and o written once (forward);
    q, k, v, dO (and o, normalised) read and dq, dk, dv written once (backward); a log-decay (fp32,
    `DECAYS`) is read in both and its gradient written (per token; a per-head one is fixed)."""
    fwd = io_bytes(B, H, T, D, D, itemsize)
    bwd = io_bytes(B, H, T, D, D, itemsize, mode="fwd+bwd") - fwd - (0 if normalize else B * H * T * D * itemsize)
    g = {None: 0, "head": H * 4, "token": B * H * T * 4}[decay]
    fwd, bwd = fwd + g, bwd + g * (2 if decay == "token" else 1)
    return {"forward": fwd / gpu.bandwidth, "backward": bwd / gpu.bandwidth, "total": (fwd + bwd) / gpu.bandwidth}


def replay_calls(B: int, H: int, T: int, D: int, variant: tuple[bool, str | None], configs: dict[str, dict],
                 kernels: dict[str, Any], dtype: torch.dtype = torch.bfloat16) -> dict[str, list[Call]]:
    """{"forward": [...], "backward": [...]}: fla's launches and eager ops for `variant` ((normalize,
    decay) of `perf_fla.VARIANTS`), recorded from `perf_fla.Replay` on meta tensors; configs:
    kernel -> config (`perf_fla.fla_candidates`); kernels: fla's compiled ones (`perf_fla.fla_kernels`)."""
    fwd: list[Call] = []
    bwd: list[Call] = []
    into = lambda calls: lambda name, grid, args, nw, ns: calls.append(Call(name, grid, args, nw, ns, kernels.get(name)))
    with _eager_ops(fwd):
        saved = perf_fla.Replay(B, H, T, D, configs, into(fwd), kernels, dtype).forward(*variant)
    with _eager_ops(bwd):
        perf_fla.Replay(B, H, T, D, configs, into(bwd), kernels, dtype).backward(saved)
    return {"forward": fwd, "backward": bwd}


def tuned_launches(make_calls: Callable[[dict], dict[str, list[Call]]], candidates: dict[str, list[dict]],
                   gpu: GPU, stats: Stats | None = None) -> tuple[dict[str, list[Launch]], dict[str, dict]]:
    """(launches by part, configs) of `make_calls(configs)`, each kernel at the one of its `candidates`
    the model predicts fastest over all its launches (an autotuner times them on the GPU; a config
    that does not fit is never picked); configs only of the kernels the calls launch."""
    chosen = {name: options[0] for name, options in candidates.items()}
    used = {c.kernel for part in make_calls(chosen).values() for c in part}

    def cost(name: str, cfg: dict) -> float:
        calls = make_calls({**chosen, name: cfg})
        launches = [launch_of(c, gpu, stats) for part in calls.values() for c in part if c.kernel == name]
        return total_time(predict(launches, gpu)) if min(x.ctas_per_sm for x in launches) else math.inf

    for name in (n for n in candidates if n in used and len(candidates[n]) > 1):
        chosen[name] = min(candidates[name], key=lambda cfg, name=name: cost(name, cfg))
    calls = make_calls(chosen)
    return ({part: [launch_of(c, gpu, stats) for c in cs] for part, cs in calls.items()},
            {n: cfg for n, cfg in chosen.items() if n in used})


@dataclass(frozen=True)
class Row:
    """One row of `compare`: ours (`census`), fla's (`perf_fla.Replay`) or the fused op's `roofline`."""

    label: str
    who: str                  # "ours", "fla" or "roofline"
    normalize: bool
    decay: str | None = None  # one of `DECAYS`


_FLA = {variant: label for label, variant in perf_fla.VARIANTS.items()}
# pairs of the same op, each group ending with its roofline (the "x roof" of the rows above it)
ROWS = (Row("ours, normalised, no decay", "ours", True), Row("ours, normalised, per-head decay", "ours", True, "head"),
        Row(_FLA[True, None], "fla", True), Row("HBM roofline, normalised", "roofline", True),
        Row("ours, unnormalised, per-token decay", "ours", False, "token"),
        Row(_FLA[False, "token"], "fla", False, "token"), Row("HBM roofline, per-token decay", "roofline", False, "token"))
PARTS = ("forward", "backward", "total")


def _totals(rows: dict[str, list[dict]]) -> dict[str, float]:
    out = {part: total_time(r) for part, r in rows.items()}
    return {**out, "total": sum(out.values())}


def compare(B: int, T: int, H: int, D: int, gpu: GPU | str = "H100 SXM", *, dtype: torch.dtype = torch.bfloat16,
            stats: Stats | None = None, fla_root: str | None = None, only: tuple[str, ...] | None = None) -> dict:
    """Predicted seconds {"forward", "backward", "total"} of every row of `ROWS` (ours and fla's: only
    those labelled in `only`, if given) by label, under "times"; "x_roof": each total over its group's
    roofline; "tables": the `predict` tables by label and part; "fla_configs": fla's modelled
    autotune choices by label. fla's kernels come from `perf_fla.fla_kernels(fla_root)`."""
    gpu = GPUS[gpu] if isinstance(gpu, str) else gpu
    kernels, candidates = perf_fla.fla_kernels(fla_root), perf_fla.fla_candidates(D)
    times, tables, configs, x_roof, above = {}, {}, {}, {}, []
    for row in ROWS:
        if row.who == "roofline":
            times[row.label] = roofline(B, H, T, D, dtype.itemsize, gpu, normalize=row.normalize, decay=row.decay)
            x_roof.update({label: times[label]["total"] / times[row.label]["total"] for label in above + [row.label]})
            above = []
            continue
        if only is not None and row.label not in only:
            continue
        if row.who == "ours":
            calls = census(B, H, T, D, dtype, normalize=row.normalize, decay=row.decay, target=gpu.target, sms=gpu.sms)
            launches = {part: [launch_of(c, gpu, stats) for c in cs] for part, cs in calls.items()}
        else:
            make = lambda cfg, row=row: replay_calls(B, H, T, D, (row.normalize, row.decay), cfg, kernels, dtype)
            launches, configs[row.label] = tuned_launches(make, candidates, gpu, stats)
        tables[row.label] = {part: predict(ls, gpu) for part, ls in launches.items()}
        times[row.label] = _totals(tables[row.label])
        above.append(row.label)
    return {"gpu": gpu.name, "shape": (B, H, T, D), "times": times, "x_roof": x_roof, "tables": tables,
            "fla_configs": configs}


def assumptions(gpu: GPU, fla_root: str | None = None) -> list[str]:
    """What the predictions assume, one sentence each, with the numbers of `gpu`."""
    import triton

    return [
        f"{gpu.name}: {gpu.sms} SMs, HBM {gpu.bandwidth / 1e12:.2f} TB/s, clock {gpu.clock / 1e9:.3f} GHz, "
        f"{gpu.issue_per_sm} warp instructions/SM/cycle, tensor peak {gpu.tensor_flops / 1e12:.0f} TFLOP/s.",
        f"A launch: max(HBM bytes / bandwidth, chain, MMA FLOPs / peak) + {gpu.launch_overhead * 1e6:.0f} us, "
        f"one after another; chain: waves x instructions of a warp x max({gpu.cpi:g} cycles, warps per scheduler).",
        f"Instructions: SASS (Triton {triton.__version__}, {gpu.target}, specialised as the JIT would), the "
        "loop being the longest backward branch; CTAs/SM from its registers and shared memory.",
        "HBM bytes: each tensor a kernel touches once, re-reads by programs running together hit L2, "
        "others do not; nothing stays in L2 between launches; an eager torch op reads and writes once.",
        "Ours: the real launchers (causal_forward, causal_backward) recorded on meta tensors, with the configs "
        "select_config gives an sm_90 and split-T as on its SMs; gradients of q, k, v (and a per-token log-decay).",
        *perf_fla.assumptions(fla_root),
        "Roofline: the fused op's tensors once each: q, k, v, o (+ g) forward; q, k, v, dO (+ o when "
        "normalised, + g) read and dq, dk, dv (+ dg) written backward.",
        "Not modelled: L2 bandwidth, DRAM below peak, latency the pipeline does not hide, spills' traffic, "
        "clocks under power limits; a partial last wave costs a full one. cpi and the overhead are assumed.",
    ]


def _detail(rows: list[dict]) -> list[str]:
    """Per-kernel lines of a `predict` table, the eager torch ops summed into one."""
    ops = [r for r in rows if not r["programs"]]
    if ops:
        summed = {"bytes_hbm": sum(r["bytes_hbm"] for r in ops), "time": total_time(ops), "bound": "hbm"}
        rows = [r for r in rows if r["programs"]] + [{"kernel": f"torch ops x{len(ops)}", "grid": (), **summed}]
    return [f"    {r['kernel'].replace('_kernel', '').removeprefix('chunk_')[:20]:20} "
            f"{'x'.join(map(str, r['grid'])):>10} {r.get('ctas_per_sm', ''):>3} {r.get('steps', ''):>4} "
            f"{r.get('instr_per_step', ''):>5} {r.get('instr_per_warp', ''):>6} {r['bytes_hbm'] / 2**20:>7.0f} "
            f"{r['bound']:>5} {r['time'] * 1e6:>8.1f}" for r in rows]


def _config(cfg: dict) -> str:
    meta = " ".join(f"{k}={v}" for k, v in cfg.items() if k not in ("num_warps", "num_stages"))
    return f"{meta} warps={cfg['num_warps']} stages={cfg['num_stages']}".strip()


def report(B: int, T: int, H: int, D: int, gpu: GPU | str = "H100 SXM", *, detail: bool = False,
           fla_root: str | None = None) -> list[str]:
    """`compare` in 80 columns (ms; each total over its roofline's); with detail every launch: grid,
    CTAs/SM, steps, instructions of a warp in the loop body and in all, HBM MiB, bound, us; fla's configs."""
    r = compare(B, T, H, D, gpu, fla_root=fla_root)
    lines = [f"  {f'B={B} H={H} T={T} D={D}':40}{'fwd ms':>9}{'bwd ms':>9}{'total ms':>9}{'x roof':>7}"]
    lines += [f"  {label:40}" + "".join(f"{t[p] * 1e3:>9.3f}" for p in PARTS) + f"{r['x_roof'][label]:>7.2f}"
              for label, t in r["times"].items()]
    if detail:
        lines.append(f"    {'kernel':20} {'grid':>10} {'cta':>3} {'step':>4} {'body':>5} {'warp':>6} {'MiB':>7} "
                     f"{'bound':>5} {'us':>8}")
        lines += [x for label, tables in r["tables"].items() for part, rows in tables.items()
                  for x in [f"   {label}, {part}"] + _detail(rows)]
        for label, configs in r["fla_configs"].items():
            lines += [f"   {label}: configs"] + [f"     {k.replace('_kernel', '').removeprefix('chunk_')}: {_config(v)}"
                                                 for k, v in configs.items()]
    return lines


def main(argv: list[str] | None = None) -> None:
    """`python -m linattn_lib.chapters.perf_model [--detail]`: B in {1, 4}, H 16, T 16384, D 128,
    on each GPU of `GPUS`; fla's source from $LINATTN_FLA_SOURCE (`perf_fla.fla_source`)."""
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--detail", action="store_true", help="also print every launch's parts")
    detail = parser.parse_args(sys.argv[1:] if argv is None else argv).detail
    for i, gpu in enumerate(GPUS.values()):
        print(f"{gpu.name}, predicted by the model (bf16){', assuming:' if i == 0 else ''}")
        for line in assumptions(gpu)[: None if i == 0 else 1]:
            print(textwrap.fill(line, 80, initial_indent="  - ", subsequent_indent="    "))
        for B in (1, 4):
            print("\n".join(report(B, 16384, 16, 128, gpu, detail=detail)))
        print()


if __name__ == "__main__":
    main()
