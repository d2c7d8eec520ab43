"""The wheel holds the whole library, and an installed copy works without the repository.

* `test_wheel_holds_every_package_the_kernels_and_the_results`: the wheel built from a clean
  copy of the working tree holds every package on disk under linattn_lib/ (any folder with an
  __init__.py), every module of kernels/ as linattn_lib.kernels, and every committed results
  file of book/results as linattn_lib._results (setup.py says why it is built that way).
* `test_installed_wheel_runs_the_chapters_outside_the_repository` (about a minute on CPU):
  the wheel is installed into a fresh virtual environment and chapter 8 (the one that reads
  the most results), copied to a temporary folder outside the repository, executes there
  without error and without network -- the results it reads come from the installed package,
  as on Colab. `test_installed_copy_loads_every_result_a_page_reads` loads, from there, every
  results file any page of the book names in `load_result(...)` (chapter 7's among them: its
  full run costs as much as the rest of this file, and nbval runs it in the repository).

How the fresh environment is made without network: `python -m venv --without-pip`, then its
site-packages gets a symbolic link to every entry of this environment's site-packages
(torch, jupyter, pip, ...) except this checkout's own install of linattn_lib (the editable
finder and its .pth, dist-info, egg-links, and .pth files naming the checkout). So the new
environment sees the same third-party packages but no linattn_lib until
`pip install --no-deps --no-index <wheel>` puts the wheel's copy there. HTTP(S) proxies point
at a closed local port, so any download attempt fails at once.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import site
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CHAPTERS = ["08_experiments.ipynb"]
KERNEL_NAME = "linattn-wheel-test"
NO_NETWORK = {k: "http://127.0.0.1:9" for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")}


# --------------------------------------------------------------------------------------
# helpers (also usable from a script: build_wheel, fresh_venv, execute_notebook)
# --------------------------------------------------------------------------------------


def source_files(repo: Path = REPO) -> list[str]:
    """The files a clean checkout of the working tree has: tracked, and untracked but not
    ignored (git), or, without git, everything but the usual build and cache folders."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=repo, check=True,
                             capture_output=True).stdout.decode()
        return [f for f in out.split("\0") if f and (repo / f).is_file()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "_build", "build", "dist", "__pycache__", ".pytest_cache", "node_modules"}
        return [p.relative_to(repo).as_posix() for p in repo.rglob("*")
                if p.is_file() and not skip & set(p.relative_to(repo).parts) and ".egg-info" not in str(p)]


def build_wheel(dest: Path, repo: Path = REPO) -> Path:
    """Build the wheel from a clean copy of the working tree (an in-tree build would pick up
    stale files from an old build/ folder) with the build tools of this environment."""
    src = dest / "src"
    for rel in source_files(repo):
        if rel.endswith(".ipynb"):  # not packaged; saves copying the notebooks' outputs
            continue
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(repo / rel, src / rel)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(dest / "dist"), str(src)], capture_output=True, text=True,
                          env={**os.environ, **NO_NETWORK, "PIP_NO_INDEX": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (dest / "dist").glob("linattn_lib-*.whl")
    return wheel


def _own_install(entry: Path) -> bool:
    """Whether a site-packages entry belongs to this checkout's install of linattn_lib."""
    name = entry.name.lower()
    if name.startswith(("__editable__", "linattn_lib", "linattn-lib", "__pycache__")):
        return True
    if name.endswith((".pth", ".egg-link")):
        try:
            text = entry.read_text(errors="replace")
        except OSError:
            return True
        return str(REPO) in text or "linattn" in text
    return False


def fresh_venv(path: Path) -> Path:
    """A new virtual environment seeing this environment's packages but not its linattn_lib;
    returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    target = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 check=True, capture_output=True, text=True).stdout.strip())
    target.mkdir(parents=True, exist_ok=True)
    for sp in [Path(p) for p in site.getsitepackages()]:
        if not sp.is_dir() or sp.resolve() == target.resolve():
            continue
        for entry in sp.iterdir():
            if not _own_install(entry) and not (target / entry.name).exists():
                (target / entry.name).symlink_to(entry)
    kernel = path / "share" / "jupyter" / "kernels" / KERNEL_NAME
    kernel.mkdir(parents=True)
    (kernel / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "linattn_lib wheel test", "language": "python"}))
    return python


def venv_env(venv: Path, home: Path) -> dict:
    """The environment for the fresh venv's processes: no PYTHONPATH, no network, its own
    Jupyter and IPython folders (no user kernels or startup files)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "JUPYTER_PATH", "PIP_REQUIRE_VIRTUALENV")}
    env.update(NO_NETWORK, PIP_NO_INDEX="1", PYTHONNOUSERSITE="1", NO_PROXY="", no_proxy="",
               PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv),
               JUPYTER_PATH=str(venv / "share" / "jupyter"), JUPYTER_CONFIG_DIR=str(home / "jupyter-config"),
               JUPYTER_RUNTIME_DIR=str(home / "jupyter-runtime"), IPYTHONDIR=str(home / "ipython"),
               MPLCONFIGDIR=str(home / "matplotlib"), PYDEVD_DISABLE_FILE_VALIDATION="1")
    env.pop("MPLBACKEND", None)  # the kernel then uses the inline backend, as in Jupyter
    return env


