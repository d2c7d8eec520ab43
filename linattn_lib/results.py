"""The book's committed results (book/results/*.json): one loader for every chapter.

    from linattn_lib.results import load_result
    mqar = load_result("mqar.json")
    gpu = load_result("complexity_cuda.json", default=None)  # None when there is none

Where a result is looked for, in order:

1. ``./results/<name>`` and ``./book/results/<name>``, relative to the working directory:
   where a reader who re-ran an experiment's command wrote it (the notebooks run in book/,
   the commands from the repository root), so a fresh run always wins over the committed one;
2. the results shipped with the package: the wheel installs book/results as the data-only
   package ``linattn_lib._results`` (see setup.py), read with importlib.resources. An
   editable install (``pip install -e .``) has no copy: there the data is the checkout's
   own book/results, found through the install's PEP 610 record (direct_url.json) of the
   checkout this very package was imported from; a checkout used without an install
   (PYTHONPATH, as on the GPU machine) reads its own book/results.

Nothing is downloaded: an installed copy (Colab included) carries the results with it. When
neither place has the file, `load_result` raises FileNotFoundError naming the file, every
place searched, and the command that creates it.
"""
from __future__ import annotations

import importlib.metadata
import importlib.resources
import json
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote, urlparse

__all__ = ["COMMANDS", "command_for", "list_results", "load_result", "result_path"]

DATA_PACKAGE = "linattn_lib._results"
# the folder setup.py installs as DATA_PACKAGE, relative to the project root
SOURCE_DIR = PurePosixPath("book") / "results"
LOCAL_DIRS = (Path("results"), Path("book") / "results")  # relative to the working directory
DISTRIBUTION = "linattn-lib"

# the command that (re)creates each committed result, run from the repository root
COMMANDS = {
    "mqar.json": "python -m linattn_lib.experiments.mqar --out book/results/mqar.json",
    "mqar_zoology.json": "python -m linattn_lib.experiments.mqar --task zoology --kinds softmax hybrid linear"
                         " performer cosformer retnet ssd gla deltanet gated_deltanet --state-kinds softmax hybrid"
                         " linear performer cosformer retnet ssd gla deltanet gated_deltanet --d-models 16 32 64"
                         " --d-model 32 --pairs 2 4 8 --seq-len 32 --vocab-size 256 --batch-size 24 --steps 2000"
                         " --lrs 3e-3 1e-2 --fallback-lr 1e-3 --seeds 0 1 2 --jobs 1"
                         " --out book/results/mqar_zoology.json",
    "mqar_additive.json": "python -m linattn_lib.experiments.mqar --task zoology --kinds deltanet --state-kinds"
                          " deltanet --d-models 16 32 64 --d-model 32 --pairs 2 4 8 --seq-len 32 --vocab-size 256"
                          " --batch-size 24 --steps 2000 --lrs 3e-3 1e-2 --fallback-lr 1e-3 --seeds 0 1 2"
                          " --write additive --out book/results/mqar_additive.json",
    "mqar_conv.json": "python -m linattn_lib.experiments.mqar_conv --out book/results/mqar_conv.json",
    "charlm.json": "python -m linattn_lib.experiments.charlm --out book/results/charlm.json",
    "hybrid_mqar.json": "python -m linattn_lib.experiments.hybrid --task mqar --out book/results/hybrid_mqar.json",
    "hybrid_charlm.json": "python -m linattn_lib.experiments.hybrid --task charlm"
                          " --out book/results/hybrid_charlm.json",
    "hybrid_decode.json": "python -m linattn_lib.experiments.hybrid --task decode"
                          " --out book/results/hybrid_decode.json",
    "convert.json": "python -m linattn_lib.experiments.convert --out book/results/convert.json",
    "convert_teacher.pt": "python -m linattn_lib.experiments.convert --out book/results/convert.json"
                          "  (trains the teacher when the file is missing)",
    "complexity_cpu.json": "python -m linattn_lib.experiments.complexity --out book/results/complexity_cpu.json",
    "complexity_cuda.json": "python -m linattn_lib.experiments.complexity --out book/results/complexity_cuda.json"
                            "  (on a machine with a CUDA GPU)",
    "crossover_cpu.json": "python -m linattn_lib.experiments.crossover --out book/results/crossover_cpu.json",
    "bench/": "python -m linattn_lib.experiments.bench --out book/results/bench",
    "gpu/": "python -m linattn_lib.experiments.gpu_check --out book/results/gpu --budget-s 330"
            "  (on a machine with a CUDA GPU, from the checkout's root with PYTHONPATH=.; README, 'On a GPU');"
            " gpu_check_resumed.*: the same with --budget-s 360 --fla-workers 0"
            " --resume book/results/gpu/gpu_check.json, renamed; gpu_refit.json: python -m"
            " linattn_lib.experiments.perf_predictions --calibrate --measured book/results/gpu/gpu_check.json"
            " book/results/gpu/gpu_check_resumed.json --out book/results/gpu/gpu_refit.json",
    "perf_model.json": "python -m linattn_lib.experiments.perf_predictions --out book/results/perf_model.json"
                       "  (with LINATTN_FLA_SOURCE pointing at a checkout of flash-linear-attention)",
    "published_h100.json": "python -m linattn_lib.experiments.perf_predictions --published <git dir of"
                           " pytorch/helion> --out book/results/published_h100.json  (with LINATTN_FLA_SOURCE"
                           " pointing at a checkout of flash-linear-attention, for its registry)",
    "perf_calibration.json": "python -m linattn_lib.experiments.perf_predictions --calibrate"
                             " --out book/results/perf_calibration.json  (with LINATTN_FLA_SOURCE pointing at a"
                             " checkout of flash-linear-attention)",
}

