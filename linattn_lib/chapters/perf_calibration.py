"""The performance model (perf_model.py) held to published GPU times, and calibrated on them.

No GPU has run this project's kernels. The only GPU measurements it has are published ones:
pytorch/helion's H100 table (book/results/published_h100.json, transcribed with its repository,
path and commit) times fla's chunk_linear_attn(normalize=False) and chunk_retention, and
Helion's kernels of the same ops, forward and forward+backward at fla's six registry shapes.

1. `components` replays an op at a shape through the model (fla's launchers by
   `perf_fla.Replay`, ours by `perf_model.census`) and keeps, per launch, what the model's
   time is made of: HBM seconds at the datasheet bandwidth, the instruction chain's seconds,
   the chain's sequential steps (waves x loop trips) and tensor-core seconds; with the op's
   host syncs. fla's autotuned configs are the raw model's fastest (`perf_model.tuned_launches`);
   ours run through the op (`triton_ops`), with no host sync. Stored in
   book/results/perf_calibration.json, so everything below reruns from the file without compiling.
2. `call_time` is the model with four physical constants (`Constants`), the things the raw
   model leaves out:

       launch  t = max(HBM s / eta, chain s + latency x steps, MMA s) + 3 us   (GPU side)
       GPU     G = sum of its launches
       host    h = host_fwd (+ host_bwd for forward+backward): Python, autograd, launches
       call    T = max(G, h)             the host runs ahead of the GPU, or the GPU waits
               T = host_fwd + max(G, h - host_fwd)   an op whose Python waits for the GPU
                                          (a blocking copy) before its first launch

   eta is achieved / datasheet HBM bandwidth, `latency` the time a program's sequential step
   exposes (a load's round trip that the pipeline does not hide), host_fwd and host_bwd the
   host's floor per forward call and per backward call.
3. `fit` minimises the squared log ratios predicted / published inside `BOUNDS` (a grid, then
   Nelder-Mead mapped onto the box; deterministic); `leave_one_out` fits on five shapes and predicts
   the sixth, for every shape: the model's error where it has not seen the shape.
4. `restate` puts ours (calibrated) beside fla's and Helion's published times, with the band
   the leave-one-out errors give; `refit_measured` refits on measured rows (a GPU check's).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields

import numpy as np

from . import perf_fla
from . import perf_model as pm

GPU = "H100 SXM"
# published op -> the label `perf_fla.Replay` knows fla's by (its `REPLAYED`), and our op of the same decay
OPS = {"linear_attn": "fla chunk_linear_attn(normalize=False)",
       "retention": "fla chunk_retention (per-head decay g_gamma)"}
OURS = {"linear_attn": "ours, unnormalised, no decay", "retention": "ours, unnormalised, per-head decay"}
# our ops the calibration predicts: label -> (normalize, decay) of `perf_model.census`
OURS_OPS = {"ours, normalised, no decay": (True, None), "ours, unnormalised, no decay": (False, None),
            "ours, unnormalised, per-head decay": (False, "head"), "ours, unnormalised, per-token decay": (False, "token")}
# head to head at the benchmark shapes (H = 16, T = 16384, D = 128, B in HEAD_TO_HEAD_B): ours, fla's
HEAD_TO_HEAD = (("ours, normalised, no decay", "fla chunk_linear_attn(normalize=True)"),
                ("ours, unnormalised, no decay", "fla chunk_linear_attn(normalize=False)"),
                ("ours, unnormalised, per-token decay", "fla chunk_simple_gla (per-token decay g)"))
HEAD_TO_HEAD_B = (1, 2, 4)
TIMED = ("fwd", "fwd+bwd")
# fla's registry shapes that the GPU is not host-bound on (the leave-one-out goal is set on these)
LARGE = ("B1_T8192_H96_D128", "B2_T16384_H16_D128", "B4_T4096_H64_D128", "B8_T2048_H32_D256")


@dataclass(frozen=True)
class Constants:
    """What the raw model leaves out (module docstring, 2); seconds, except eta."""

    eta: float = 1.0            # achieved / datasheet HBM bandwidth
    latency: float = 0.0        # exposed per sequential step of a program (per wave)
    host_fwd: float = 0.0       # host floor of a forward call
    host_bwd: float = 0.0       # host floor added by its backward call

    def readable(self) -> dict[str, float]:
        """eta as is, the times in microseconds (rounded for printing)."""
        return {"eta": round(self.eta, 3), "latency_us": round(self.latency * 1e6, 3),
                "host_fwd_us": round(self.host_fwd * 1e6, 1), "host_bwd_us": round(self.host_bwd * 1e6, 1)}


# physical bounds: the fit stays inside them. eta: a device-to-device copy reaches ~0.9 of the
# datasheet (4.3 of 4.8 TB/s seen on an H200); 0.6 allows kernels that stream worse. latency:
# up to ~2 us (a few HBM round trips of ~0.6-1 us) per step. host: up to 1 ms per forward call,
# 2 ms per backward call (autograd's engine; the published small shapes sit near 0.15 and 0.8 ms)
BOUNDS = {"eta": (0.6, 1.0), "latency": (0.0, 2e-6), "host_fwd": (0.0, 1e-3), "host_bwd": (0.0, 2e-3)}
NAMES = tuple(f.name for f in fields(Constants))


# --- the model's components at a shape ------------------------------------------------------------

def _launch_parts(rows: list[dict]) -> list[list[float]]:
    """[HBM s, chain s, chain steps, MMA s] of each row of a `perf_model.predict` table (5 digits)."""
    r5 = lambda x: float(f"{x:.5g}")
    return [[r5(r["t_hbm"]), r5(r["t_chain"]), r["waves"] * max(r["steps"], 1) if r["programs"] else 0, r5(r["t_mma"])]
            for r in rows]


def components(label: str, B: int, T: int, H: int, D: int, gpu: pm.GPU | str = GPU, *,
               stats: pm.Stats | None = None, fla_root: str | None = None) -> dict:
    """{"forward": [...], "backward": [...]} per launch `_launch_parts`, "syncs" (host waits for the
    GPU in the op's Python) and "configs" (fla's modelled autotune choices) of the op `label` at
    (B, T, H, D), bf16: fla's (a `perf_fla.REPLAYED` label) or ours (an `OURS_OPS` label)."""
    gpu = pm.GPUS[gpu] if isinstance(gpu, str) else gpu
    if label in perf_fla.REPLAYED:
        variant = perf_fla.REPLAYED[label]
        kernels = perf_fla.fla_kernels(fla_root)
        make = lambda cfg: pm.replay_calls(B, H, T, D, variant, cfg, kernels)
        launches, configs = pm.tuned_launches(make, perf_fla.fla_candidates(D), gpu, stats)
        syncs = perf_fla.syncs_of(variant)
    elif label in OURS_OPS:
        normalize, decay = OURS_OPS[label]
        calls = pm.census(B, H, T, D, normalize=normalize, decay=decay, target=gpu.target, sms=gpu.sms)
        launches, configs, syncs = {p: [pm.launch_of(c, gpu, stats) for c in cs] for p, cs in calls.items()}, {}, 0
    else:
        raise ValueError(f"components: no op {label!r} (fla's: {sorted(perf_fla.REPLAYED)}; ours: {sorted(OURS_OPS)})")
    return {**{part: _launch_parts(pm.predict(ls, gpu)) for part, ls in launches.items()},
            "syncs": syncs, "configs": configs}


