"""Local process groups: `launch` runs fn(rank, W, *args) on W processes of this machine.

For the tests, the book and the command line. The processes rendezvous on 127.0.0.1 at a free
port (gloo bound to the loopback interface, so nothing leaves the machine; or nccl with one GPU
per rank), run the function, and pipe back its result or the error it raised. A rank that fails
reports and exits at once, so that its peers fail in their next collective (`PeerFailureError`,
see `comm.py`) instead of waiting for the collective timeout; ranks still alive a grace period
after the first failure are terminated, and `launch` raises one `DistributedRunError` that lists
every rank's outcome, the first failure first.

Nothing here knows about attention: the rank functions live in `harness.py` and `cli.py`.
"""
from __future__ import annotations

import io
import multiprocessing as mp
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from .. import _validate as V

LOOPBACK = "127.0.0.1"  # the only address `launch` ever uses

__all__ = ["LOOPBACK", "DistributedRunError", "free_port", "launch", "loopback_interface"]


class DistributedRunError(RuntimeError):
    """Raised by `launch` when a rank failed; `.errors` maps rank -> one-line reason,
    `.exitcodes` lists the exit code of every rank, `.tracebacks` maps rank -> traceback."""

    def __init__(self, message: str, errors: dict[int, str], exitcodes: list[int | None],
                 tracebacks: dict[int, str]):
        super().__init__(message)
        self.errors, self.exitcodes, self.tracebacks = errors, exitcodes, tracebacks


def free_port() -> int:
    """A TCP port that is free on the loopback interface right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def loopback_interface() -> str:
    """Name of the loopback network interface ("lo" on Linux, "lo0" on macOS)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except (OSError, AttributeError):
        names = []
    for name in ("lo", "lo0"):
        if name in names:
            return name
    return next((n for n in names if n.startswith("lo")), "lo")


# --------------------------------------------------------------------------------------
# the processes
# --------------------------------------------------------------------------------------


def _start_method() -> str:
    # forkserver: one interpreter imports torch once, every rank is a fork of it (fast and safe:
    # that interpreter never ran a torch op, so no thread pool is copied half-initialised).
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def _forkserver_preload() -> list[str]:
    """What the forkserver imports before it forks the ranks: torch and this package
    (`linattn_lib.distributed`, which imports every rank function of the library).

    Not the package when the main module is one of its modules that every rank would run again:
    multiprocessing re-runs the main module in each rank (as `__mp_main__`, so that functions
    defined there unpickle), and runpy warns that the module was "found in sys.modules ... prior
    to execution" when the rank already holds it. A main module named `__main__` is never re-run:
    `python -m linattn_lib.distributed` runs `linattn_lib.distributed.__main__`, which nothing
    imports, so the package is preloaded then.
    """
    main_name = getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None) or ""
    rerun = not (main_name == "__main__" or main_name.endswith(".__main__"))
    inside = main_name == __package__ or main_name.startswith(f"{__package__}.")
    return ["torch"] + ([] if rerun and inside else [__package__])


def _context(start_method: str | None) -> BaseContext:
    method = start_method or _start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_forkserver_preload())
    return ctx


