"""Measuring time and peak memory the same way on CPU and GPU, and fitting scaling exponents."""
from __future__ import annotations

import gc
import math
import platform
import re
import statistics
import time
from typing import Callable, Optional, Sequence

import torch


def synchronize(device: Optional[torch.device | str] = None) -> None:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def time_fn(fn: Callable[[], object], *, warmup: int = 1, repeats: int = 5, device=None) -> float:
    """Median wall time of `fn()` in seconds, after `warmup` untimed calls (GPU-synchronised)."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"time_fn: `repeats` must be a positive int, got {repeats!r}")
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _proc_status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024


_LIBC = None


def settle_cpu_allocator() -> None:
    """Put glibc's allocator in the state CPU memory measurements use, before timing anything.

    `peak_memory_bytes` fixes glibc's mmap threshold on its first CPU call (see
    `_release_free_memory`), and that changes how fast later allocations are: every large
    tensor is then fresh, page-faulted memory. A sweep that times and measures memory at each
    length calls this first, so that all its timings run under the same allocator instead of
    only the first one running under glibc's default. No-op off glibc.
    """
    _release_free_memory()


def _release_free_memory() -> None:
    """Hand freed heap memory back to the OS before a CPU peak measurement (glibc only).

    glibc keeps freed blocks resident (its mmap threshold grows up to 32 MiB after large frees),
    so a later allocation can reuse them without the resident set growing, and the high-water
    mark would miss it. Fixing the threshold (mallopt M_MMAP_THRESHOLD = 64 KiB, once) and
    trimming the heap (malloc_trim) before each reading makes every byte the measured call
    touches show up in the resident set.
    """
    global _LIBC
    try:
        import ctypes

        if _LIBC is None:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.mallopt(-3, 64 * 1024)  # -3 = M_MMAP_THRESHOLD
        _LIBC.malloc_trim(0)
    except (OSError, AttributeError):
        _LIBC = False


def _can_reset_cpu_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _proc_status("VmHWM")
        return True
    except (OSError, AttributeError):
        return False


def peak_memory_bytes(fn: Callable[[], object], *, device="cpu") -> Optional[int]:
    """Extra memory at the peak of `fn()` above what was in use when it started.

    CUDA: torch's allocator statistics. CPU (Linux): the process's resident-set high-water mark,
    reset just before the call (writing 5 to /proc/self/clear_refs); large tensors are mmap'ed
    and returned on free, so this tracks tensor memory closely. None where neither is available.
    """
    if torch.device(device).type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    gc.collect()
    _release_free_memory()
    if not _can_reset_cpu_peak():
        return None
    before = _proc_status("VmRSS")
    fn()
    return max(0, _proc_status("VmHWM") - before)


def fit_loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log(y) against log(x): the exponent p in y ~ c x^p."""
    if len(set(xs)) < 2 or len(xs) != len(ys):
        raise ValueError(f"fit_loglog_slope: needs at least two distinct x and one y per x, got xs={list(xs)}, ys={list(ys)}")
    lx = [math.log(x) for x in xs]
    ly = [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    sxx = sum((a - mx) ** 2 for a in lx)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sxx


def device_name(device=None) -> str:
    """A human-readable name of the compute device (GPU model, or CPU model and threads)."""
    if device is not None and torch.device(device).type == "cuda" or (device is None and torch.cuda.is_available()):
        return torch.cuda.get_device_name()
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.+)", f.read())
            cpu = m.group(1).strip() if m else cpu
    except OSError:
        pass
    return f"{cpu} ({torch.get_num_threads()} threads)"


def default_device() -> torch.device:
    """CUDA when present, else CPU: notebooks run on either."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


_SUPERSCRIPT = str.maketrans("0123456789-", "⁰¹²³⁴⁵⁶⁷⁸⁹⁻")


def power_of_ten(x: float) -> str:
    """x as a power of ten for the page: 1e-12 -> "10⁻¹²", 5e-13 -> "5×10⁻¹³", 0.5 -> "0.5".

    Bounds read better this way than as 1e-12, and are never mistaken for a measured
    round-off value (which would differ from machine to machine).
    """
    if x == 0 or 1e-3 <= abs(x) < 1e4:
        return f"{x:g}"
    mantissa, exponent = f"{x:e}".split("e")
    m = float(mantissa)
    power = "10" + str(int(exponent)).translate(_SUPERSCRIPT)
    return power if m == 1 else f"{m:g}×{power}"


def below(error, tol: float) -> str:
    """Assert that a round-off-level `error` is below `tol` and return the text "< tol".

    Round-off itself (3.6e-16 here, 1.9e-16 on another CPU or thread count) is not a
    result: printing it would make a saved output hold on one machine only. What is true
    everywhere is the bound, so the bound is what gets printed ("< 10⁻¹²"), and the check
    that it holds fails loudly. `error` may be a float or a one-element tensor.
    """
    value = float(error)
    if not value < tol:  # also catches NaN
        raise AssertionError(f"error {value:.3g} is not below the bound {tol:g}")
    return f"< {power_of_ten(tol)}"
