# Linear Attention, Hands-On: the README's two commands are `make book` and `make test`.
# Everything runs inside .venv, which is created (from $(PYTHON), default python3) and
# installed on first use from constraints.txt (the exact CI set); re-installs only when
# pyproject.toml, setup.py or constraints.txt change. The install also registers this .venv
# as the Jupyter kernel "linattn" (per user), the kernel the notebooks ask for, so that a
# JupyterLab installed elsewhere runs them with the library. `make` never uses an active conda or
# virtual environment's packages: environment.yml is the alternative to it, not an input.

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PY := $(BIN)/python
STAMP := $(VENV)/.installed
NB ?=
MATHJAX_VERSION := 3.2.2
MATHJAX_DIR := book/_static/mathjax

.PHONY: help install lint book book-clean test browser-deps lab execute bench gpu-check gpu-rehearsal triton-gates gpu-deps mathjax repo-url clean distclean

help:  ## list the targets
	@grep -E '^[a-z.-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

$(PY):
	@$(PYTHON) -c 'import sys; v = sys.version_info; sys.exit(0 if v >= (3, 10) else f"Python >= 3.10 is needed, $(PYTHON) is {v.major}.{v.minor}; try make PYTHON=python3.11")'
	$(PYTHON) -m venv $(VENV)

.venv: $(PY)  ## create the virtual environment if it is missing

$(STAMP): $(PY) pyproject.toml setup.py constraints.txt
	@echo "== installing linattn_lib (editable) with the book and test tools into $(VENV): a few minutes the first time"
	$(PY) -m pip install --progress-bar on -c constraints.txt -e ".[book,test]"
	@echo "== installed into $(VENV)"
	$(PY) -m ipykernel install --user --name linattn --display-name "Python 3 (linattn_lib)"
	@touch $@

install: $(STAMP)  ## install the library (editable) with book and test tools into .venv

lint: $(STAMP)  ## check the library, kernels and tests with ruff (settings in pyproject.toml)
	$(BIN)/ruff check .