def _exit_with_launcher(launcher_pid: int) -> None:
    """Daemon thread of a rank: exit if the launching process is gone (killed, not interrupted),
    instead of waiting for a collective timeout with nobody left to report to."""

    def watch() -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(launcher_pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:  # the pid was reused by another user's process
                os._exit(1)

    threading.Thread(target=watch, name="linattn-launcher-watch", daemon=True).start()


def _worker(fn: Callable[..., Any], rank: int, world_size: int, port: int, backend: str, timeout: float,
            args: tuple, conn: Connection, launcher_pid: int | None = None) -> None:
    if launcher_pid is not None:
        _exit_with_launcher(launcher_pid)
    os.environ.update(MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    if backend == "gloo":
        os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()  # never any address but loopback
    torch.set_num_threads(1)  # W processes share the machine's cores
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://{LOOPBACK}:{port}", rank=rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout))
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(result, buf)
        conn.send(("ok", buf.getvalue()))
    except BaseException as e:  # report, then exit at once: the peers see the closed sockets
        try:
            conn.send(("error", f"{type(e).__name__}: {e}".splitlines()[0], traceback.format_exc(), time.time()))
            conn.close()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
    try:
        dist.destroy_process_group()
    finally:
        conn.close()


def _exit_reason(code: int | None, terminated: bool, grace: float) -> str:
    if terminated:
        return (f"terminated by the launcher: still running {grace:g} s after the first failure "
                f"(stalled or busy; exit code {code})")
    return f"exited with code {code} without reporting an error"


def _start_ranks(ctx: BaseContext, fn: Callable[..., Any], world_size: int, args: tuple, *, backend: str,
                 timeout: float) -> tuple[list[BaseProcess], list[Connection]]:
    """Start the W processes on a free port; returns them and the receiving ends of their pipes."""
    port = free_port()
    procs, conns = [], []
    for rank in range(world_size):
        recv_end, send_end = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_worker, name=f"linattn-rank{rank}",
                        args=(fn, rank, world_size, port, backend, timeout, args, send_end, os.getpid()))
        p.start()
        send_end.close()
        procs.append(p)
        conns.append(recv_end)
    return procs, conns


# --------------------------------------------------------------------------------------
# watching them: results, errors, the grace period
# --------------------------------------------------------------------------------------


class _RankWatch:
    """The launcher's record of the ranks while they run: what each sent back, when each failed
    (the failing process's clock, or the launcher's), which ranks it terminated."""

    def __init__(self, procs: Sequence[BaseProcess], conns: Sequence[Connection], grace: float):
        self.procs, self.conns, self.grace = list(procs), list(conns), grace
        self.results: dict[int, Any] = {}
        self.errors: dict[int, str] = {}
        self.tracebacks: dict[int, str] = {}
        self.when: dict[int, float] = {}
        self.open = dict(enumerate(conns))
        self.terminated: set[int] = set()
        self.first_failure: float | None = None

    def run(self) -> None:
        """Until every rank has exited and every pipe is closed: read messages, note silent
        exits, terminate the survivors once `grace` seconds have passed since the first failure."""
        while self.open or any(p.is_alive() for p in self.procs):
            ready = wait(list(self.open.values()) + [p.sentinel for p in self.procs if p.is_alive()], timeout=0.1)
            self._receive(ready)
            for rank, p in enumerate(self.procs):
                if not p.is_alive() and p.exitcode not in (0, None) and rank not in self.errors \
                        and rank not in self.open:
                    self._exited_silently(rank, p.exitcode)
            self._terminate_after_grace()

    def _receive(self, ready: list) -> None:
        for rank, c in list(self.open.items()):
            if c in ready:
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    del self.open[rank]
                    continue
                if msg[0] == "ok":
                    self.results[rank] = torch.load(io.BytesIO(msg[1]), weights_only=False)
                else:
                    self.errors[rank], self.tracebacks[rank], self.when[rank] = msg[1], msg[2], msg[3]

    def _exited_silently(self, rank: int, code: int | None) -> None:
        self.errors[rank] = _exit_reason(code, rank in self.terminated, self.grace)
        self.when[rank] = time.time()

    def _terminate_after_grace(self) -> None:
        if self.errors and self.first_failure is None:
            self.first_failure = time.monotonic()
        if self.first_failure is not None and time.monotonic() - self.first_failure > self.grace:
            for rank, p in enumerate(self.procs):
                if p.is_alive():
                    self.terminated.add(rank)
                    p.terminate()
            self.first_failure = float("inf")  # terminate once

    def stop(self, finished: bool) -> None:
        """Join every rank (terminating them first if the launcher was interrupted: do not leave
        ranks behind; killing any that ignore that) and close the pipes."""
        for p in self.procs:
            if not finished and p.is_alive():
                p.terminate()
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        for c in self.conns:
            c.close()

    def outcome(self) -> list[Any]:
        """The results by rank, or DistributedRunError listing every failed rank, first failure first."""
        exitcodes = [p.exitcode for p in self.procs]
        for rank, code in enumerate(exitcodes):
            if code != 0 and rank not in self.errors:
                self._exited_silently(rank, code)
        if self.errors:
            order = sorted(self.errors, key=lambda r: (self.when[r], r))  # the first failure first
            lines = [f"{len(self.errors)} of {len(self.procs)} ranks failed (first: rank {order[0]}):"]
            lines += [f"  rank {r}: {self.errors[r]}" for r in order]
            if order[0] in self.tracebacks:
                lines += [f"traceback of rank {order[0]}:", self.tracebacks[order[0]].rstrip()]
            raise DistributedRunError("\n".join(lines), self.errors, exitcodes, self.tracebacks)
        missing = [r for r in range(len(self.procs)) if r not in self.results]
        if missing:
            raise DistributedRunError(f"ranks {missing} exited without a result", {}, exitcodes, {})
        return [self.results[r] for r in range(len(self.procs))]


# --------------------------------------------------------------------------------------
# launch
# --------------------------------------------------------------------------------------


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", timeout: float = 60.0,
           grace: float | None = None, start_method: str | None = None) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` local processes joined in a process group.

    The processes rendezvous on 127.0.0.1 at a free port (gloo is bound to the loopback
    interface: nothing leaves the machine), with `timeout` seconds for every collective, and use
    one CPU thread each. `fn` must be importable (defined in a module, not in a notebook or
    `__main__`) and its return value picklable by `torch.save`.

    Returns:
        the list of return values, by rank.
    Raises:
        DistributedRunError if any rank fails. A failing rank reports its error and exits at
        once; its peers then fail in their next collective (connection closed, or the
        collective timeout if the failing rank hangs instead) with a `PeerFailureError`. Ranks
        still alive `grace` seconds after the first failure (default 5) are terminated: the
        group is broken by then, and a rank that has not noticed is stalled or busy. The
        error lists every rank's outcome, the first failure first. If the launcher itself is
        interrupted (e.g. Ctrl-C in a notebook), it terminates the ranks before re-raising.
    """
    V.check_positive_int("launch", "world_size", world_size)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"launch: `backend` must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"launch: backend='nccl' needs one GPU per rank: {world_size} ranks, "
                         f"{torch.cuda.device_count()} GPUs")
    ctx = _context(start_method)
    grace = 5.0 if grace is None else float(grace)
    procs, conns = _start_ranks(ctx, fn, world_size, args, backend=backend, timeout=float(timeout))
    watch = _RankWatch(procs, conns, grace)
    finished = False
    try:
        watch.run()
        finished = True
    finally:
        watch.stop(finished)
    return watch.outcome()