# --- the calibrated model ---------------------------------------------------------------------------

def gpu_time(launches: list[list[float]], c: Constants, overhead: float = pm.GPUS[GPU].launch_overhead) -> float:
    """Seconds of a list of `_launch_parts` under the constants `c`, one launch after another."""
    if not launches:
        return 0.0
    a = np.asarray(launches, dtype=float)
    t = np.maximum(np.maximum(a[:, 0] / c.eta, a[:, 1] + c.latency * a[:, 2]), a[:, 3])
    return float(t.sum() + overhead * len(a))


def call_time(comp: dict, timed: str, c: Constants) -> float:
    """Seconds of one timed call ("fwd" or "fwd+bwd", `TIMED`) of an op with components `comp`."""
    if timed not in TIMED:
        raise ValueError(f"call_time: timed must be one of {TIMED}, not {timed!r}")
    launches = comp["forward"] + (comp["backward"] if timed == "fwd+bwd" else [])
    G = gpu_time(launches, c)
    host = c.host_fwd + (c.host_bwd if timed == "fwd+bwd" else 0.0)
    if comp.get("syncs"):  # the GPU drains, then waits for the rest of the forward's Python
        return c.host_fwd + max(G, host - c.host_fwd)
    return max(G, host)


def raw_time(comp: dict, timed: str) -> float:
    """The uncalibrated model's seconds (datasheet bandwidth, no latency, no host floor)."""
    return call_time(comp, timed, Constants())


