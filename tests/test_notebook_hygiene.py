"""What a reader sees of a notebook: lines that fit the page, no printed round-off, and
markup that renders.

* Code and text outputs fit in 80 columns, the width of the book's text column (wider
  lines scroll sideways in the HTML).
* No output prints a magnitude of 1e-10 or below: at that size a number is round-off,
  which differs between CPUs and thread counts. Bounds are printed as powers of ten
  (`linattn_lib.measure.below`: "< 10⁻¹²").
* A backtick fence cannot open with a title that contains backticks (CommonMark): such an
  admonition renders as raw text, and neither Sphinx's -W nor the browser notices. Colon
  fences (`:::{admonition}`) can.
* Every code cell was run when the notebook was saved (an execution count): a cell added
  or edited by hand and saved unrun has outputs that no run produced.
* Code cells compile without a SyntaxWarning (an invalid escape in a non-raw string warns on
  Python 3.12+, which Colab runs).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

BOOK = Path(__file__).resolve().parent.parent / "book"
NOTEBOOKS = sorted(BOOK.glob("*.ipynb"))
WIDTH = 80
TINY = re.compile(r"\de-(?:1\d|[2-9]\d)")
BAD_FENCE = re.compile(r"^\s*```+\s*\{[^}]+\}.*`")


def _cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def _text(output: dict) -> str:
    if output.get("output_type") == "error":
        return "\n".join(output.get("traceback", []))
    return "".join(output.get("text", "")) + "".join(output.get("data", {}).get("text/plain", ""))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_code_and_outputs_fit_in_80_columns(path):
    wide = []
    for i, cell in enumerate(_cells(path)):
        if cell["cell_type"] != "code":
            continue
        lines = "".join(cell["source"]).splitlines()
        lines += [ln for out in cell.get("outputs", []) for ln in _text(out).splitlines()]
        wide += [f"cell {i}: {len(ln)} chars: {ln[:60]}..." for ln in lines if len(ln) > WIDTH]
    assert not wide, f"{path.name}: {len(wide)} lines over {WIDTH} characters:\n" + "\n".join(wide[:20])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_printed_round_off(path):
    tiny = [
        f"cell {i}: {ln.strip()[:70]}"
        for i, cell in enumerate(_cells(path)) if cell["cell_type"] == "code"
        for out in cell.get("outputs", []) for ln in _text(out).splitlines() if TINY.search(ln)
    ]
    assert not tiny, f"{path.name}: print a bound (measure.below), not round-off:\n" + "\n".join(tiny)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_admonition_titles_render(path):
    bad = [
        f"cell {i}: {ln.strip()[:70]}"
        for i, cell in enumerate(_cells(path)) if cell["cell_type"] == "markdown"
        for ln in "".join(cell["source"]).splitlines() if BAD_FENCE.match(ln)
    ]
    assert not bad, f"{path.name}: use a colon fence (:::{{admonition}}) for these:\n" + "\n".join(bad)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_code_compiles_without_syntax_warnings(path):
    """Every code cell compiles with SyntaxWarning as an error: Python 3.12+ (Colab's) warns on
    an invalid escape such as "$\\gamma$" in a non-raw string, under the reader's cell."""
    import warnings

    bad = []
    for i, cell in enumerate(_cells(path)):
        if cell["cell_type"] != "code":
            continue
        lines = "".join(cell["source"]).split("\n")
        source = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in lines)
        with warnings.catch_warnings():
            warnings.simplefilter("error", SyntaxWarning)
            try:
                compile(source, f"{path.name} cell {i}", "exec")
            except SyntaxError as err:  # a SyntaxWarning raised as an error arrives as one
                bad.append(f"cell {i}: {err}")
    assert not bad, bad


