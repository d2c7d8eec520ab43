"""Repository-wide pytest configuration.

It lives at the repository root (not in tests/) because nbval collects the chapter
notebooks under book/, and a conftest.py only applies to files below it.

What it does:

* Kernels started by nbval inherit this process's environment. PYTHONHASHSEED is
  fixed so set/dict iteration order cannot change printed output. MPLBACKEND is
  removed on purpose: ipykernel only selects the inline backend when MPLBACKEND is
  unset, and with e.g. MPLBACKEND=Agg (common on CI) notebooks would silently stop
  displaying figures, so their saved outputs would no longer match.
  tests/execute_notebooks.py prepares the kernel environment the same way.
* The library tests in this process draw with the non-interactive Agg backend.
* nbval does not compare outputs that are volatile by nature: HTML reprs (tqdm bars,
  widget fallbacks), JavaScript, widget views and stderr (warnings, progress).
  Plain text, errors and figure summaries are still compared; tests/nbval_sanitize.cfg
  masks the few volatile substrings (timings, addresses) that remain.
* nbval waits only 5 s for each output message after a cell has finished; big
  outputs and widgets need longer.
* The portability gate: nbval's kernels run under a numeric environment other than
  the one `make execute` saves with (one thread, ATen's scalar code path instead of
  AVX2/AVX-512, MKL's "compatible" matmul path). Each of these changes the round-off of
  torch's reductions, elementwise kernels or matmuls (measured on the development
  machine, see README "How the tests work"), so an output that prints round-off fails
  here, on the developer's machine, and not only on a reader's other CPU. Set
  LINATTN_PORTABILITY_GATE=0 to run the kernels in the environment as it is.
* nbval 0.11 sends cells with store_history=False. IPython then cannot see the cell's
  trailing `;` (it looks in the history), so `plt.plot(x);` shows its return value under
  nbval but not in Jupyter, Colab or `make execute`. Cells are sent the way Jupyter sends
  them instead, so saved and fresh outputs come from the same behaviour.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

NBVAL_SKIP_COMPARE = (
    "text/html",
    "application/javascript",
    "application/vnd.jupyter.widget-view+json",
    "stderr",
)
NBVAL_OUTPUT_TIMEOUT_S = 60
PORTABILITY_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
}

os.environ["PYTHONHASHSEED"] = "0"
os.environ.pop("MPLBACKEND", None)
os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # quiets debugpy in kernels

try:
    import matplotlib
except ImportError:  # the library tests that draw will say so themselves
    pass
else:
    matplotlib.use("Agg")


def _execute_like_jupyter(self, cell_input, allow_stdin=None):
    return self.kc.execute(cell_input, store_history=True, allow_stdin=allow_stdin, stop_on_error=False)


def portability_gate_on() -> bool:
    return os.environ.get("LINATTN_PORTABILITY_GATE", "1") != "0"


def _start_kernel_in_gate_env(start_new_kernel):
    """Wrap jupyter_client's start_new_kernel so that kernels get PORTABILITY_ENV."""

    def start(*args, **kwargs):
        kwargs["env"] = {**os.environ, **kwargs.get("env", {}), **PORTABILITY_ENV}
        return start_new_kernel(*args, **kwargs)

    return start


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, "nbval", False) or getattr(config.option, "nbval_lax", False):
        import nbval.kernel
        from nbval.kernel import RunningKernel

        RunningKernel.execute_cell_input = _execute_like_jupyter
        # The notebooks name the project's kernel ("linattn", which `make install` registers
        # for the user's JupyterLab); the tests run them in this interpreter, whatever a
        # registration elsewhere points to (another clone, another venv).
        if not getattr(config.option, "nbval_kernel_name", None):
            config.option.nbval_current_env = True
        if portability_gate_on():
            nbval.kernel.start_new_kernel = _start_kernel_in_gate_env(nbval.kernel.start_new_kernel)

    # addopts gives the sanitizer relative to the repository root; make it work
    # when pytest is started from another directory (e.g. `cd book && pytest --nbval`).
    sanitize = getattr(config.option, "nbval_sanitize_with", None)
    if sanitize and not Path(sanitize).is_absolute() and not Path(sanitize).exists():
        candidate = Path(config.rootpath, sanitize)
        if candidate.exists():
            config.option.nbval_sanitize_with = str(candidate)


def _is_nbval_file(node: pytest.Collector | pytest.Item) -> bool:
    return type(node).__name__ == "IPyNbFile" and type(node).__module__.startswith("nbval")


def pytest_collectstart(collector: pytest.Collector) -> None:
    if _is_nbval_file(collector):
        missing = tuple(k for k in NBVAL_SKIP_COMPARE if k not in collector.skip_compare)
        collector.skip_compare = tuple(collector.skip_compare) + missing


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _is_nbval_file(item.parent) and hasattr(item, "output_timeout"):
            item.output_timeout = max(item.output_timeout, NBVAL_OUTPUT_TIMEOUT_S)
