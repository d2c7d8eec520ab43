"""Static checks of the book's sources (fast, no browser, no kernel).

* Every notebook in the book starts with the Colab bootstrap cell: a code cell with no
  outputs that installs the library from the repository configured in `_config.yml` when it
  runs on Colab, and does nothing anywhere else (it is executed here to check that).
* Every chapter cites primary sources with {cite}, and every cited key is in references.bib.
* Saved outputs carry no progress-bar noise (tqdm bars, carriage-return redraws).
* Every chapter notebook in book/ is in the table of contents, and every entry exists.
* The API reference (book/api.md) documents every name of `linattn_lib.__all__` with autodoc.
* The repository URL is kept in one place (`_config.yml`); everything else that writes it
  agrees, and `tests/repository_url.py` (`make repo-url`) changes all of them.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
CONFIG = yaml.safe_load((ROOT / "_config.yml").read_text())
NOTEBOOKS = sorted(BOOK.glob("*.ipynb"))
CHAPTERS = [nb for nb in NOTEBOOKS if re.match(r"\d\d_", nb.name)]
BIB_KEYS = set(re.findall(r"^@\w+\{([^,\s]+),", (BOOK / "references.bib").read_text(), re.M))
CITE = re.compile(r"\{cite(?::[a-z]+)?\}`([^`]+)`")
PROGRESS = re.compile(r"\d+%\|[^\n]*\|\s*\d+/\d+|\d+(?:\.\d+)?\s*(?:it/s|s/it)\]|\r(?!\n)")


def _toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]]

    def walk(entries):
        for entry in entries or []:
            if "file" in entry:
                files.append(entry["file"])
            walk(entry.get("sections"))
            walk(entry.get("chapters"))

    walk(toc.get("chapters"))
    for part in toc.get("parts", []):
        walk(part.get("chapters"))
    return files


def _ids(paths):
    return [p.name for p in paths]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_first_cell_installs_the_library_on_colab_only(path):
    nb = nbformat.read(path, as_version=4)
    first = nb.cells[0]
    assert first.cell_type == "code", f"{path.name}: the first cell must be the Colab bootstrap (code)"
    assert not first.get("outputs"), f"{path.name}: the Colab cell must have no saved output"
    source = first.source
    assert '"google.colab" in sys.modules' in source, f"{path.name}: the install must be guarded by google.colab"
    url = CONFIG["repository"]["url"].rstrip("/")
    assert f"git+{url}" in source, f"{path.name}: the Colab cell must install git+{url} (repository.url in _config.yml)"
    spec = nb.metadata.get("kernelspec", {})
    assert (spec.get("name"), spec.get("language")) == ("linattn", "python"), \
        f"{path.name}: the kernel spec must be the project's ('linattn', registered by make install), got {spec}"
    # Harmless elsewhere: outside Colab the cell runs and does nothing.
    namespace: dict = {}
    exec(compile(source, f"{path.name}[0]", "exec"), namespace)  # noqa: S102 - the book's own cell


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_test_scaffolding_stays_off_the_page(path):
    """The reader sees neither the Colab bootstrap (tagged remove-cell: the HTML drops it,
    Colab and JupyterLab still run it) nor nbval's markers (cell tags, not comments in the
    code)."""
    nb = nbformat.read(path, as_version=4)
    assert "remove-cell" in nb.cells[0].metadata.get("tags", []), f"{path.name}: tag the Colab cell remove-cell"
    marked = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and "NBVAL_" in c.source]
    assert not marked, f"{path.name}: cells {marked} carry an nbval comment; use a tag (nbval-ignore-output, ...)"


@pytest.mark.parametrize("path", CHAPTERS, ids=_ids(CHAPTERS))
def test_chapter_cites_primary_sources(path):
    nb = nbformat.read(path, as_version=4)
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    keys = {k.strip() for group in CITE.findall(text) for k in group.split(",")}
    assert keys, f"{path.name} cites no source with {{cite}}"
    assert keys <= BIB_KEYS, f"{path.name} cites keys missing from references.bib: {sorted(keys - BIB_KEYS)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_outputs_have_no_progress_bars(path):
    nb = nbformat.read(path, as_version=4)
    noisy = []
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            texts = [out.get("text", "")] if out.get("output_type") == "stream" else \
                [v for k, v in out.get("data", {}).items() if k in ("text/plain", "text/html")]
            for text in texts:
                text = "".join(text) if isinstance(text, list) else text
                if PROGRESS.search(text) or "tqdm" in text:
                    noisy.append(i)
    assert not noisy, f"{path.name}: progress-bar output saved in cells {sorted(set(noisy))}"


def test_toc_lists_every_chapter_and_only_existing_files():
    files = _toc_files()
    missing = [f for f in files if not any((ROOT / f"{f}{ext}").exists() for ext in (".md", ".ipynb"))]
    assert not missing, f"_toc.yml lists files that do not exist: {missing}"
    unlisted = [nb.name for nb in CHAPTERS if f"book/{nb.stem}" not in files]
    assert not unlisted, f"chapter notebooks missing from _toc.yml: {unlisted}"


def _public_names() -> list[str]:
    """`linattn_lib.__all__`, read from the source (importing the library would take seconds)."""
    import ast

    tree = ast.parse((ROOT / "linattn_lib" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("linattn_lib/__init__.py defines no __all__")


def test_api_reference_documents_every_public_name():
    """book/api.md holds one autodoc directive per name of `linattn_lib.__all__` (the build then
    fails on a name that does not import or a docstring that does not render), and the API
    reference and the quickstart are in the table of contents."""
    text = (BOOK / "api.md").read_text()
    documented = re.findall(r"^\.\. auto(?:function|class):: linattn_lib\.(\w+)$", text, re.M)
    names = _public_names()
    twice = sorted({n for n in documented if documented.count(n) > 1})
    assert not twice, f"book/api.md documents these names twice: {twice}"
    assert sorted(documented) == sorted(names), (
        f"book/api.md: missing {sorted(set(names) - set(documented))}, "
        f"not public {sorted(set(documented) - set(names))}"
    )
    files = _toc_files()
    assert "book/api" in files and "book/quickstart" in files, "add book/api and book/quickstart to _toc.yml"


def _repository_url_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("repository_url", ROOT / "tests" / "repository_url.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_repository_url_is_written_in_one_place():
    """_config.yml's repository.url is the one source: every notebook's Colab cell, the README,
    the introduction and pyproject.toml carry the same URL (`make repo-url URL=...` sets all)."""
    ru = _repository_url_module()
    url = ru.configured_url()
    places = ru.found()
    files = {name for name, _ in places}
    expected = {str(p.relative_to(ROOT)) for p in NOTEBOOKS} | {"README.md", "book/intro.md", "pyproject.toml"}
    assert files == expected, f"URL places: missing {sorted(expected - files)}, unexpected {sorted(files - expected)}"
    wrong = [(name, u) for name, u in places if u != url]
    assert not wrong, f"these do not use _config.yml's {url}: {wrong}"


def test_repository_url_can_be_changed_everywhere(tmp_path, monkeypatch):
    import shutil

    ru = _repository_url_module()
    for name in ["_config.yml", "README.md", "pyproject.toml", "book/intro.md", *(f"book/{p.name}" for p in NOTEBOOKS)]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, tmp_path / name)
    monkeypatch.setattr(ru, "ROOT", tmp_path)
    monkeypatch.setattr(ru, "CONFIG", tmp_path / "_config.yml")
    new = "https://gitlab.example.org/someone/la-fork"
    changed = ru.set_url(new + "/")
    assert ru.configured_url() == new and {u for _, u in ru.found()} == {new}
    assert len(changed) == len(NOTEBOOKS) + 4
    assert "cd la-fork\n" in (tmp_path / "book/intro.md").read_text()
    cell = nbformat.read(tmp_path / "book" / NOTEBOOKS[0].name, as_version=4).cells[0].source
    assert f'url = "git+{new}"' in cell
    assert yaml.safe_load((tmp_path / "_config.yml").read_text())["repository"]["url"] == new
