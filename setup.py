"""What goes into the wheel; the metadata (name, version, dependencies) is in pyproject.toml.

pyproject.toml alone cannot combine automatic package discovery with folders that live
outside linattn_lib/, so the packages are listed here:

* every package under linattn_lib/ (any folder with an __init__.py), found automatically;
* the Triton kernels, the top-level kernels/ folder, installed as linattn_lib.kernels (a
  top-level name "kernels" would collide with other projects), with any subpackages;
* the book's committed results, book/results/** (JSON, the benchmark plots and chapter 11's
  teacher weights, *.pt), installed as
  the data-only package linattn_lib._results, which `linattn_lib.results.load_result` reads.
  Quick runs (*-quick.json, git-ignored) stay out.

tests/test_packaging.py builds the wheel and checks that all of these are in it.
"""
from setuptools import find_namespace_packages, find_packages, setup

KERNELS = "kernels"  # -> linattn_lib.kernels
RESULTS = "book/results"  # -> linattn_lib._results (keep in step with linattn_lib/results.py)

kernels = ["linattn_lib.kernels"] + [f"linattn_lib.kernels.{p}" for p in find_packages(KERNELS)]
results = ["linattn_lib._results"] + [
    f"linattn_lib._results.{p}" for p in find_namespace_packages(RESULTS, exclude=["*__pycache__*"])
]

setup(
    packages=find_packages(include=["linattn_lib", "linattn_lib.*"]) + kernels + results,
    package_dir={"linattn_lib.kernels": KERNELS, "linattn_lib._results": RESULTS},
    package_data={p: ["*.json", "*.png", "*.pt"] for p in results},
    exclude_package_data={p: ["*-quick.json"] for p in results},
)
