"""The GPU check's hard time limits: `time_limit(seconds)` raises `Timeout` in the block when they run out.

`Timeout` is a BaseException, so that no `except Exception` on the way (the library's, fla's,
a row's own error handling) swallows it; SIGALRM raises it in the main thread, between two
Python bytecodes (a running kernel or compile finishes its C call first).
"""
from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator


class Timeout(BaseException):
    """A `time_limit` ran out."""


@contextlib.contextmanager
def time_limit(seconds: float | None) -> Iterator[None]:
    """Raise `Timeout` in the block after `seconds` (main thread only; nests: an outer limit that
    ends sooner stays in force, and is re-armed with what is left of it afterwards)."""
    outer = signal.getitimer(signal.ITIMER_REAL)[0]
    if seconds is None or threading.current_thread() is not threading.main_thread() or (0 < outer <= seconds):
        yield
        return
    previous, start = signal.getsignal(signal.SIGALRM), time.monotonic()

    def expire(signum, frame):
        raise Timeout(f"time limit of {seconds:.0f} s reached")

    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1e-3))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer > 0:
            signal.setitimer(signal.ITIMER_REAL, max(outer - (time.monotonic() - start), 1e-3))