RUN_NOTEBOOK = textwrap.dedent("""
    import sys, nbformat
    from nbclient import NotebookClient
    path, kernel = sys.argv[1], sys.argv[2]
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, kernel_name=kernel, timeout=1800, resources={"metadata": {"path": "."}}).execute()
    nbformat.write(nb, path)
    print("executed", path)
""")


def execute_notebook(python: Path, notebook: Path, env: dict) -> subprocess.CompletedProcess:
    """Execute `notebook` in place with nbclient, in its own folder, kernel from `python`'s venv."""
    return subprocess.run([str(python), "-c", RUN_NOTEBOOK, notebook.name, KERNEL_NAME], cwd=notebook.parent,
                          env=env, capture_output=True, text=True, timeout=3600)


def _wheel_names(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return set(z.namelist())


# --------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_wheel_holds_every_package_the_kernels_and_the_results(wheel):
    names = _wheel_names(wheel)
    files = source_files()
    packages = sorted({str(Path(f).parent) for f in files if f.startswith("linattn_lib/") and f.endswith("/__init__.py")})
    assert {"linattn_lib", "linattn_lib/core", "linattn_lib/nn", "linattn_lib/experiments"} <= set(packages)
    for pkg in packages:  # every package, and every module in it
        modules = [f for f in files if str(Path(f).parent) == pkg and f.endswith(".py")]
        assert set(modules) <= names, (pkg, sorted(set(modules) - names))
    kernels = [f for f in files if f.startswith("kernels/") and f.endswith(".py")]
    assert "kernels/__init__.py" in kernels and "kernels/chunk_fwd.py" in kernels
    missing = sorted(f for f in kernels if f"linattn_lib/{f}" not in names)
    assert not missing, f"kernels/ modules missing from the wheel as linattn_lib/kernels/: {missing}"
    committed = [f for f in files if f.startswith("book/results/") and f.endswith((".json", ".png", ".pt"))
                 and not f.endswith("-quick.json")]
    assert "book/results/mqar.json" in committed and "book/results/complexity_cpu.json" in committed
    shipped = {f.replace("book/results/", "linattn_lib/_results/", 1) for f in committed}
    assert shipped <= names, f"results missing from the wheel: {sorted(shipped - names)}"
    # and nothing that is not the library
    assert not [n for n in names if n.startswith(("kernels/", "tests/", "book/")) or n.endswith(("-quick.json", ".ipynb"))]


def test_gpu_check_without_cuda_says_what_did_not_run_and_fails(capsys, tmp_path):
    """No CUDA here: nothing ran -- not a success -- and nothing is written; the message names
    the rehearsal that does run on a CPU (--dry-run)."""
    import torch

    from linattn_lib.experiments import gpu_check

    if torch.cuda.is_available():
        pytest.skip("there is a CUDA device: gpu_check runs for real (python -m linattn_lib.experiments.gpu_check)")
    for argv in (["--out", str(tmp_path / "a")], ["--skip-bench", "--pytest", "tests/test_kernels_interpret.py",
                                                  "--out", str(tmp_path / "b")]):
        assert gpu_check.main(argv) == 2
        err = capsys.readouterr().err
        assert "no CUDA device" in err and "nothing ran" in err and "--dry-run" in err, err
    assert not any(tmp_path.iterdir())


def test_gpu_check_exit_status():
    from linattn_lib.experiments.gpu_check import exit_status

    assert exit_status({"a": {"status": "passed"}, "b": {"status": "skipped"}}) == 0
    assert exit_status({"a": {"status": "passed"}, "b": {"status": "not run"}}) == 2
    assert exit_status({"a": {"status": "failed"}, "b": {"status": "not run"}}) == 1


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """(python, env, home) of a fresh venv holding the wheel, its home outside the repository."""
    home = tmp_path_factory.mktemp("installed")
    assert REPO not in home.parents
    python = fresh_venv(home / "venv")
    env = venv_env(home / "venv", home)
    proc = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
                          cwd=home, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return python, env, home


def test_installed_copy_imports_and_ships_its_results(installed):
    python, env, home = installed
    code = textwrap.dedent("""
        import json, sys, linattn_lib, linattn_lib.core, linattn_lib.kernels
        from linattn_lib.results import load_result, result_path
        print(json.dumps({"package": linattn_lib.__file__, "kernels": linattn_lib.kernels.__file__,
                          "mqar": str(result_path("mqar.json")), "meta": sorted(load_result("charlm.json"))}))
    """)
    proc = subprocess.run([str(python), "-c", code], cwd=home, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    venv = (home / "venv").resolve()
    for key in ("package", "kernels", "mqar"):
        assert venv in Path(info[key]).resolve().parents and REPO not in Path(info[key]).resolve().parents, info
    assert info["mqar"].endswith("linattn_lib/_results/mqar.json") and "meta" in info["meta"]


def _results_the_pages_load() -> list[str]:
    """The file names every notebook of book/ passes to load_result("...") (those it may do
    without, `load_result(name, default=None)`, left out)."""
    names = set()
    for nb in sorted((REPO / "book").glob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        for cell in cells:
            if cell["cell_type"] == "code":
                names |= set(re.findall(r"load_result\(\s*[\"']([^\"']+)[\"']\s*\)", "".join(cell["source"])))
    return sorted(names)


def test_installed_copy_loads_every_result_a_page_reads(installed):
    python, env, home = installed
    names = _results_the_pages_load()
    assert {"mqar_zoology.json", "crossover_cpu.json", "charlm.json", "perf_model.json"} <= set(names), names
    code = textwrap.dedent("""
        import json, sys
        from linattn_lib.results import load_result, result_path
        print(json.dumps({n: [str(result_path(n)), bool(load_result(n))] for n in sys.argv[1:]}))
    """)
    proc = subprocess.run([str(python), "-c", code, *names], cwd=home, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    venv = (home / "venv").resolve()
    for name, (path, nonempty) in found.items():
        assert venv in Path(path).resolve().parents and nonempty, (name, path)


def test_installed_gpu_check_fails_without_cuda(installed):
    python, env, home = installed
    import torch

    if torch.cuda.is_available():
        pytest.skip("there is a CUDA device here")
    proc = subprocess.run([str(python), "-m", "linattn_lib.experiments.gpu_check", "--out", "gpu"], cwd=home, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA device" in proc.stderr and "nothing ran" in proc.stderr, proc.stderr


def test_installed_wheel_runs_the_chapters_outside_the_repository(installed):
    """Chapter 8, as committed, from a folder without book/results: every cell runs."""
    python, env, home = installed
    book = home / "book-copy"
    book.mkdir()
    failures = []
    for name in CHAPTERS:
        shutil.copy2(REPO / "book" / name, book / name)
        proc = execute_notebook(python, book / name, env)
        if proc.returncode != 0:
            log = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout + proc.stderr)  # no terminal colours
            failures.append(f"{name}:\n{log[-4000:]}")
    assert not (book / "results").exists() and not (book / "book").exists()
    assert not failures, "\n\n".join(failures)
