"""The committed GPU check (book/results/gpu/) read into what appendix A.5.2 prints and asserts:
the benchmark at the main shape, ours beside fla and SDPA, and one forward+backward kernel by
kernel, ours beside fla's and the performance model's prediction.

Two calls of the check made the results on one lease of an H200: `gpu_check.json`, then
`gpu_check_resumed.json` (`--resume`), which timed what the first left and profiled fla."""
from __future__ import annotations

from ..results import load_result

RUNS = ("gpu/gpu_check.json", "gpu/gpu_check_resumed.json")
MAIN = "B=2 T=16384 H=16 D=128"
OURS, KEPT, FLA, SDPA = "ours: op", "ours: op, kept states", "fla", "sdpa"
# one forward+backward, unnormalised: (role, our kernel and its occurrence, fla's)
ROLES = (
    ("fwd walk", ("chunk_state_kernel", 0), ("chunk_fwd_kernel_h", 0)),
    ("fwd outputs", ("chunk_output_kernel", 0), ("chunk_fwd_kernel_o", 0)),
    ("bwd walk again", ("chunk_state_kernel", 1), ("chunk_fwd_kernel_h", 1)),
    ("bwd dH walk", ("chunk_state_kernel", 2), ("chunk_bwd_kernel_dh", 0)),
    ("bwd dq, dk", ("chunk_dqk_kernel", 0), ("chunk_bwd_kernel_dqkwg", 0)),
    ("bwd dv", ("chunk_dv_kernel", 0), ("chunk_bwd_kernel_dv", 0)),
)


def load_runs(names: tuple[str, ...] = RUNS) -> list[dict]:
    """The sections of every committed run, in order; [] when there is none."""
    runs = [load_result(n, default=None) for n in names]
    return [r["sections"] for r in runs if r is not None]


def bench_rows(runs: list[dict]) -> dict[tuple[str, str, str], dict]:
    """(shape, variant, provider) -> the measured row (a later run's only where an earlier
    one has no time for it)."""
    out: dict = {}
    for sections in runs:
        for r in sections.get("benchmark", {}).get("rows", []):
            key = (r["shape"], r["variant"], r["provider"])
            if "forward_ms" in r and key not in out:
                out[key] = r
    return out


def times(rows: dict, variant: str, provider: str, shape: str = MAIN) -> tuple:
    """(forward ms, forward+backward ms) of a row; None for what was not measured."""
    r = rows.get((shape, variant, provider), {})
    fb = r.get("forward_backward_ms")
    return r.get("forward_ms"), fb if isinstance(fb, (int, float)) else None


def _ms(x: float | None, width: int = 7) -> str:
    return f"{x:{width}.2f}" if x is not None else " " * (width - 1) + "-"


VARIANTS = ("unnormalised", "per-head decay", "per-token decay", "normalised")


def main_table(rows: dict) -> list[str]:
    """The main shape in ms, narrow enough for a phone: forward+backward, ours (the op) beside
    fla with the ratio, the kept-states rows and softmax (SDPA); then the forwards."""
    lines = [f"{MAIN}, bf16"]
    for col, title in ((1, "forward+backward, ms"), (0, "forward, ms")):
        lines.append(f"{title:20}{'ours':>7}{'fla':>7}{'ours/fla':>10}")
        for variant in VARIANTS:
            ours, fla = times(rows, variant, OURS)[col], times(rows, variant, FLA)[col]
            ratio = _ms(ours / fla, 10) if ours and fla else _ms(None, 10)
            lines.append(f"{variant:20}{_ms(ours)}{_ms(fla)}{ratio}")
            kept = times(rows, variant, KEPT)[col]
            if col == 1 and kept is not None:
                lines.append(f"{'  kept states':20}{_ms(kept)}")
        if col == 1:
            lines.append(f"{'softmax (flash)':20}{_ms(times(rows, 'normalised', SDPA)[1])}")
    return lines


def _nth(sequence: list[dict], name: str, n: int) -> float | None:
    hits = [s["us"] for s in sequence if s["name"] == name]
    return hits[n] if n < len(hits) else None


def kernel_pairs(runs: list[dict]) -> list[tuple[str, float, float, float]]:
    """One unnormalised forward+backward at the main shape, per role: (role, the model's
    prediction for our launch, ours measured, fla's measured), microseconds."""
    prof = next(s["profile"] for s in reversed(runs) if "unnormalised, fla" in s.get("profile", {}))
    ours, fla = prof["unnormalised"], prof["unnormalised, fla"]
    predicted = {}
    for launch in ours.get("launches", []):
        predicted.setdefault(launch["kernel"], []).append(launch["predicted_us"])
    return [(role, predicted[mine][i], _nth(ours["sequence"], mine, i), _nth(fla["sequence"], theirs, j))
            for role, (mine, i), (theirs, j) in ROLES]


def kernel_table(pairs: list[tuple[str, float, float, float]], timed_ms: tuple[float, float]) -> list[str]:
    """The kernel-by-kernel table, narrow enough for a phone, with the profiled sums beside the
    timed calls (`timed_ms`: ours', fla's forward+backward)."""
    lines = ["one fwd+bwd, B=2, unnormalised, us", f"{'':15}{'ours':>6}{'fla':>6}{'vs fla':>7}{'vs model':>9}"]
    for role, model, ours, fla in pairs:
        lines.append(f"{role:15}{ours:6.0f}{fla:6.0f}{ours / fla:7.2f}{ours / model:9.2f}")
    total = [sum(p[i] for p in pairs) for i in (1, 2, 3)]
    lines.append(f"{'sum':15}{total[1]:6.0f}{total[2]:6.0f}{total[1] / total[2]:7.2f}{total[1] / total[0]:9.2f}")
    ours, fla = (1e3 * t for t in timed_ms)
    lines.append(f"{'timed call':15}{ours:6.0f}{fla:6.0f}{ours / fla:7.2f}")
    return lines
