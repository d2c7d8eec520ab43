"""linattn_lib.results: the one loader of the book's committed results.

Order: ./results/<name>, ./book/results/<name> (relative to the working directory: where a
re-run writes), then the results shipped with the package (here, an editable install: the
checkout's book/results; tests/test_packaging.py checks the wheel's copy from a fresh venv).
Nothing is downloaded; a result that exists nowhere is a FileNotFoundError that says where it
looked and how to make the file.
"""
from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from linattn_lib import results as R
from linattn_lib.experiments import mqar

REPO = Path(__file__).resolve().parents[1]
COMMITTED = sorted(p.relative_to(REPO / "book" / "results").as_posix()
                   for p in (REPO / "book" / "results").rglob("*.json") if not p.name.endswith("-quick.json"))


@pytest.fixture
def empty_cwd(tmp_path, monkeypatch):
    """An empty working directory outside the repository; no network either."""
    monkeypatch.chdir(tmp_path)

    def no_network(*args, **kwargs):
        raise AssertionError("linattn_lib.results must not download anything")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)
    return tmp_path


def _write(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload))
    return path


def test_committed_results_exist():
    assert {"mqar.json", "charlm.json", "complexity_cpu.json", "crossover_cpu.json"} <= set(COMMITTED)


def test_local_results_come_first(empty_cwd):
    """A re-run written to ./book/results beats the shipped copy, and ./results beats both."""
    shipped = R.load_result("mqar.json")
    _write(empty_cwd / "book" / "results" / "mqar.json", {"from": "book/results"})
    assert R.load_result("mqar.json") == {"from": "book/results"}
    assert R.result_path("mqar.json") == empty_cwd / "book" / "results" / "mqar.json"
    _write(empty_cwd / "results" / "mqar.json", {"from": "results"})
    assert R.load_result("mqar.json") == {"from": "results"}
    assert shipped != {"from": "results"} and "meta" in shipped


def test_falls_back_to_the_shipped_results(empty_cwd):
    """From a directory without results: every committed result loads, from the package's copy."""
    for name in COMMITTED:
        path = R.result_path(name)
        assert path is not None, name
        assert empty_cwd not in Path(str(path)).parents
        assert R.load_result(name) == json.loads((REPO / "book" / "results" / name).read_text()), name
    assert set(COMMITTED) <= set(R.list_results())
    assert R.load_result("mqar.json")["meta"]["command"].startswith("python -m linattn_lib.experiments.mqar")


def test_missing_result_names_the_file_the_places_and_the_command(empty_cwd):
    with pytest.raises(FileNotFoundError) as info:
        R.load_result("complexity_cuda.json")
    message = str(info.value)
    assert "'complexity_cuda.json' not found" in message
    assert str(empty_cwd / "results" / "complexity_cuda.json") in message
    assert str(empty_cwd / "book" / "results" / "complexity_cuda.json") in message
    assert "shipped with linattn_lib" in message or "editable install" in message
    assert "python -m linattn_lib.experiments.complexity --out book/results/complexity_cuda.json" in message
    assert R.result_path("complexity_cuda.json") is None


def test_unknown_result_lists_the_known_ones(empty_cwd):
    with pytest.raises(FileNotFoundError, match=r"no command of the book creates 'nope\.json'.*mqar\.json"):
        R.load_result("nope.json")


def test_default_instead_of_an_error(empty_cwd):
    assert R.load_result("complexity_cuda.json", default=None) is None
    assert R.load_result("nope.json", default={}) == {}
    assert R.load_result("mqar.json", default=None)["meta"]


def test_commands_of_committed_results():
    for name in COMMITTED:
        command = R.command_for(name)
        assert command and command.startswith("python -m linattn_lib."), name
    assert R.command_for("bench/sweep-cpu.json").endswith("--out book/results/bench")


@pytest.mark.parametrize("name", sorted(R.COMMANDS))
def test_every_command_names_a_module_that_exists(name):
    """The commands the error message recommends run modules of this library (they move)."""
    import importlib.util

    module = R.COMMANDS[name].split()[2]
    assert R.COMMANDS[name].startswith("python -m ") and importlib.util.find_spec(module) is not None, module


@pytest.mark.parametrize("name,exc", [("../mqar.json", ValueError), ("/etc/passwd", ValueError),
                                      ("book/results/mqar.json", ValueError), ("", TypeError), (None, TypeError)])
def test_bad_names(name, exc):
    with pytest.raises(exc, match="load_result: `name`"):
        R.load_result(name)


def test_no_download_left():
    """The package ships its results: no URL to fetch them from, no second loader."""
    assert not any(hasattr(mqar, n) for n in ("RESULTS_URL", "results_path", "load_results"))
    assert "urllib.request" not in Path(R.__file__).read_text()