# Figures (the reading rules): one numbering, "**Figure N.k.**" in a markdown cell right
# after the figure's cell (N: the chapter's number, A for appendix A, EN for chapter N's
# errata computations), one figure per cell; text of at least 10 pt and figures at most
# 9.5 inches wide (at the book's ~690-px column that keeps rendered text at 10 px or more;
# test_browser.py measures the rendered scale).
_REMOVED = {"remove-output", "remove_output", "remove-cell", "remove_cell"}
_BEFORE_IMAGES = ("application/vnd.jupyter.widget-view+json", "application/javascript", "text/html")
CHAPTER_CODE = sorted((BOOK.parent / "linattn_lib" / "chapters").glob("*.py"))
SMALL_FONT = re.compile(r"fontsize\s*=\s*(?:(\d+(?:\.\d+)?)|[\"'](?:x+-)?small[\"'])")
WIDE_FIGURE = re.compile(r"figsize\s*=\s*\(\s*(\d+(?:\.\d+)?)\s*,")
MAX_FIGURE_INCHES = 9.5  # linattn_lib.chapters.plots.MAX_FIGURE_INCHES


def _figure_prefix(path: Path) -> str | None:
    if m := re.match(r"(\d\d)_", path.name):
        return str(int(m.group(1)))
    if m := re.match(r"errata_ch(\d\d)", path.name):
        return f"E{int(m.group(1))}"
    return "A" if path.name == "appendix_kernels.ipynb" else None


def _figures_shown(cell: dict) -> int:
    if _REMOVED & set(cell.get("metadata", {}).get("tags", [])):
        return 0
    n = 0
    for out in cell.get("outputs", []):
        data = out.get("data", {})
        shown = next((m for m in _BEFORE_IMAGES if m in data), None)
        html = "".join(data.get("text/html", ""))
        n += (shown is None and any(m.startswith("image/") for m in data)) or "linattn-slider" in html
    return n


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if _figure_prefix(p)], ids=lambda p: p.name)
def test_figures_are_numbered_and_captioned(path):
    prefix, k, problems = _figure_prefix(path), 0, []
    cells = _cells(path)
    for i, cell in enumerate(cells):
        n = _figures_shown(cell) if cell["cell_type"] == "code" else 0
        if n == 0:
            continue
        k += 1
        nxt = cells[i + 1] if i + 1 < len(cells) else None
        caption = "".join(nxt["source"]).lstrip() if nxt and nxt["cell_type"] == "markdown" else ""
        if n > 1:
            problems.append(f"cell {i} shows {n} figures (one figure per cell)")
        if not caption.startswith(f"**Figure {prefix}.{k}.**"):
            problems.append(f"cell {i}: the next cell must start with **Figure {prefix}.{k}.**")
    assert not problems, f"{path.name}: {problems}"


@pytest.mark.parametrize("path", NOTEBOOKS + CHAPTER_CODE, ids=lambda p: p.name)
def test_figure_text_is_readable(path):
    if path.suffix == ".ipynb":
        source = "\n".join("".join(c["source"]) for c in _cells(path) if c["cell_type"] == "code")
    else:
        source = path.read_text(encoding="utf-8")
    small = [m.group(0) for m in SMALL_FONT.finditer(source) if not m.group(1) or float(m.group(1)) < 10]
    wide = [m.group(0) for m in WIDE_FIGURE.finditer(source) if float(m.group(1)) > MAX_FIGURE_INCHES]
    assert not small, f"{path.name}: text below 10 pt: {small}"
    assert not wide, f"{path.name}: figures wider than {MAX_FIGURE_INCHES} inches: {wide}"


def test_every_method_has_one_colour_and_one_label():
    """Figures name a method as the prose does ("Gated DeltaNet"), never by its identifier."""
    from linattn_lib.chapters.plots import METHOD_COLORS, METHOD_LABELS, method_label

    assert METHOD_LABELS.keys() == METHOD_COLORS.keys()
    assert method_label("gated_deltanet") == "Gated DeltaNet"
    assert method_label(" Mamba-2 ") == "SSD (Mamba-2)"  # an alias, as method_color takes it
    with pytest.raises(KeyError, match="no colour"):
        method_label("gated-deltanet")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_code_cell_was_run(path):
    unrun = [i for i, cell in enumerate(_cells(path))
             if cell["cell_type"] == "code" and cell.get("execution_count") is None]
    assert not unrun, (f"{path.name}: code cells {unrun} have no execution count (saved unrun): "
                       f"re-execute it (make execute NB=book/{path.name})")
