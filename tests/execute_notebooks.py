"""Re-execute the book's notebooks and save them with fresh outputs (`make execute`).

    python tests/execute_notebooks.py                  # every notebook under book/
    python tests/execute_notebooks.py book/01_*.ipynb  # just these

Each notebook runs top to bottom in a fresh kernel of *this* interpreter (the
project's virtual environment), in its own folder, with the same environment that
`make test` gives nbval kernels (see conftest.py): PYTHONHASHSEED=0 and matplotlib's
inline backend. The result is written to a temporary file next to the notebook and
moved over the original only if every cell succeeded, so a failed run never leaves a
half-executed notebook behind. Exit status: 0 if all notebooks succeeded, 1 otherwise.

This is a script, not a test module: pytest only collects test_*.py files.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from ipykernel.kernelspec import RESOURCES, get_kernel_dict
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

REPO = Path(__file__).resolve().parent.parent
BOOK = REPO / "book"
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
RAISES_MARKER = "NBVAL_RAISES_EXCEPTION"
RAISES_TAG = "raises-exception"


class _ThisInterpreterKernels(KernelSpecManager):
    """Resolve every kernel name to an ipykernel running on sys.executable.

    A notebook says `python3`, which Jupyter would look up among installed kernel
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


def execute(path: Path, timeout: int) -> None:
    """Execute one notebook; replace it only on success (raises on failure)."""
    nb = nbformat.read(path, as_version=4)
    original_tags = _tag_expected_errors(nb)
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    km = KernelManager(kernel_name="python3", kernel_spec_manager=_ThisInterpreterKernels())
    client = NotebookClient(
        nb,
        km=km,
        timeout=timeout,
        kernel_name="python3",
        allow_errors=False,
        record_timing=False,  # no timestamps in the saved metadata: clean diffs
        store_widget_state=True,  # the HTML book renders widgets from this state
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    _restore_tags(nb, original_tags)
    nbformat.validate(nb)
    _write_atomically(nb, path)


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

    failed = []
    for path in notebooks:
        if not path.is_file() or path.suffix != ".ipynb":
            print(f"FAILED {path}: not a notebook file", file=sys.stderr)
            failed.append(path)
            continue
        shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
        print(f"executing {shown} ...", flush=True)
        start = time.perf_counter()
        try:
            execute(path, args.timeout)
        except (CellExecutionError, CellTimeoutError, DeadKernelError) as exc:
            print(f"FAILED {shown} (left unchanged):\n{exc}", file=sys.stderr)
            failed.append(path)
        except Exception as exc:  # kernel start-up, unreadable notebook, ...
            print(f"FAILED {shown} (left unchanged): {type(exc).__name__}: {exc}", file=sys.stderr)
            failed.append(path)
        else:
            print(f"  saved in {time.perf_counter() - start:.1f} s", flush=True)

    if failed:
        print(f"{len(failed)} of {len(notebooks)} notebook(s) failed; originals kept.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