# --- fitting ------------------------------------------------------------------------------------

Row = dict  # {"op", "shape", "timed", "ms"}: one measured time; comps[(op, shape)] its components


def predicted_ms(comps: dict, row: Row, c: Constants) -> float:
    """The calibrated prediction (ms) of a row."""
    return call_time(comps[row["op"], row["shape"]], row["timed"], c) * 1e3


def published_rows(published: dict, who: str = "fla") -> list[Row]:
    """The rows of published_h100.json (or of its "second_run") timed for `who` ("fla" or "helion"),
    one per op, shape and timed; op is the `Replay` label of fla's op (`OPS`)."""
    return [{"op": OPS[r["op"]], "shape": r["shape"], "timed": t, "ms": r[who][t]}
            for r in published["rows"] for t in TIMED]


def _constants(x: Iterable[float]) -> Constants:
    """Constants from a point of the unit box (clipped into it)."""
    return Constants(**{n: BOUNDS[n][0] + min(max(float(u), 0.0), 1.0) * (BOUNDS[n][1] - BOUNDS[n][0])
                        for n, u in zip(NAMES, x)})


def log_errors(rows: list[Row], comps: dict, c: Constants) -> np.ndarray:
    """log(predicted / measured) of each row under `c`."""
    return np.array([math.log(predicted_ms(comps, r, c) / r["ms"]) for r in rows])


def _nelder_mead(f: Callable[[np.ndarray], float], x0: np.ndarray, step: float = 0.1, iters: int = 400) -> np.ndarray:
    """Minimise f from x0 (deterministic Nelder-Mead; f clips its argument into the box)."""
    simplex = [x0] + [x0 + step * e for e in np.eye(len(x0))]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < 1e-12:
            break
        centre = np.mean(simplex[:-1], axis=0)
        xr = centre + (centre - simplex[-1])
        fr = f(xr)
        if fr < values[0]:
            xe = centre + 2 * (centre - simplex[-1])
            fe = f(xe)
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
        else:
            xc = centre + 0.5 * (simplex[-1] - centre)
            fc = f(xc)
            if fc < values[-1]:
                simplex[-1], values[-1] = xc, fc
            else:  # shrink towards the best
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex[1:]]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[int(np.argmin(values))]


def fit(rows: list[Row], comps: dict, grid: int = 5, starts: int = 5) -> Constants:
    """The `Constants` inside `BOUNDS` that minimise the sum of squared log(predicted / measured)
    over `rows`: from the `starts` best points of a grid of `grid` per constant, Nelder-Mead
    restarted until it stops improving, in coordinates y with x = (1 + sin y) / 2 mapping onto
    the box (no flat clipped region to stall on)."""
    if not rows:
        raise ValueError("fit: no rows")
    loss = lambda x: float(np.sum(log_errors(rows, comps, _constants(x)) ** 2))
    on_box = lambda y: 0.5 + 0.5 * np.sin(y)
    axes = np.linspace(0.0, 1.0, grid)
    points = np.array(np.meshgrid(*[axes] * len(NAMES))).reshape(len(NAMES), -1).T
    found = []
    for _, p in sorted((loss(p), tuple(p)) for p in points)[:starts]:
        y, last = np.arcsin(2 * np.array(p) - 1), math.inf
        for _ in range(6):
            y = _nelder_mead(lambda z: loss(on_box(z)), y, step=0.4)
            if last - (value := loss(on_box(y))) < 1e-10:
                break
            last = value
        found.append((loss(on_box(y)), tuple(y)))
    return _constants(on_box(np.array(min(found)[1])))


def leave_one_out(rows: list[Row], fit_fn: Callable[[list[Row]], object],
                  predict: Callable[[object, Row], float]) -> dict[str, list[float]]:
    """For every shape: fit on the rows of the other shapes, predict this shape's rows. Returns
    {shape: [predicted / measured - 1 of each of its rows, in order]}."""
    out = {}
    for shape in dict.fromkeys(r["shape"] for r in rows):
        fitted = fit_fn([r for r in rows if r["shape"] != shape])
        out[shape] = [predict(fitted, r) / r["ms"] - 1 for r in rows if r["shape"] == shape]
    return out


