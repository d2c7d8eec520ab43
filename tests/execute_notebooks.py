"""Re-execute the book's notebooks and save them with fresh outputs (`make execute`).

    python tests/execute_notebooks.py                  # every notebook under book/
    python tests/execute_notebooks.py book/01_*.ipynb  # just these

Each notebook runs top to bottom in a fresh kernel of *this* interpreter (the
project's virtual environment), in its own folder, with the same environment that
`make test` gives nbval kernels (see conftest.py): PYTHONHASHSEED=0 and matplotlib's
inline backend. The result is written to a temporary file next to the notebook and
moved over the original only if every cell succeeded, so a failed run never leaves a
half-executed notebook behind. A failure names the cell: an error, a cell running
past --timeout, or a dying kernel (os._exit, a segfault, the out-of-memory killer).
SIGINT (Ctrl-C) or SIGTERM stops the whole run at once: the kernel is killed and the
notebook being executed is left as it was.

Exit status: 0 if all notebooks succeeded, 1 otherwise, 128 + the signal's number
(130, 143) when interrupted.

This is a script, not a test module: pytest only collects test_*.py files.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import queue
import signal
import stat
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from ipykernel.kernelspec import RESOURCES, get_kernel_dict
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

REPO = Path(__file__).resolve().parent.parent
BOOK = REPO / "book"
# the project's kernel, which `make install` registers (nbval and this script run this interpreter)
KERNELSPEC = {"name": "linattn", "display_name": "Python 3 (linattn_lib)", "language": "python"}
RAISES_MARKER = "NBVAL_RAISES_EXCEPTION"
RAISES_TAG = "raises-exception"


class _ThisInterpreterKernels(KernelSpecManager):
    """Resolve every kernel name to an ipykernel running on sys.executable.

    A notebook says `linattn`, which Jupyter would look up among installed kernel
    specs (possibly another Python). nbval's --nbval-current-env does the same as this.
    """

    def get_kernel_spec(self, kernel_name: str):
        return self.kernel_spec_class(resource_dir=RESOURCES, **get_kernel_dict())


def _prepare_environment() -> None:
    os.environ["PYTHONHASHSEED"] = "0"
    os.environ.pop("MPLBACKEND", None)  # ipykernel then selects the inline backend
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")


def _default_notebooks() -> list[Path]:
    return sorted(
        p for p in BOOK.rglob("*.ipynb")
        if not {"_build", ".ipynb_checkpoints"} & set(p.relative_to(BOOK).parts)
    )


def _tag_expected_errors(nb: nbformat.NotebookNode) -> dict[int, list[str] | None]:
    """Let nbclient accept the errors that nbval expects.

    nbval accepts a `# NBVAL_RAISES_EXCEPTION` comment or a `raises-exception` tag;
    nbclient only the tag. Tag the commented cells for this run and return their
    original tags (None: no tags key) so the saved notebook keeps the author's metadata.
    """
    original = {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        comments = {ln.strip().lstrip("#").strip() for ln in cell.source.splitlines()
                    if ln.strip().startswith("#")}
        tags = cell.metadata.get("tags")
        if RAISES_MARKER in comments and RAISES_TAG not in (tags or []):
            original[i] = None if tags is None else list(tags)
            cell.metadata["tags"] = (tags or []) + [RAISES_TAG]
    return original


def _restore_tags(nb: nbformat.NotebookNode, original: dict[int, list[str] | None]) -> None:
    for i, tags in original.items():
        if tags is None:
            del nb.cells[i].metadata["tags"]
        else:
            nb.cells[i].metadata["tags"] = tags


def _write_atomically(nb: nbformat.NotebookNode, path: Path) -> None:
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".ipynb.tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            nbformat.write(nb, f)
        os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))  # mkstemp creates 0600
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def _drop_widget_views(nb: nbformat.NotebookNode) -> None:
    """Remove ipywidgets' views from saved outputs (their models are not saved), keeping the
    text fallback that says how to get the live widget; nbval never compares the views."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            if WIDGET_VIEW in data and len(data) > 1:
                del data[WIDGET_VIEW]


