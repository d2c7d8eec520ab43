"""The public API: every exported name has a docstring and a row in the README's table."""
import inspect
import re
from pathlib import Path

import linattn_lib

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_public_name_is_documented():
    for name in linattn_lib.__all__:
        obj = getattr(linattn_lib, name)
        assert inspect.getdoc(obj), f"{name} has no docstring"


def test_readme_table_lists_exactly_the_public_names():
    text = README.read_text()
    api_table = text[text.index("## Public API") : text.index("Modules beside the public names")]
    rows = re.findall(r"^\| `([A-Za-z_0-9]+)` \|", api_table, flags=re.M)
    assert sorted(rows) == sorted(linattn_lib.__all__)


def test_readme_module_table_names_modules_that_exist():
    import importlib

    text = README.read_text()
    table = text[text.index("Modules beside the public names"):]
    first_cells = re.findall(r"^\| (`[^|]*`) \|", table, flags=re.M)
    names = [n for cell in first_cells for n in re.findall(r"`([a-z_.]+)(?:\.\*)?`", cell)]
    assert len(names) >= 10
    for name in names:
        importlib.import_module(f"linattn_lib.{name}")