# --- the calibration, its table and ours restated -----------------------------------------------

def shape_name(B: int, T: int, H: int, D: int) -> str:
    """fla's registry name of a shape: B2_T16384_H16_D128."""
    return f"B{B}_T{T}_H{H}_D{D}"


def parse_shape(shape: str | Iterable[int] | dict) -> tuple[int, int, int, int]:
    """(B, T, H, D) of a registry name, a {"B", "T", "H", "D"} dict or a (B, T, H, D) sequence."""
    if isinstance(shape, str):
        parts = shape.split("_")
        if len(parts) != 4 or [p[0] for p in parts] != list("BTHD") or not all(p[1:].isdigit() for p in parts):
            raise ValueError(f"parse_shape: {shape!r} is not a name like 'B2_T16384_H16_D128'")
        return tuple(int(p[1:]) for p in parts)
    if isinstance(shape, dict):
        return tuple(int(shape[k]) for k in "BTHD")
    B, T, H, D = (int(x) for x in shape)
    return B, T, H, D


def band(errors: dict[str, list[float]], rows: list[Row], timed: str, shapes: Iterable[str] = LARGE) -> tuple:
    """(lowest, highest) leave-one-out error (predicted / measured - 1) of the rows timed `timed` at `shapes`."""
    shapes = set(shapes)
    per_shape = {s: iter(e) for s, e in errors.items()}
    picked = [(r, next(per_shape[r["shape"]])) for r in rows]
    errs = [e for r, e in picked if r["timed"] == timed and r["shape"] in shapes]
    return min(errs), max(errs)


def calibrate(published: dict, comps: dict) -> dict:
    """Fit `Constants` on fla's published rows (`published_rows`) with the model's components
    `comps` ({(label, shape): `components`}), and the leave-one-shape-out errors. Returns
    {"constants", "loo": {shape: [error of each row]}, "bands": {timed: {"large", "all"}},
    "table": one dict per row (op, shape, timed, published, raw, calibrated, loo ms)}."""
    rows = published_rows(published)
    c = fit(rows, comps)
    loo = leave_one_out(rows, lambda rs: fit(rs, comps), lambda cc, r: predicted_ms(comps, r, cc))
    bands = {t: {"large": band(loo, rows, t), "all": band(loo, rows, t, published["shapes"])} for t in TIMED}
    per_shape = {s: iter(e) for s, e in loo.items()}
    table = [{"op": r["op"], "shape": r["shape"], "timed": r["timed"], "published_ms": r["ms"],
              "raw_ms": round(raw_time(comps[r["op"], r["shape"]], r["timed"]) * 1e3, 4),
              "calibrated_ms": round(predicted_ms(comps, r, c), 4), "loo_error": round(next(per_shape[r["shape"]]), 4)}
             for r in rows]
    return {"constants": asdict(c), "loo": loo, "bands": bands, "table": table}


def host_bound(comp: dict, timed: str, c: Constants) -> bool:
    """Whether the calibrated GPU time of the call is under its host floor (the GPU waits)."""
    launches = comp["forward"] + (comp["backward"] if timed == "fwd+bwd" else [])
    return gpu_time(launches, c) < c.host_fwd + (c.host_bwd if timed == "fwd+bwd" else 0.0)


def measured_interval(predicted: float, bands: dict, timed: str, bound_by_host: bool) -> tuple[float, float]:
    """Where a measurement would fall, by the leave-one-out errors: predicted / (1 + error) over the
    band of `timed`: the four large shapes' where the GPU is busy, all six shapes' where it waits
    for the host (`host_bound`)."""
    lo, hi = bands[timed]["all" if bound_by_host else "large"]
    return predicted / (1 + hi), predicted / (1 + lo)


def restate(published: dict, comps: dict, cal: dict) -> list[dict]:
    """Ours (calibrated, `OURS`) beside fla's and Helion's published times at every shape and timed:
    one dict per row with ours' ms, the interval `measured_interval` gives and both ratios."""
    c = Constants(**cal["constants"])
    out = []
    for r in published["rows"]:
        ours = OURS[r["op"]]
        for t in TIMED:
            comp = comps[ours, r["shape"]]
            p = call_time(comp, t, c) * 1e3
            lo, hi = measured_interval(p, cal["bands"], t, host_bound(comp, t, c))
            out.append({"op": r["op"], "ours": ours, "shape": r["shape"], "timed": t, "ours_ms": round(p, 4),
                        "ours_interval_ms": [round(lo, 4), round(hi, 4)], "fla_ms": r["fla"][t],
                        "helion_ms": r["helion"][t]})
    return out


