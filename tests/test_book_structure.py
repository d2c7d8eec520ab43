"""Static checks of the book's sources (fast, no browser, no kernel).

* Every notebook in the book starts with the Colab bootstrap cell: a code cell with no
  outputs that installs the library from the repository configured in `_config.yml` when it
  runs on Colab, and does nothing anywhere else (it is executed here to check that).
* Every chapter cites primary sources with {cite}, and every cited key is in references.bib.
* Saved outputs carry no progress-bar noise (tqdm bars, carriage-return redraws).
* Every chapter notebook in book/ is in the table of contents, and every entry exists.
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
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3", f"{path.name}: the kernel spec must be python3"
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
