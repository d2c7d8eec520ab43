"""The `make execute` script (tests/execute_notebooks.py) saves only complete runs and never hangs.

Each test writes tiny notebooks to tmp_path and runs the script as a subprocess, under
a hard time limit so that a regression (a hang) fails instead of blocking CI. Cells
that need watching write their kernel's pid to a file when they start: its mtime says
when the cell began (so timings do not depend on how slow kernel start-up is) and the
pid shows whether the kernel was left behind.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import psutil
from nbformat.v4 import new_code_cell, new_notebook

SCRIPT = Path(__file__).with_name("execute_notebooks.py")
LIMIT_S = 60  # a hang fails the test after this long
PID_CELL = "import os, time\nopen('kernel.pid', 'w').write(str(os.getpid()))\n"


def _notebook(path: Path, *sources: str) -> bytes:
    nbformat.write(new_notebook(cells=[new_code_cell(s) for s in sources]), path)
    return path.read_bytes()


def _command(timeout: int, *notebooks: Path) -> list[str]:
    return [sys.executable, str(SCRIPT), "--timeout", str(timeout), *map(str, notebooks)]


def _execute(timeout: int, *notebooks: Path) -> subprocess.CompletedProcess:
    return subprocess.run(_command(timeout, *notebooks), capture_output=True, text=True,
                          timeout=LIMIT_S)


def _running(pid: int) -> bool:
    """Whether the process exists and is not a zombie (a zombie runs nothing)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kernel_pid(folder: Path) -> int:
    return int((folder / "kernel.pid").read_text())


def test_success_saves_outputs_and_shuts_each_kernel_down(tmp_path):
    first, second = tmp_path / "first.ipynb", tmp_path / "second.ipynb"
    _notebook(first, PID_CELL + "print(1 + 1)",
              "# NBVAL_RAISES_EXCEPTION\nraise ValueError('expected')")
    # Runs while the script is still alive: the first kernel must be gone by then.
    _notebook(second, "import psutil\nprint(psutil.pid_exists(int(open('kernel.pid').read())))")

    proc = _execute(30, first, second)

    assert proc.returncode == 0, proc.stderr
    assert "saved in" in proc.stdout
    cells = nbformat.read(first, as_version=4).cells
    assert cells[0].outputs[0].text == "2\n"
    assert cells[1].outputs[0].ename == "ValueError"
    assert "tags" not in cells[1].metadata  # the tag nbclient needed is not saved
    assert nbformat.read(second, as_version=4).cells[0].outputs[0].text == "False\n"


def test_raising_cell_fails_and_leaves_the_notebook_unchanged(tmp_path):
    nb = tmp_path / "raises.ipynb"
    original = _notebook(nb, "x = 1", "raise ValueError('boom')")

    proc = _execute(30, nb)

    assert proc.returncode == 1
    assert "cell 1" in proc.stderr and "boom" in proc.stderr
    assert "1 of 1 notebook(s) failed" in proc.stderr
    assert nb.read_bytes() == original


def test_dead_kernel_fails_fast_and_names_the_cell(tmp_path):
    nb = tmp_path / "dies.ipynb"
    original = _notebook(nb, "x = 1", "import os; os._exit(3)")

    start = time.monotonic()
    proc = _execute(100, nb)

    assert time.monotonic() - start < 30
    assert proc.returncode == 1
    assert str(nb) in proc.stderr
    assert "cell 1" in proc.stderr and "import os; os._exit(3)" in proc.stderr
    assert "exited with status 3" in proc.stderr
    assert nb.read_bytes() == original


def test_cell_timeout_is_enforced_and_the_kernel_killed(tmp_path):
    nb = tmp_path / "slow.ipynb"
    original = _notebook(nb, PID_CELL + "time.sleep(30)")

    proc = _execute(3, nb)
    ended = time.time()

    assert proc.returncode == 1
    assert "timed out" in proc.stderr and "cell 0" in proc.stderr
    assert ended - (tmp_path / "kernel.pid").stat().st_mtime < 15  # 3 s, not 30 s
    assert not _running(_kernel_pid(tmp_path))
    assert nb.read_bytes() == original


def test_sigterm_stops_promptly_and_kills_the_kernel(tmp_path):
    nb, later = tmp_path / "slow.ipynb", tmp_path / "later.ipynb"
    original, later_original = _notebook(nb, PID_CELL + "time.sleep(60)"), _notebook(later, "1")

    proc = subprocess.Popen(_command(100, nb, later), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + LIMIT_S
        while not (tmp_path / "kernel.pid").exists():  # the cell has started
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert _kernel_pid(tmp_path) in {p.pid for p in children}

        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=10)
    finally:
        proc.kill()

    assert proc.returncode == 128 + signal.SIGTERM
    assert "interrupted by SIGTERM" in stderr
    assert not [p for p in children if _running(p.pid)]
    assert nb.read_bytes() == original
    assert later.read_bytes() == later_original  # the run stopped: nothing after it ran


def test_live_slider_saves_its_text_fallback_and_no_widget_state(tmp_path):
    """JupyterLab shows "model not found" under a saved widget view whose model was not
    saved; the executor keeps only the slider's text, which says to run the cell."""
    nb = tmp_path / "slider.ipynb"
    _notebook(nb, "from linattn_lib.chapters.widgets import live_slider\n"
                  "live_slider(lambda m: print(m), m=(1, 4))")  # output inside the widget

    proc = _execute(60, nb)

    assert proc.returncode == 0, proc.stderr
    saved = nbformat.read(nb, as_version=4)
    (out,) = saved.cells[0].outputs
    assert set(out.data) == {"text/plain"}
    assert out.data["text/plain"] == "<live slider over m: run this cell to move it>"
    assert "widgets" not in saved.metadata


def test_channel_waits_are_cut_into_slices_that_see_a_message_already_there(monkeypatch):
    """A wait that never wakes although its message has arrived (nbclient #312, seen here
    after a live slider) must not hang the run: each wait is a series of short polls, the
    next of which sees the message; a timeout still ends in Empty when it is spent."""
    import asyncio
    import queue

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import execute_notebooks as X
    finally:
        sys.path.remove(str(SCRIPT.parent))
    monkeypatch.setattr(X, "POLL_SLICE_S", 0.01)
    asked = []

    async def lost_once(timeout=None):
        """Misses the message on its first wait (forever, unless given a timeout)."""
        asked.append(timeout)
        if len(asked) == 1:
            if timeout is None:
                await asyncio.Event().wait()
            await asyncio.sleep(timeout)
            raise queue.Empty
        return {"msg": "reply"}

    assert asyncio.run(X._in_slices(lost_once)(None)) == {"msg": "reply"}
    assert asked == [0.01, 0.01]

    async def never(timeout=None):
        await asyncio.sleep(timeout)
        raise queue.Empty

    start = time.monotonic()
    try:
        asyncio.run(X._in_slices(never)(0.05))
    except queue.Empty:
        pass
    else:
        raise AssertionError("a spent timeout must end in Empty")
    assert 0.05 <= time.monotonic() - start < 1
