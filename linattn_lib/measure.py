"""Measuring time and peak memory the same way on CPU and GPU, and fitting scaling exponents.

Time: `timed_calls` is the one timing loop (wall or process clock, GPU-synchronised, optional
cache flush and time budget); `time_fn` is its median; `cuda_time` is Triton's do_bench on a
GPU; `flush_cpu_caches` evicts the CPU caches the way do_bench clears a GPU's L2;
`torch_threads` sets torch's CPU thread count for a block. Memory: `peak_memory_bytes` (CUDA
allocator, or the CPU resident-set high-water mark) and `rss_bytes`.

Imports no linattn_lib module but `_validate`.
"""
from __future__ import annotations

import contextlib
import gc
import math
import platform
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch

from . import _validate as V

_CLOCKS = {"wall": time.perf_counter, "process": time.process_time}


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for the GPU's queued work when `device` is a CUDA device (None: whenever CUDA is present)."""
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def timed_calls(
    fn: Callable[[], object],
    *,
    warmup: int = 1,
    repeats: int = 5,
    device: torch.device | str | None = None,
    clock: str = "wall",
    flush_caches: bool = False,
    budget_s: float | None = None,
) -> list[float]:
    """Seconds of each of `repeats` timed calls of `fn()`, after `warmup` untimed calls.

    device: synchronised after the warm-up and after each timed call when it is a CUDA device
        (None: whenever CUDA is present), so a call's time includes its GPU work.
    clock: "wall" (time.perf_counter) or "process" (time.process_time: the CPU time of this
        process, all its threads; on a shared machine it leaves out the time other processes
        hold the cores, and with one torch thread, see `torch_threads`, it approximates the
        wall time of the same call on an idle core).
    flush_caches: call `flush_cpu_caches()` before each timed call (outside the timing), so
        that each call starts cold instead of finding the last call's inputs still cached.
    budget_s: fewer timed calls (at least one) when the mean warm-up call says `repeats` of
        them would take longer than this (needs warmup >= 1; None: no budget).
    """
    V.check_positive_int("timed_calls", "repeats", repeats)
    V.check_choice("timed_calls", "clock", clock, tuple(_CLOCKS))
    now = _CLOCKS[clock]
    start = time.perf_counter()
    for _ in range(warmup):
        fn()
    synchronize(device)
    n = repeats
    if budget_s is not None and warmup:
        first = (time.perf_counter() - start) / warmup
        n = max(1, min(repeats, int(budget_s / max(first, 1e-9))))
    times = []
    for _ in range(n):
        if flush_caches:
            flush_cpu_caches()
        t0 = now()
        fn()
        synchronize(device)
        times.append(now() - t0)
    return times


def time_fn(
    fn: Callable[[], object], *, warmup: int = 1, repeats: int = 5, device: torch.device | str | None = None
) -> float:
    """Median wall time of `fn()` in seconds, after `warmup` untimed calls (GPU-synchronised):
    the median of `timed_calls`."""
    V.check_positive_int("time_fn", "repeats", repeats)
    return statistics.median(timed_calls(fn, warmup=warmup, repeats=repeats, device=device))


def cuda_time(fn: Callable[[], object], grad_to_none: Sequence[torch.Tensor] | None = None) -> list[float]:
    """[median seconds] of `fn()` from triton.testing.do_bench (CUDA only: never called without
    a GPU; raises ImportError without Triton). do_bench clears the L2 cache before each call
    and resets the gradients of `grad_to_none`."""
    from triton.testing import do_bench

    return [do_bench(fn, warmup=25, rep=100, grad_to_none=grad_to_none, return_mode="median") / 1e3]


def _last_level_cache_bytes() -> int:
    """Size of the CPU's last-level cache (Linux sysfs), or 256 MiB when it cannot be read."""
    try:
        base = Path("/sys/devices/system/cpu/cpu0/cache")
        sizes = []
        for index in base.glob("index*"):
            text = (index / "size").read_text().strip().upper()
            mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1], 1)
            sizes.append(int(text.rstrip("KMG")) * mult)
        return max(sizes)
    except (OSError, ValueError):
        return 256 * 2**20


_FLUSH_BUFFER: list[torch.Tensor] = []  # allocated on the first flush, then reused


def flush_cpu_caches() -> None:
    """Evict the caches by writing a buffer twice the last-level cache (at most 1 GiB), the way
    triton.testing.do_bench clears the GPU's L2 before every timed run: each call then starts
    cold, as it would inside a model, instead of finding last call's inputs still cached."""
    if not _FLUSH_BUFFER:
        _FLUSH_BUFFER.append(torch.empty(min(2 * _last_level_cache_bytes(), 2**30) // 4, dtype=torch.int32))
    _FLUSH_BUFFER[0].zero_()


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the block with `torch.set_num_threads(n)` (None: leave the setting alone), then restore it.

    Small per-token operations gain nothing from a thread pool, and on a shared, oversubscribed
    CPU a pool can make them orders of magnitude slower (threads wait at barriers for a core);
    timing with one thread measures the algorithm rather than the scheduler.
    """
    if n is None:
        yield
        return
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"torch_threads: `n` must be a positive int or None, got {n!r}")
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _proc_status(field: str) -> int:
    """A memory field of /proc/self/status ("VmRSS", "VmHWM") in bytes (Linux only: raises
    OSError elsewhere, AttributeError when the field is missing)."""
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024


def rss_bytes() -> int | None:
    """The process's resident set size in bytes (Linux), or None where it cannot be read."""
    try:
        return _proc_status("VmRSS")
    except (OSError, AttributeError):
        return None


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


def peak_memory_bytes(fn: Callable[[], object], *, device: torch.device | str = "cpu") -> int | None:
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


def device_name(device: torch.device | str | None = None) -> str:
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
    n = torch.get_num_threads()
    return f"{cpu} ({n} thread{'' if n == 1 else 's'})"


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


def below(error: float | torch.Tensor, tol: float) -> str:
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