# Sphinx rebuilds only the pages whose sources changed since the last build; book-clean
# rebuilds every page (what CI does, from a clean clone).
book: $(STAMP)  ## build the HTML book into _build/html, only what changed (warnings are errors)
	$(BIN)/jupyter-book build . -W -n --keep-going
	@# an incremental build with no page to write copies no static file: our stylesheet and
	@# script, as they are now
	cp book/_static/*.css book/_static/*.js _build/html/_static/
	@echo "open _build/html/index.html"

book-clean: $(STAMP)  ## rebuild every page of the HTML book from scratch
	$(BIN)/jupyter-book clean .
	$(BIN)/jupyter-book build . --all -W -n --keep-going
	@echo "open _build/html/index.html"

# pytest exits 5 when it collects nothing (e.g. a fresh skeleton): not a failure.
# tests/test_packaging.py is part of it: it builds the wheel, installs it into a fresh venv
# and runs chapters 7 and 8 from a folder outside the repository (a few minutes, offline).
# The browser test (tests/test_browser.py) opens the book just built into _build/html in
# headless Chromium and saves screenshots to _build/screenshots.
# pytest-xdist runs the files on one worker per core (-n auto), each file whole on one worker
# (--dist loadfile: a file's fixtures, servers and kernels stay in one process); on 2 cores
# the suite takes about 55% of its time in one process.
test: $(STAMP) browser-deps book gpu-rehearsal  ## run the library tests, check every notebook's outputs (nbval) and read the built book in Chromium
	LINATTN_BOOK_HTML=_build/html LINATTN_REQUIRE_BROWSER=1 CHROMIUM=$(CHROMIUM) \
		$(BIN)/python -m pytest -p no:cacheprovider --durations=25 -n auto --dist loadfile --nbval tests book \
		|| { rc=$$?; [ $$rc -eq 5 ] || exit $$rc; }

# The GPU machine's software, rehearsed on the CPU: a venv with only what that bare machine has
# (torch, Triton 3.6.0, numpy, einops, pytest; not this project, not the book tools), in which
# the checkout runs from source with PYTHONPATH, exactly as it must run there.
GPU_VENV := .venv-gpu
GPU_PY := $(GPU_VENV)/bin/python
$(GPU_VENV)/.installed: constraints-gpu.txt
	$(PYTHON) -m venv $(GPU_VENV)
	$(GPU_PY) -m pip install -q -c constraints-gpu.txt torch triton numpy einops pytest
	@touch $@

# The dry run imports everything from source, records every kernel launch the GPU check's
# benchmark and profile would make and compiles each for sm_90 (about a minute cold on 2 cores;
# seconds with Triton's cache warm); it fails if one does not compile. Then the sm_90 compile
# gate under that Triton (about 1.5 minutes cold). `make test` runs both, so CI rehearses the
# GPU machine's run on every change.
gpu-rehearsal: $(GPU_VENV)/.installed  ## rehearse the GPU check on the CPU under the GPU machine's Triton (no GPU needed)
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m linattn_lib.experiments.gpu_check --dry-run
	LINATTN_COMPILE_TARGETS=sm_90 PYTHONPATH=$(CURDIR) $(GPU_PY) -m pytest -o addopts= -p no:cacheprovider -q tests/test_kernels_compile.py

# Another Triton release, checked by hand before the supported range in pyproject.toml names
# it: the compile gates for every target and the interpreter's kernel tests, in a venv of that
# release with CI's torch (about 12 minutes cold on 2 cores). 3.6.0, 3.7.1 and 3.8.0 pass.
TRITON_VERSION ?= 3.8.0
TRITON_VENV := .venv-triton-$(TRITON_VERSION)
triton-gates:  ## compile gates and interpreter kernel tests under TRITON_VERSION (default 3.8.0; not CI)
	test -x $(TRITON_VENV)/bin/python || $(PYTHON) -m venv $(TRITON_VENV)
	$(TRITON_VENV)/bin/pip install -q "$$(grep '^torch==' constraints.txt)" triton==$(TRITON_VERSION) numpy einops pytest
	TRITON_CACHE_DIR=$(CURDIR)/$(TRITON_VENV)/triton-cache PYTHONPATH=$(CURDIR) $(TRITON_VENV)/bin/python -m pytest \
		-o addopts= -p no:cacheprovider -q tests/test_kernels_compile.py tests/test_kernels_interpret.py

# fla for the GPU check's benchmark, as a wheel the checkout carries (the GPU machine has no
# network and no index): fla-core only, pure Python, needing einops, torch and triton, which
# the machine has. Not flash-linear-attention: its fla.layers/fla.models need transformers
# >= 5.6.2, and `import fla` imports them when present; the benchmark uses only fla.ops.
WHEELS := .whl
FLA_VERSION := 0.6.0
gpu-deps:  ## download fla's wheel into .whl/ for the GPU check (carry .whl to the GPU machine)
	mkdir -p $(WHEELS)
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d $(WHEELS) fla-core==$(FLA_VERSION)
	@ls -l $(WHEELS)

# Debian's chromium for the browser test (Playwright drives it; `playwright install` is not
# used), plus a CJK font so that the glossary's Chinese shows in the screenshots. apt-get runs
# only when the browser is missing.
CHROMIUM ?= /usr/bin/chromium
browser-deps:  ## install Chromium for the browser test if it is missing (apt-get; root or sudo)
	@if [ -x "$(CHROMIUM)" ]; then exit 0; fi; \
	command -v apt-get >/dev/null || { echo "no Chromium at $(CHROMIUM) and no apt-get: install Chromium and run make test CHROMIUM=/path/to/chromium" >&2; exit 1; }; \
	sudo=; [ "$$(id -u)" -eq 0 ] || sudo=sudo; \
	echo "installing Debian's chromium for the browser test"; \
	$$sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$sudo apt-get install -y -qq chromium fonts-wqy-microhei >/dev/null

# as root (Docker images, many cloud machines) JupyterLab refuses to start without --allow-root
lab: $(STAMP)  ## open the notebooks in JupyterLab
	cd book && ../$(BIN)/jupyter lab $$([ "$$(id -u)" -eq 0 ] && echo --allow-root)

execute: $(STAMP)  ## re-run notebooks and save their outputs (all, or NB=book/xx.ipynb)
	$(PY) tests/execute_notebooks.py $(NB)

bench: $(STAMP)  ## benchmark the attention implementations
	$(PY) -m linattn_lib.experiments.bench

# Exactly what the bare GPU machine runs (README, "On a GPU"): the system python3 (GPU_PYTHON),
# the checkout from source, no install; results in GPU_OUT; exits non-zero when a check fails
# or could not run (e.g. no CUDA device).
GPU_PYTHON ?= python3
GPU_OUT ?= gpu_results
gpu-check:  ## check and time the compiled Triton kernels on a CUDA GPU in under 6 minutes (fails without one)
	PYTHONPATH=$(CURDIR) $(GPU_PYTHON) -m linattn_lib.experiments.gpu_check --out $(GPU_OUT) --budget-s 330

# _config.yml's repository.url is the one place the URL is kept; this copies a new one into the
# notebooks' Colab cells, the README, the introduction and pyproject.toml.
repo-url:  ## point the book at another repository: make repo-url URL=https://github.com/you/fork
	@[ -n "$(URL)" ] || { echo "usage: make repo-url URL=https://github.com/you/fork" >&2; exit 1; }
	python3 tests/repository_url.py "$(URL)"

mathjax:  ## refresh the vendored MathJax in book/_static/mathjax (needs npm)
	tmp=$$(mktemp -d); trap 'rm -rf "$$tmp"' EXIT; \
	(cd "$$tmp" && npm pack --silent mathjax@$(MATHJAX_VERSION) >/dev/null && tar xzf mathjax-$(MATHJAX_VERSION).tgz); \
	rm -rf $(MATHJAX_DIR); mkdir -p $(MATHJAX_DIR)/output/chtml/fonts; \
	cp "$$tmp/package/es5/tex-chtml-full.js" "$$tmp/package/LICENSE" $(MATHJAX_DIR)/; \
	cp -r "$$tmp/package/es5/output/chtml/fonts/woff-v2" $(MATHJAX_DIR)/output/chtml/fonts/; \
	printf 'MathJax %s (npm package "mathjax", es5/tex-chtml-full.js + CHTML woff-v2 fonts),\nvendored by `make mathjax` so the book renders math offline. License: LICENSE (Apache-2.0).\n' \
		$(MATHJAX_VERSION) > $(MATHJAX_DIR)/SOURCE.txt

clean:  ## remove build outputs (keeps .venv)
	rm -rf _build .pytest_cache *.egg-info
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean  ## also remove .venv
	rm -rf $(VENV)
