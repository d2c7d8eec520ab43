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