_MISSING = object()


def _check_name(fn: str, name: str) -> PurePosixPath:
    if not isinstance(name, str) or not name:
        raise TypeError(f"{fn}: `name` must be a file name such as 'mqar.json', got {name!r}")
    rel = PurePosixPath(name.replace("\\", "/"))
    if rel.is_absolute() or ".." in rel.parts or rel.parts[0] in ("results", "book"):
        raise ValueError(f"{fn}: `name` is a file name inside book/results, such as 'mqar.json' or "
                         f"'bench/sweep-cpu.json'; got {name!r}")
    return rel


def _editable_source() -> Path | None:
    """The checkout's book/results when this package is an editable install of it, else None.

    pip records the source folder of an install in the distribution's direct_url.json
    (PEP 610); it counts only when it is the folder this module was imported from. (Every
    linattn-lib distribution on sys.path is asked: a checkout on sys.path, e.g. under pytest,
    also shows its build's linattn_lib.egg-info, which has no such record.)
    """
    here = Path(__file__).resolve().parent
    for dist in importlib.metadata.distributions(name=DISTRIBUTION):
        try:
            info = json.loads(dist.read_text("direct_url.json") or "{}")
        except (ValueError, OSError):
            continue
        url = urlparse(info.get("url", ""))
        if not info.get("dir_info", {}).get("editable") or url.scheme != "file":
            continue
        root = Path(unquote(url.path))
        try:
            if root.resolve() / "linattn_lib" == here and (root / SOURCE_DIR).is_dir():
                return root / SOURCE_DIR
        except OSError:
            continue
    return None


def _shipped() -> tuple[str, Any]:
    """(description, folder) of the results that came with the package; folder is an
    importlib.resources Traversable (a Path in practice), or None when there are none."""
    try:
        return "the results shipped with linattn_lib", importlib.resources.files(DATA_PACKAGE)
    except (ModuleNotFoundError, TypeError):  # not installed from a wheel: editable, or a bare checkout
        pass
    source = _editable_source()
    if source is not None:
        return "the checkout's results (editable install)", source
    root = Path(__file__).resolve().parent.parent  # a checkout on sys.path (PYTHONPATH), not installed
    if (root / "pyproject.toml").is_file() and (root / SOURCE_DIR).is_dir():
        return "the results of the checkout linattn_lib was imported from", root / SOURCE_DIR
    return f"the results shipped with linattn_lib (no package {DATA_PACKAGE} here: not installed from a wheel)", None


def _places(rel: PurePosixPath) -> list:
    """(description, candidate) in search order; candidate is a Path, a Traversable or None."""
    places = [(str(Path.cwd() / base / rel), Path.cwd() / base / rel) for base in LOCAL_DIRS]
    what, shipped = _shipped()
    if shipped is None:
        return places + [(what, None)]
    candidate = shipped
    for part in rel.parts:  # one part at a time: Python 3.10's MultiplexedPath takes one
        candidate = candidate / part
    return places + [(f"{what}: {candidate}", candidate)]


def result_path(name: str) -> Path | None:
    """The file `load_result(name)` reads, or None when the result exists nowhere."""
    for _, candidate in _places(_check_name("result_path", name)):
        if candidate is not None and candidate.is_file():
            return candidate if isinstance(candidate, Path) else Path(str(candidate))
    return None


def command_for(name: str) -> str | None:
    """The command that creates result `name`, when the book has one."""
    rel = _check_name("command_for", name)
    return COMMANDS.get(str(rel)) or COMMANDS.get(f"{rel.parts[0]}/" if len(rel.parts) > 1 else "")


def load_result(name: str, default: Any = _MISSING) -> Any:
    """The committed (or freshly re-run) result `name` of book/results, parsed from JSON.

    `name` is a file name inside book/results: "mqar.json", "bench/sweep-cpu.json". The
    working directory's results/ and book/results/ come first, then the copy shipped with
    the package. With `default` given, a result that exists nowhere returns it; without,
    that raises FileNotFoundError naming the file, every place searched and the command that
    creates the file.
    """
    rel = _check_name("load_result", name)
    places = _places(rel)
    for _, candidate in places:
        if candidate is not None and candidate.is_file():
            return json.loads(candidate.read_text(encoding="utf-8"))
    if default is not _MISSING:
        return default
    searched = "\n".join(f"  - {where}" for where, _ in places)
    command = command_for(name)
    how = (f"create it with (from the repository root):\n  {command}" if command
           else f"no command of the book creates {name!r}; the known results are: {', '.join(list_results()) or 'none'}")
    raise FileNotFoundError(f"result {name!r} not found; searched, in order:\n{searched}\n{how}")


def list_results() -> list[str]:
    """The names `load_result` can load here (local runs and shipped results), sorted."""
    names = set()

    def walk(folder, prefix=""):
        try:
            entries = list(folder.iterdir())
        except (OSError, FileNotFoundError):
            return
        for entry in entries:
            if entry.is_dir():
                if entry.name != "__pycache__":
                    walk(entry, f"{prefix}{entry.name}/")
            elif entry.name.endswith(".json"):
                names.add(prefix + entry.name)

    for base in LOCAL_DIRS:
        if (Path.cwd() / base).is_dir():
            walk(Path.cwd() / base)
    _, shipped = _shipped()
    if shipped is not None and shipped.is_dir():
        walk(shipped)
    return sorted(names)
