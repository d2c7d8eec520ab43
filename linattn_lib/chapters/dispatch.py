"""Choose softmax or linear attention by sequence length (chapter 7).

Linear attention wins on cost only past some length T*: below it, exact attention's fused
kernels and small constant factors beat the linear algorithm's bookkeeping (features, the
normaliser, the chunk loop). This module states the dispatch rule explicitly, from T* measured
on a device:

    use exact (softmax) attention while T < T*(device, d), linear attention from T* on, where
    T*(device, d) is the crossover measured on that device for head dimension d, interpolated
    linearly in log d between measured head dimensions (and held constant beyond them).

The FLOP counts alone (4 T^2 d against 4 T d m, m = d for elu+1) put the crossover near T = d;
measured crossovers are far later, because fixed per-call costs dominate short sequences, and
they grow more slowly than d. The committed measurements live in `MEASURED_CROSSOVER`; a device
without one uses `FALLBACK_CROSSOVER`, a stated guess, until you calibrate it (pass your own
table or `crossover=`).

Caution: softmax and linear attention compute *different functions*. Switching between them
by length is only sound for a model trained to run both (a hybrid over lengths). Within one
mechanism the switch is exact: linear attention's quadratic and chunked forms agree, and
`choose_form` picks between those.

Measuring T* is an experiment, not part of this module:
`python -m linattn_lib.experiments.crossover --out book/results/crossover_cpu.json` measures the
crossover on this device and records it with its hardware (`experiments.crossover.measure_crossover`
does it from Python); this module only reads such measurements (`Crossover`,
`crossover_from_times`, `crossover_table`).
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import _validate as V
from ..core.features import elu_plus_one
from ..core.linear import linear_attention

# Crossover lengths T* by head dimension d, measured with `python -m linattn_lib.experiments.crossover`
# (causal, B = 1, H = 4, fp32, forward, one CPU thread) and recorded in
# book/results/crossover_cpu.json. Keys are torch device types.
MEASURED_CROSSOVER: dict[str, dict[int, int]] = {"cpu": {32: 363, 64: 393, 128: 477}}
# No GPU measurement is committed yet: a stated guess (fused GPU softmax kernels are strong
# and short linear-attention calls are dominated by launch overheads). Calibrate before use.
FALLBACK_CROSSOVER: int = 2048


def _device_type(device: torch.device | str | None) -> str:
    return torch.device(device).type if device is not None else "cpu"


def crossover_length(d: int, device: torch.device | str = "cpu", *, table: dict[int, float] | None = None) -> int:
    """T*(device, d), rounded to an int: the first length at which the dispatcher uses linear attention.

    table: {head dimension: measured T*}; default MEASURED_CROSSOVER[device type], or the
    constant FALLBACK_CROSSOVER for a device without a committed measurement. Between measured
    head dimensions T* is interpolated linearly in log d; outside them the nearest one is used.
    (A measured wall-time crossover; the length where the attention core's FLOPs equal the
    FFN's is `flops.flop_crossover_length`.)
    """
    V.check_positive_int("crossover_length", "d", d)
    table = table if table is not None else MEASURED_CROSSOVER.get(_device_type(device))
    if not table:
        return FALLBACK_CROSSOVER
    if any(not (t > 0) for t in table.values()):
        raise ValueError(f"crossover_length: every T* in `table` must be positive, got {table!r}")
    ds = sorted(table)
    if d <= ds[0]:
        return round(table[ds[0]])
    if d >= ds[-1]:
        return round(table[ds[-1]])
    hi = next(i for i, x in enumerate(ds) if x >= d)
    d0, d1 = ds[hi - 1], ds[hi]
    w = (math.log(d) - math.log(d0)) / (math.log(d1) - math.log(d0))
    return round(table[d0] + w * (table[d1] - table[d0]))


def crossover_table(crossovers: Sequence[Crossover]) -> dict[int, float]:
    """{d: T*} from measurements (those where linear attention won within the measured lengths)."""
    return {c.d: c.t_star for c in crossovers if c.t_star is not None}


def choose_attention(T: int, d: int, device: torch.device | str = "cpu", *, crossover: int | None = None) -> str:
    """"softmax" if T < T*, else "linear" (T* = `crossover`, or `crossover_length(d, device)`)."""
    V.check_positive_int("choose_attention", "T", T)
    t_star = crossover if crossover is not None else crossover_length(d, device)
    return "softmax" if T < t_star else "linear"


def auto_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = True,
    feature_map: Callable[[Tensor], Tensor] = elu_plus_one,
    crossover: int | None = None,
    return_choice: bool = False,
) -> Tensor | tuple[Tensor, str]:
    """Softmax attention (PyTorch's fused SDPA) below T*, linear attention with `feature_map` above.

    q, k, v: (B, H, T, d). Returns the output [, the choice]. The two branches are different
    functions of (q, k, v); see the module docstring.
    """
    V.check_qkv("auto_attention", q, k, v)
    choice = choose_attention(q.shape[2], q.shape[-1], q.device, crossover=crossover)
    if choice == "softmax":
        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    else:
        o = linear_attention(feature_map(q), feature_map(k), v, causal=causal)
    return (o, choice) if return_choice else o


def choose_form(T: int, m: int, dv: int, *, chunk_size: int = 64) -> str:
    """For linear attention itself (an exact switch): "quadratic" when the whole sequence fits in
    one chunk (T <= chunk_size), where materialising the masked T x T matrix is one matmul,
    "chunked" otherwise. m and dv are checked but do not move the rule at these sizes."""
    for name, val in (("T", T), ("m", m), ("dv", dv), ("chunk_size", chunk_size)):
        V.check_positive_int("choose_form", name, val)
    return "quadratic" if T <= chunk_size else "chunked"


# --------------------------------------------------------------------------------------
# reading a measured crossover (`linattn_lib.experiments.crossover` measures it)
# --------------------------------------------------------------------------------------


@dataclass
class Crossover:
    """Forward times of both mechanisms over `lengths`, and the interpolated crossover T*."""

    device: str
    d: int
    heads: int
    batch: int
    causal: bool
    lengths: list = field(default_factory=list)
    softmax_s: list = field(default_factory=list)
    linear_s: list = field(default_factory=list)
    t_star: float | None = None
    threads: int | None = None

    @property
    def ratio(self) -> float | None:
        """T*/d (the FLOP count alone would put it near 1)."""
        return None if self.t_star is None else self.t_star / self.d

    def to_dict(self) -> dict:
        return dict(asdict(self), ratio=self.ratio)


def crossover_from_times(lengths: Sequence[int], softmax_s: Sequence[float], linear_s: Sequence[float]) -> float | None:
    """The length where linear attention becomes faster, interpolated in log-log coordinates.

    Uses the *last* change from "softmax faster" to "linear faster" (timing noise can flip a
    single point early on), interpolating log(t_lin / t_soft) linearly in log T between the two
    lengths around it. Returns lengths[0] if linear is faster everywhere from the start, None if
    softmax is faster at the longest length.
    """
    if not (len(lengths) == len(softmax_s) == len(linear_s) >= 1):
        raise ValueError("crossover_from_times: lengths, softmax_s and linear_s must have the same, non-zero length")
    g = [math.log(l / s) for s, l in zip(softmax_s, linear_s)]  # < 0: linear faster
    if g[-1] >= 0:
        return None
    i = len(g) - 1
    while i > 0 and g[i - 1] < 0:
        i -= 1
    if i == 0:
        return float(lengths[0])
    x0, x1 = math.log(lengths[i - 1]), math.log(lengths[i])
    x = x0 + (x1 - x0) * g[i - 1] / (g[i - 1] - g[i])
    return math.exp(x)