class NotebookFailed(Exception):
    """A notebook did not run through; the message says which cell and why."""


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived while a notebook was executing."""


def _first_line(source: str, width: int = 80) -> str:
    line = next((ln.strip() for ln in source.splitlines() if ln.strip()), "")
    return line if len(line) <= width else line[: width - 3] + "..."


def _where(nb: nbformat.NotebookNode, index: int) -> str:
    """Name a cell by its index in the notebook and by nbval's name (code cells only)."""
    code_index = sum(c.cell_type == "code" for c in nb.cells[:index])
    return f'cell {index} (nbval "Cell {code_index}"): {_first_line(nb.cells[index].source)}'


def _died(exit_status: int | None) -> str:
    if exit_status is None:
        return "the kernel died"
    if exit_status < 0:
        return f"the kernel died: killed by {signal.Signals(-exit_status).name}"
    return f"the kernel died: it exited with status {exit_status}"


async def _shut_down(km: AsyncKernelManager, client: NotebookClient, graceful: bool) -> None:
    """Stop the kernel: nbclient leaves a kernel alone whose manager it was given.

    Graceful after a complete run, so the kernel's exit handlers run; otherwise killed
    at once (with its process group), as it may still be busy in the failed cell.
    nbclient's polling tasks are cancelled first: after a timeout it leaves one running.
    """
    leftovers = asyncio.all_tasks() - {asyncio.current_task()}
    for task in leftovers:
        task.cancel()
    await asyncio.gather(*leftovers, return_exceptions=True)
    if km.has_kernel:  # also true for a dead kernel: this reaps it
        await km.shutdown_kernel(now=not graceful)
    if client.kc is not None:
        client.kc.stop_channels()


POLL_SLICE_S = 2.0


def _in_slices(get_msg):
    """A channel's `get_msg(timeout)` that waits in slices of POLL_SLICE_S seconds.

    After a cell that shows an ipywidget, a wait on the shell or IOPub socket sometimes
    never wakes although the reply has arrived (nbclient issue #312): the run hung at
    a notebook's live slider with the kernel idle. A fresh poll sees the message that is
    already there, so the wait is cut into short ones until the caller's timeout (None:
    forever) is spent; then `Empty`, as before.
    """

    async def sliced(timeout: float | None = None) -> dict:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = POLL_SLICE_S if deadline is None else deadline - time.monotonic()
            try:
                return await get_msg(timeout=max(0.0, min(POLL_SLICE_S, left)))
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    return sliced


def _poll_in_slices(client: NotebookClient) -> None:
    """Make the client's shell and IOPub waits `_in_slices` (an nbclient hook: the kernel
    client exists by then)."""
    for channel in (client.kc.shell_channel, client.kc.iopub_channel):
        channel.get_msg = _in_slices(channel.get_msg)


