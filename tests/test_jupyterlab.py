"""One chapter opened the way a reader who runs the notebooks opens it: in JupyterLab, in
headless Chromium (the browser test's Chromium and Playwright), with no network.

JupyterLab is started on a copy of book/ with its own settings, data and runtime folders (a
reader's own settings do not matter) and kernels that run this interpreter. The test opens
`CHAPTER`, checks what a reader sees before running anything, runs all cells from the Run
menu, then moves the live slider and waits for its figure to change. It asserts:

* the markdown cells render MyST (jupyterlab-myst): no admonition fence or role left as text;
* before the run, the live slider's saved output is its text fallback ("run this cell to move
  it"), not an "Error displaying widget" box;
* every cell ran without an error;
* after the run the live slider shows a figure, and moving it with the keyboard redraws it
  (the image changes);
* nothing was requested from another host.

Screenshots: `_build/screenshots/jupyterlab-<chapter>-{opened,run,moved}.png`.
LINATTN_REQUIRE_BROWSER=1 (set by `make test`) fails instead of skipping when Chromium or
Playwright is missing, as the browser test does.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from test_browser import CHROMIUM, CHROMIUM_ARGS, _unavailable

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = "05_positional_linearisation"
TOKEN = "linattn-test"
RUN_TIMEOUT_S = 900
RAW_MYST = ("```{", ":::{", "{admonition}", "{cite:", "{doc}`", "{ref}`")

# kernel names a notebook may ask for -> this interpreter
_KERNEL = {"argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
           "display_name": "Python 3 (linattn_lib)", "language": "python"}
_SETTINGS = {
    # every cell in the DOM (no windowing), so that the checks see the whole notebook
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                         "checkForUpdates": False},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environment(home: Path) -> dict:
    for name in ("python3", "linattn"):
        spec = home / "data" / "kernels" / name
        spec.mkdir(parents=True)
        (spec / "kernel.json").write_text(json.dumps(_KERNEL))
    for name, value in _SETTINGS.items():
        path = home / "settings" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"),
               JUPYTER_RUNTIME_DIR=str(home / "runtime"), JUPYTERLAB_SETTINGS_DIR=str(home / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"), PYTHONHASHSEED="0")
    env.pop("MPLBACKEND", None)  # the kernel's inline backend, as in a reader's JupyterLab
    env.pop("TRITON_INTERPRET", None)
    return env


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """(base URL, notebook path) of a JupyterLab serving a copy of book/."""
    home = tmp_path_factory.mktemp("jupyterlab")
    book = home / "book"
    shutil.copytree(ROOT / "book", book, ignore=shutil.ignore_patterns("_build", "mathjax", ".ipynb_checkpoints"))
    port = _free_port()
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
           f"--ServerApp.token={TOKEN}", f"--ServerApp.root_dir={book}", "--ServerApp.open_browser=False",
           "--LabApp.news_url=", "--ServerApp.allow_remote_access=False"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = (home / "lab.log").open("w")
    proc = subprocess.Popen(cmd, env=_environment(home), stdout=log, stderr=subprocess.STDOUT, cwd=str(book))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"{base}/api/status?token={TOKEN}", timeout=5).read()
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"JupyterLab did not start:\n{(home / 'lab.log').read_text()[-3000:]}")
            time.sleep(0.5)
    yield base, f"{CHAPTER}.ipynb"
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


_CELLS_SCRIPT = """raw => {
  const cells = [...document.querySelectorAll('.jp-Notebook .jp-Cell')];
  const md = cells.filter(c => c.classList.contains('jp-MarkdownCell'));
  const mdText = md.map(c => {
    const r = c.querySelector('.myst, .jp-RenderedMarkdown') || c;
    const clone = r.cloneNode(true);
    clone.querySelectorAll('pre, code, .jp-Editor').forEach(e => e.remove());
    return clone.textContent;
  }).join('\\n');
  const code = cells.filter(c => c.classList.contains('jp-CodeCell'));
  return {
    markdown: md.length,
    raw_myst: raw.filter(p => mdText.includes(p)),
    admonitions: document.querySelectorAll('.jp-Notebook .myst-admonition, .jp-Notebook .admonition').length,
    code: code.length,
    prompts: code.map(c => (c.querySelector('.jp-InputPrompt') || {}).textContent || ''),
    errors: [...document.querySelectorAll('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.error"]')]
      .map(e => e.textContent.slice(0, 300)),
    widget_errors: [...document.querySelectorAll('.jp-OutputArea-output')]
      .filter(e => e.textContent.includes('Error displaying widget')).length,
    fallbacks: [...document.querySelectorAll('.jp-OutputArea-output')]
      .filter(e => e.textContent.includes('run this cell to move it')).length,
  };
}"""

_SLIDER_IMAGE = """() => {
  const box = document.querySelector('.jp-Notebook .widget-interact');
  if (!box) return null;
  const img = box.querySelector('img');
  return img ? img.src : '';
}"""


def _finished(state: dict) -> bool:
    """Every code cell has run: a number in its prompt, none queued or running ([*])."""
    return state["code"] > 0 and all(p.strip() not in ("[*]:", "[ ]:", "") and "*" not in p for p in state["prompts"])


def test_chapter_runs_and_its_live_slider_redraws(lab):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (pip install playwright; no browser download is needed)")
    if not os.access(CHROMIUM, os.X_OK):
        _unavailable(f"no Chromium at {CHROMIUM}: `make browser-deps` (apt-get install chromium) or set CHROMIUM")
    base, notebook = lab
    shots = ROOT / "_build" / "screenshots"
    shots.mkdir(parents=True, exist_ok=True)
    blocked: list[str] = []

    def route(r):
        if urlsplit(r.request.url).hostname == "127.0.0.1":
            r.continue_()
        else:
            blocked.append(r.request.url)
            r.abort()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(120_000)
        page.route("**/*", route)
        page.goto(f"{base}/lab/tree/{notebook}?token={TOKEN}")
        page.wait_for_selector(".jp-Notebook .jp-MarkdownCell")
        page.wait_for_function("() => document.querySelector('.jp-Notebook-ExecutionIndicator, "
                               ".jp-KernelStatus, .jp-Toolbar-kernelStatus') !== null")
        page.wait_for_timeout(3000)  # let the markdown renderer finish
        opened = page.evaluate(_CELLS_SCRIPT, list(RAW_MYST))
        page.screenshot(path=str(shots / f"jupyterlab-{CHAPTER}-opened.png"))

        page.locator(".lm-MenuBar-itemLabel", has_text="Run").first.click()
        page.locator(".lm-Menu-itemLabel", has_text="Run All Cells").first.click()
        deadline = time.monotonic() + RUN_TIMEOUT_S
        state = opened
        while time.monotonic() < deadline:
            page.wait_for_timeout(2000)
            state = page.evaluate(_CELLS_SCRIPT, list(RAW_MYST))
            if state["errors"] or _finished(state):
                break
        page.screenshot(path=str(shots / f"jupyterlab-{CHAPTER}-run.png"))

        before = page.evaluate(_SLIDER_IMAGE)
        moved = None
        if before:
            box = page.locator(".jp-Notebook .widget-interact").first
            box.scroll_into_view_if_needed()
            handle = box.locator(".noUi-handle, input[type=range]").first
            handle.focus()
            page.keyboard.press("End")
            try:
                page.wait_for_function(f"() => ({_SLIDER_IMAGE})() !== {json.dumps(before)}", timeout=60_000)
            except Exception:  # noqa: BLE001 - reported by the assertion below
                pass
            moved = page.evaluate(_SLIDER_IMAGE)
            box.screenshot(path=str(shots / f"jupyterlab-{CHAPTER}-moved.png"))
        browser.close()

    assert opened["markdown"] > 0 and opened["raw_myst"] == [], f"MyST shown as text in JupyterLab: {opened['raw_myst']}"
    assert opened["admonitions"] > 0, "no admonition rendered: is jupyterlab-myst installed and enabled?"
    assert opened["widget_errors"] == 0 and opened["fallbacks"] >= 1, \
        f"before the run: {opened['widget_errors']} widget errors, {opened['fallbacks']} slider fallbacks"
    assert state["errors"] == [], f"cells raised: {state['errors'][:2]}"
    assert _finished(state), f"not every cell ran within {RUN_TIMEOUT_S} s: {state['prompts']}"
    assert before, "after the run the live slider shows no figure"
    assert moved and moved != before, "moving the live slider did not redraw its figure"
    assert blocked == [], f"requests to other hosts: {blocked[:5]}"