def head_to_head(comps: dict, cal: dict, Bs: Iterable[int] = HEAD_TO_HEAD_B, T: int = 16384, H: int = 16,
                 D: int = 128) -> list[dict]:
    """The `HEAD_TO_HEAD` pairs at (B, T, H, D) for B in `Bs`, calibrated, each with the interval of
    `measured_interval` and ours / fla (the same model on both sides)."""
    c, out = Constants(**cal["constants"]), []

    def predicted(label: str, shape: str, t: str) -> tuple[float, list[float]]:
        comp = comps[label, shape]
        ms = call_time(comp, t, c) * 1e3
        return ms, [round(y, 4) for y in measured_interval(ms, cal["bands"], t, host_bound(comp, t, c))]

    for shape in (shape_name(B, T, H, D) for B in Bs):
        for ours, fla in HEAD_TO_HEAD:
            for t in TIMED:
                (p, p_span), (q, q_span) = predicted(ours, shape, t), predicted(fla, shape, t)
                out.append({"shape": shape, "timed": t, "ours": ours, "fla": fla, "ours_ms": round(p, 4),
                            "fla_ms": round(q, 4), "ratio": round(p / q, 4), "ours_interval_ms": p_span,
                            "fla_interval_ms": q_span})
    return out


# the GPU check's variants (experiments/gpu_bench.py) -> our op's label, and fla's op where the
# calibration replays it
GPU_CHECK_OURS = {"unnormalised": "ours, unnormalised, no decay", "per-head decay": "ours, unnormalised, per-head decay",
                  "per-token decay": "ours, unnormalised, per-token decay", "normalised": "ours, normalised, no decay"}
GPU_CHECK_FLA = {"unnormalised": OPS["linear_attn"], "per-head decay": OPS["retention"]}


def rows_from_gpu_check(data: dict) -> list[dict]:
    """The measured rows of a GPU check's results (gpu_check.json) that the model predicts, in
    `refit_measured`'s form: ours through the op, and fla's two replayed ops, forward and
    forward+backward, at every shape timed (rows with an error are left out)."""
    out = []
    for r in data.get("sections", {}).get("benchmark", {}).get("rows", []):
        label = (GPU_CHECK_OURS if r.get("provider") == "ours: op" else
                 GPU_CHECK_FLA if r.get("provider") == "fla" else {}).get(r.get("variant"))
        for key, timed in (("forward_ms", "fwd"), ("forward_backward_ms", "fwd+bwd")):
            if label and isinstance(r.get(key), (int, float)):
                out.append({"op": label, "shape": (r["B"], r["T"], r["H"], r["D"]), "timed": timed,
                            "measured_ms": r[key]})
    return out


def gpu_of(data: dict) -> str:
    """The model's name (`perf_model.GPUS`) of the GPU a GPU check's results (gpu_check.json) ran
    on: the H200 by name, else the H100 the calibration is made for."""
    name = data.get("sections", {}).get("environment", {}).get("gpu", "")
    return "H200 SXM" if "H200" in name else GPU


def on_gpu(comps: dict, gpu: str) -> dict:
    """Components made for `GPU` (the H100) carried to `gpu`, a GPU of the same SMs and clocks
    (the H200 is the same GH100 part with faster HBM): each launch's HBM seconds scaled by the
    bandwidths' ratio; chains, steps and tensor-core seconds as they are."""
    f = pm.GPUS[GPU].bandwidth / pm.GPUS[gpu].bandwidth
    scale = lambda launches: [[part[0] * f, *part[1:]] for part in launches]
    return {key: {**c, "forward": scale(c["forward"]), "backward": scale(c["backward"])}
            for key, c in comps.items()}