async def execute(path: Path, timeout: int, stop: asyncio.Event) -> None:
    """Execute one notebook; replace it only on success.

    Raises NotebookFailed (cell errors, timeouts, a dead kernel), Interrupted once
    `stop` is set, or whatever else went wrong (kernel start-up, unreadable file).
    The manager is an AsyncKernelManager because nbclient awaits its client: a blocking
    client's channel reads block the event loop, so nbclient's per-cell timeout and its
    once-a-second "is the kernel alive?" check never run (a dead kernel hung forever).
    """
    nb = nbformat.read(path, as_version=4)
    original_tags = _tag_expected_errors(nb)
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    km = AsyncKernelManager(kernel_name="python3", kernel_spec_manager=_ThisInterpreterKernels())
    running = []  # index of the cell being executed, for the error message

    client = NotebookClient(
        nb,
        km=km,
        timeout=timeout,
        kernel_name="python3",
        allow_errors=False,
        record_timing=False,  # no timestamps in the saved metadata: clean diffs
        # nbclient must track widget state (with it off, output captured by an ipywidgets
        # Output widget raises KeyError); _drop_widget_views removes it before saving: the book
        # shows static sliders (the live ones are remove-output), and a saved widget view
        # makes JupyterLab print "model not found" under every live slider until its cell
        # runs. Each slider keeps its text fallback instead.
        store_widget_state=True,
        resources={"metadata": {"path": str(path.parent)}},
        on_cell_start=lambda cell, cell_index: running.append(cell_index),
    )
    client.on_notebook_start = lambda notebook: _poll_in_slices(client)
    run = asyncio.ensure_future(client.async_execute())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({run, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not run.done():
        run.cancel()
        await asyncio.wait({run})  # let nbclient unwind before its kernel goes
    interrupted = stop.is_set() or run.cancelled()
    exc = None if run.cancelled() else run.exception()
    exit_status = await km.provisioner.poll() if km.has_kernel else None
    await _shut_down(km, client, graceful=exc is None and not interrupted)

    if interrupted:
        raise Interrupted
    if isinstance(exc, (CellExecutionError, CellTimeoutError, DeadKernelError)):
        reason = _died(exit_status) if isinstance(exc, DeadKernelError) else str(exc)
        where = f"\n  in {_where(nb, running[-1])}" if running else ""
        raise NotebookFailed(f"{where}\n{reason}") from exc
    if exc is not None:
        raise exc
    _restore_tags(nb, original_tags)
    _drop_widget_views(nb)
    nbformat.validate(nb)
    _write_atomically(nb, path)


def _shown(path: Path) -> Path:
    return path.relative_to(REPO) if path.is_relative_to(REPO) else path


async def _execute_all(
    notebooks: list[Path], timeout: int, stop: asyncio.Event
) -> tuple[list[Path], Path | None]:
    """Execute the notebooks in turn; return the failed ones and the interrupted one."""
    failed = []
    for path in notebooks:
        if not path.is_file() or path.suffix != ".ipynb":
            print(f"FAILED {path}: not a notebook file", file=sys.stderr)
            failed.append(path)
            continue
        if stop.is_set():
            return failed, path
        print(f"executing {_shown(path)} ...", flush=True)
        start = time.perf_counter()
        try:
            await execute(path, timeout, stop)
        except Interrupted:
            return failed, path
        except NotebookFailed as exc:
            print(f"FAILED {_shown(path)} (left unchanged):{exc}", file=sys.stderr)
            failed.append(path)
        except Exception as exc:  # kernel start-up, unreadable notebook, ...
            print(f"FAILED {_shown(path)} (left unchanged): {type(exc).__name__}: {exc}",
                  file=sys.stderr)
            failed.append(path)
        else:
            print(f"  saved in {time.perf_counter() - start:.1f} s", flush=True)
    return failed, None


def _run_stoppably(
    notebooks: list[Path], timeout: int
) -> tuple[list[Path], Path | None, int | None]:
    """Run _execute_all on an event loop in a worker thread; SIGINT/SIGTERM set its stop event.

    Why a thread: on the main thread nbclient installs SIGINT/SIGTERM handlers of its own,
    which only shut the kernel down and let the run go on with the next notebook. It
    skips them on other threads, so here the main thread keeps the signals. It waits
    with a timeout, as a signal delivered to another thread would not wake a plain wait.
    Returns the failed notebooks, the interrupted one and the signal's number.
    """
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    received = []

    def on_signal(signum: int, frame: object) -> None:
        received.append(signum)
        loop.call_soon_threadsafe(stop.set)

    handlers = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            done = pool.submit(loop.run_until_complete, _execute_all(notebooks, timeout, stop))
            while not done.done():
                concurrent.futures.wait([done], timeout=0.2)
            failed, interrupted = done.result()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        loop.close()
    return failed, interrupted, received[0] if received else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="notebooks to execute (default: every notebook under book/)")
    parser.add_argument("--timeout", type=int, default=1200,
                        help="seconds allowed per cell (default: %(default)s)")
    args = parser.parse_args(argv)

    _prepare_environment()
    notebooks = [p.resolve() for p in args.notebooks] or _default_notebooks()
    if not notebooks:
        print("no notebooks found under", BOOK)
        return 0

    failed, interrupted, signum = _run_stoppably(notebooks, args.timeout)
    if signum is not None:
        left = f"; {_shown(interrupted)} left unchanged" if interrupted else ""
        print(f"interrupted by {signal.Signals(signum).name}{left}.", file=sys.stderr)
        return 128 + signum
    if failed:
        print(f"{len(failed)} of {len(notebooks)} notebook(s) failed; originals kept.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