def refit_measured(rows: list[dict], comps: dict | None = None,
                   compute: Callable[..., dict] = components,
                   fit_fn: Callable[[list[Row], dict], Constants] | None = None) -> tuple[Constants, list[float]]:
    """Refit the constants on measured rows, e.g. a GPU check's: each {"op" (or "kernel"): an fla
    `perf_fla.REPLAYED` label, an `OURS` label, or a published op name ("linear_attn"), "shape": a
    registry name, (B, T, H, D) or a dict, "timed" (or "part"): "fwd"/"forward" or
    "fwd+bwd"/"forward_backward", "measured_ms"}. Components missing from `comps` are computed by
    `compute(label, B, T, H, D)` (which compiles: fla's kernels from $LINATTN_FLA_SOURCE). Returns the constants and each row's
    predicted / measured - 1 under them. fit_fn(rows, comps): the constants (default `fit`; e.g.
    a function returning fixed ones, to hold them to the rows). Computed components are added to
    `comps` when it is given."""
    alias = {"forward": "fwd", "fwd": "fwd", "fwd+bwd": "fwd+bwd", "forward_backward": "fwd+bwd"}
    comps, fitted = (comps if comps is not None else {}), []
    for m in rows:
        op = m.get("op", m.get("kernel"))
        label = OPS.get(op, op)
        shape = shape_name(*parse_shape(m["shape"]))
        if (label, shape) not in comps:
            comps[label, shape] = compute(label, *parse_shape(shape))
        fitted.append({"op": label, "shape": shape, "timed": alias[m.get("timed", m.get("part"))],
                       "ms": float(m["measured_ms"])})
    c = (fit_fn or fit)(fitted, comps)
    return c, [predicted_ms(comps, r, c) / r["ms"] - 1 for r in fitted]


# --- printing (80 columns) ----------------------------------------------------------------------

def _pct(x: float) -> str:
    return f"{x * 100:+.0f}%"


def table_lines(cal: dict) -> list[str]:
    """The calibration table: per published row its time, the raw model's, published / raw, the
    calibrated model's and the leave-one-out error (predicted / published - 1, shape unseen)."""
    lines = [f"  {'':19}{'':8}{'published':>10}{'raw':>7}{'ratio':>6}{'calibr.':>8}{'left out':>9}"]
    for op in dict.fromkeys(r["op"] for r in cal["table"]):
        lines.append(f"  {op}")
        lines += [f"  {r['shape']:19}{r['timed']:8}{r['published_ms']:>10.3f}{r['raw_ms']:>7.3f}"
                  f"{r['published_ms'] / r['raw_ms']:>6.2f}{r['calibrated_ms']:>8.3f}{_pct(r['loo_error']):>9}"
                  for r in cal["table"] if r["op"] == op]
    c = Constants(**cal["constants"]).readable()
    lines.append(f"  constants: eta {c['eta']:.2f} (HBM {c['eta'] * 3.35:.2f} of 3.35 TB/s), latency "
                 f"{c['latency_us']:.2f} us a step,")
    lines.append(f"  host floor {c['host_fwd_us']:.0f} us a forward call, {c['host_bwd_us']:.0f} us a backward call")
    for t in TIMED:
        (a, b), (x, y) = cal["bands"][t]["large"], cal["bands"][t]["all"]
        lines.append(f"  left out, {t:7}: {_pct(a)} to {_pct(b)} (four large shapes), {_pct(x)} to {_pct(y)} (all six)")
    return lines


def verdict(interval: list[float] | tuple[float, float], other_ms: float) -> str:
    """"<" when ours is faster than `other_ms` even at the slow end of its interval, ">" when slower
    even at the fast end, "~" when `other_ms` lies inside the interval (the model cannot tell)."""
    lo, hi = interval
    return "<" if hi < other_ms else ">" if lo > other_ms else "~"


def restate_lines(restated: list[dict], shapes: Iterable[str] = LARGE) -> list[str]:
    """Ours, calibrated, with the interval of `measured_interval`, beside fla's and Helion's
    published times (ms) at `shapes`, each marked by `verdict`."""
    shapes = set(shapes)
    span = lambda r: "[{:.2f}, {:.2f}]".format(*r["ours_interval_ms"])
    lines = [f"  {'':19}{'':8}{'ours':>7}{'interval':>15}{'fla':>9}{'Helion':>9}"]
    for ours in dict.fromkeys(r["ours"] for r in restated):
        mine = [r for r in restated if r["ours"] == ours]
        lines.append(f"  {ours.removeprefix('ours, ')} (published: {mine[0]['op']})")
        lines += [f"  {r['shape']:19}{r['timed']:8}{r['ours_ms']:>7.3f}{span(r):>15}"
                  + "".join(f"{r[k]:>8.3f}{verdict(r['ours_interval_ms'], r[k])}" for k in ("fla_ms", "helion_ms"))
                  for r in mine if r["shape"] in shapes]
    return lines
