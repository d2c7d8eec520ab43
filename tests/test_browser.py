"""The built book, opened the way a reader opens it: in a real browser, with no network.

Every page of `_toc.yml` is served from the built HTML on 127.0.0.1 and opened in headless
Chromium (Debian's `chromium`, driven by Playwright). Requests to any other host are blocked,
and recorded. For each page the test asserts:

* nothing was requested from the network (MathJax, fonts, widget managers: all vendored);
* no console errors, no uncaught exceptions, no failed or 4xx/5xx requests;
* the math is typeset: every `.math` element holds MathJax output, none holds a TeX error;
* every image (figure, slider frame) decoded, and each notebook page shows as many figures as
  its saved outputs hold (image outputs counted in the .ipynb), and every slider all its frames;
* every static slider's frames are distinct images, moving it with the keyboard changes the
  image shown (not only the index), and chapters 3, 5 and 6 have one (m, lambda, decay);
* no dead widget view (live ipywidgets need a kernel; their cells are tagged remove-output);
* every same-site link resolves to a file, and every #fragment to an id on the target page;
* notebook pages have a Colab launch link built from `_config.yml`;
* no MyST markup shows as text outside code (```` ```{ ````, `:::{`, `{admonition}`, `{cite`, ...);
* at phone width (390 px) no display math or image is cut off (each scrolls in its own box);
* the reading rules (tests/reading_metrics.py measures them): display
  equations whole at 1280 px (at most a few cut at 390 px, in the whole book), no page wider
  than a phone, code cells and their text output at most 30% of a chapter's page, at most
  three fact-check notes a page, and at most ten code blocks in the book that scroll sideways.

A full-page screenshot of each page at 1280 px and at 390 px (`<page>-390.jpg`), and one of each
slider after moving it, is saved next to the HTML: `<build>/screenshots/` (`_build/screenshots/` under `make test`), with report.json.

Environment:
  LINATTN_BOOK_HTML          the built HTML folder; `make test` builds the book and passes
                             _build/html. Unset: the book is built into a temporary folder.
  LINATTN_REQUIRE_BROWSER=1  fail instead of skipping when Chromium or Playwright is missing
                             (`make test` sets it, after `make browser-deps` installed Chromium).
  CHROMIUM                   the browser binary, /usr/bin/chromium by default.
"""
from __future__ import annotations

import functools
import hashlib
import html.parser
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from reading_metrics import (
    FIRST_FIGURE_PX,
    MAX_CLIPPED_FORMULAS,
    MAX_CLIPPED_NARROW,
    MAX_CLIPPED_WIDE,
    MAX_CODE_SHARE,
    MAX_FACT_CHECKS,
    MAX_SCROLLING_CODE,
    MIN_FIGURE_DENSITY,
    MIN_TEXT_PX,
    READING_SCRIPT,
    table,
)

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
REQUIRE = os.environ.get("LINATTN_REQUIRE_BROWSER", "") not in ("", "0")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-extensions",
    "--disable-default-apps", "--no-default-browser-check", "--mute-audio",
    "--disable-dev-shm-usage",  # containers often have a tiny /dev/shm; long pages would crash the renderer
]
PAGE_TIMEOUT_MS = 120_000
# Chapters whose parameter sweeps must be explorable without a kernel (issue: m, lambda, decay).
SLIDER_CHAPTERS = {"03": "m (random features)", "05": "lambda (cosFormer)", "06": "the decay"}


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


PAGES = _toc_files()

# MyST-NB shows one MIME type per output, the first of these that the output has (its HTML
# priority list); an output is a figure when that type is an image.
_SHOWN_BEFORE_IMAGES = ("application/vnd.jupyter.widget-view+json", "application/javascript", "text/html")
_REMOVED_TAGS = {"remove-output", "remove_output", "remove-cell", "remove_cell"}


def _saved_figures(page: str):
    """(figures, frames per slider) that the notebook's saved outputs hold, as the book shows
    them: image outputs, and the frames of each static slider (an HTML output), skipping cells
    whose outputs the book removes. None for a page that is not a notebook."""
    path = ROOT / f"{page}.ipynb"
    if not path.exists():
        return None
    figures, sliders = 0, []
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] != "code" or _REMOVED_TAGS & set(cell.get("metadata", {}).get("tags", [])):
            continue
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            shown = next((m for m in _SHOWN_BEFORE_IMAGES if m in data), None)
            if shown is None and any(m.startswith("image/") for m in data):
                figures += 1
            elif shown == "text/html":
                text = "".join(data["text/html"]) if isinstance(data["text/html"], list) else data["text/html"]
                if "linattn-slider" in text:
                    sliders.append(text.count('<img class="frame"'))
    return figures, sliders


def _unavailable(reason: str):
    if REQUIRE:
        pytest.fail(f"{reason} (LINATTN_REQUIRE_BROWSER is set; `make browser-deps` installs Chromium)")
    pytest.skip(reason)


def _expected_colab_url(page: str) -> str:
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    repo = config["repository"]
    owner_repo = urlsplit(repo["url"]).path.strip("/")
    path_to_book = (repo.get("path_to_book") or "").strip("/")
    path = f"{path_to_book}/{page}.ipynb" if path_to_book else f"{page}.ipynb"
    colab = config["launch_buttons"]["colab_url"].rstrip("/")
    return f"{colab}/github/{owner_repo}/blob/{repo.get('branch', 'master')}/{path}"


class _Ids(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        for key, value in attrs:
            if key == "id" or (key == "name" and tag == "a"):
                self.ids.add(value or "")


@functools.cache
def _ids_of(path: Path) -> frozenset[str]:
    parser = _Ids()
    parser.feed(path.read_text(encoding="utf-8", errors="replace"))
    return frozenset(parser.ids)


def _resolve(html_dir: Path, url_path: str) -> Path:
    target = html_dir / unquote(url_path).lstrip("/")
    return target / "index.html" if target.is_dir() else target


@pytest.fixture(scope="module")
def html_dir(tmp_path_factory) -> Path:
    given = os.environ.get("LINATTN_BOOK_HTML")
    if given:
        path = Path(given)
        if not path.is_absolute():
            path = ROOT / path
        if not (path / "index.html").exists():
            pytest.fail(f"LINATTN_BOOK_HTML={given}: no index.html there; run `make book` first")
        return path
    jb = Path(sys.executable).with_name("jupyter-book")
    jb = str(jb) if jb.exists() else shutil.which("jupyter-book")
    if jb is None:
        _unavailable("jupyter-book is not installed, and LINATTN_BOOK_HTML does not point to a built book")
    out = tmp_path_factory.mktemp("book")
    proc = subprocess.run(
        [jb, "build", str(ROOT), "--all", "-W", "-n", "--keep-going", "--path-output", str(out)],
        capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"the book does not build:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return out / "_build" / "html"


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep the test output clean
        pass


@pytest.fixture(scope="module")
def server(html_dir):
    handler = functools.partial(_QuietHandler, directory=str(html_dir))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_port}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture(scope="module")
def browser_context():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (pip install playwright; no browser download is needed)")
    if not os.access(CHROMIUM, os.X_OK):
        _unavailable(f"no Chromium at {CHROMIUM}: `make browser-deps` (apt-get install chromium) or set CHROMIUM")
    blocked: list[str] = []

    def route(route):
        url = route.request.url
        if urlsplit(url).hostname == "127.0.0.1":
            route.continue_()
        else:
            blocked.append(url)
            route.abort()

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        context = browser.new_context(viewport={"width": 1280, "height": 900}, service_workers="block")
        context.set_default_timeout(PAGE_TIMEOUT_MS)
        context.route("**/*", route)
        yield context, blocked
        context.close()
        browser.close()


_PAGE_SCRIPT = """async () => {
  const mathEls = [...document.querySelectorAll('.math')];
  const imgs = [...document.images];
  await Promise.all(imgs.map(img => { img.loading = 'eager'; return img.decode().catch(() => null); }));
  const out = {
    math_total: mathEls.length,
    math_untypeset: mathEls.filter(e => !e.querySelector('mjx-container')).map(e => e.textContent.slice(0, 80)),
    math_errors: [...document.querySelectorAll('mjx-merror')].map(e => e.getAttribute('data-mjx-error') || e.textContent.slice(0, 80)),
    mjx_containers: document.querySelectorAll('mjx-container').length,
    images: imgs.map(img => ({src: img.currentSrc.startsWith('data:') ? 'data:…' + img.alt : img.currentSrc,
                              ok: img.complete && img.naturalWidth > 0})),
    // figures: images in cell outputs other than slider frames; one entry per slider: its frames
    figures: [...document.querySelectorAll('.cell_output img')].filter(img => !img.closest('.linattn-slider'))
             .map(img => img.complete && img.naturalWidth > 0),
    slider_frames: [...document.querySelectorAll('.linattn-slider')].map(el => el.querySelectorAll('img.frame').length),
    links: [...document.querySelectorAll('a[href]')].map(a => a.href),
    dead_widgets: document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"], .jupyter-widgets-disconnected').length,
    sliders: document.querySelectorAll('.linattn-slider').length,
    title: document.title,
  };
  return out;
}"""

_VISIBLE_FRAME = """el => {
  const frames = [...el.querySelectorAll('img.frame')];
  const shown = frames.map((f, i) => [i, getComputedStyle(f).display !== 'none' && f.naturalWidth > 0]).filter(x => x[1]).map(x => x[0]);
  return {shown, n: frames.length, value: el.querySelector('input[type=range]').value,
          label: el.querySelector('.linattn-value').textContent,
          labels: JSON.parse(el.dataset.labels),
          srcs: frames.map(f => f.currentSrc || f.src),
          shown_srcs: shown.map(i => frames[i].currentSrc || frames[i].src)};
}"""


# MyST that did not parse shows as text: look for its markers outside code (a chapter may show
# markup inside a code span or a code cell; prose never should).
_RAW_MARKUP_SCRIPT = """() => {
  const main = (document.querySelector('main') || document.body).cloneNode(true);
  main.querySelectorAll('pre, code, script, style, mjx-container, .cell_input').forEach(e => e.remove());
  const text = main.textContent;
  return ['```{', ':::{', '{admonition}', '{cite', '{doc}', '{ref}', '{eval-rst}', '{math}']
    .filter(p => text.includes(p)).map(p => {
      const i = text.indexOf(p);
      return text.slice(Math.max(0, i - 30), i + 50).replace(/\\s+/g, ' ');
    });
}"""

# At phone width: display math and images wider than the screen must sit in a container that
# scrolls sideways (otherwise they are cut off); the page's own sideways overflow is recorded.
_NARROW_SCRIPT = """() => {
  const vw = document.documentElement.clientWidth;
  const scrolls = el => {
    for (let e = el.parentElement; e; e = e.parentElement) {
      const ox = getComputedStyle(e).overflowX;
      if ((ox === 'auto' || ox === 'scroll') && e.getBoundingClientRect().right <= vw + 1) return true;
    }
    return false;
  };
  const cut = els => els.filter(e => e.getBoundingClientRect().right > vw + 1 && !scrolls(e));
  // a display equation's box fits the column; its content may not (clipped by overflow: hidden)
  const mathCut = [...document.querySelectorAll('mjx-container[display="true"]')].filter(m => {
    const content = m.querySelector('mjx-math') || m;
    const box = m.getBoundingClientRect(), r = content.getBoundingClientRect();
    const wider = r.right > Math.min(box.right, vw) + 1 || r.left < Math.max(box.left, 0) - 1;
    const ox = getComputedStyle(m).overflowX;
    return wider && !(ox === 'auto' || ox === 'scroll') && !scrolls(m);
  });
  return {
    viewport: vw,
    page_overflow_px: Math.max(0, document.documentElement.scrollWidth - vw),
    math_cut: mathCut.map(m => (m.getAttribute('aria-label') || m.textContent).slice(0, 60)),
    images_cut: cut([...document.querySelectorAll('main img')]).map(i => i.alt || i.src.slice(0, 60)),
  };
}"""
NARROW = {"width": 390, "height": 844}


def _digest(src: str) -> str:
    return hashlib.sha256(src.encode()).hexdigest()[:12]


def _check_sliders(page, shots: Path, stem: str) -> list[dict]:
    results = []
    sliders = page.locator(".linattn-slider")
    for k in range(sliders.count()):
        slider = sliders.nth(k)
        slider.scroll_into_view_if_needed()
        before = slider.evaluate(_VISIBLE_FRAME)
        range_input = slider.locator("input[type=range]")
        range_input.focus()
        key = "Home" if int(before["value"]) == before["n"] - 1 else "End"
        page.keyboard.press(key)
        after = slider.evaluate(_VISIBLE_FRAME)
        page.keyboard.press("ArrowLeft" if key == "End" else "ArrowRight")
        step = slider.evaluate(_VISIBLE_FRAME)
        shot = shots / f"{stem}--slider{k}.png"
        slider.screenshot(path=str(shot))
        target = int(after["value"])
        # the image itself must change, not only which <img> is visible: identical frames (a
        # slider over a parameter that the drawing ignores) would pass an index check
        shown = [_digest(x["shown_srcs"][0]) if len(x["shown_srcs"]) == 1 else None for x in (before, after, step)]
        frame_digests = [_digest(src) for src in before["srcs"]]
        distinct = len(set(frame_digests)) == len(frame_digests)
        ok = (
            len(before["shown"]) == 1 and len(after["shown"]) == 1 and len(step["shown"]) == 1
            and after["shown"] != before["shown"] and after["shown"] == [target]
            and after["label"] == after["labels"][target]
            and step["shown"] == [int(step["value"])] and step["shown"] != after["shown"]
            and None not in shown and shown[0] != shown[1] and shown[2] != shown[1]
            and shown[1] == frame_digests[target]
        )
        results.append({"frames": before["n"], "before": before["shown"], "after": after["shown"],
                        "after_one_step": step["shown"], "label_after": after["label"],
                        "shown_image_digests": shown, "frame_digests": frame_digests,
                        "distinct_frames": distinct, "ok": ok, "screenshot": str(shot)})
    return results


@pytest.fixture(scope="module")
def reports(html_dir, server, browser_context) -> dict[str, dict]:
    context, blocked = browser_context
    shots = html_dir.parent / "screenshots"
    shots.mkdir(exist_ok=True)
    reports = {}
    for name in PAGES:
        page = context.new_page()
        rep = {"console_errors": [], "page_errors": [], "bad_responses": [], "failed_requests": []}
        page.on("console", lambda msg, rep=rep: rep["console_errors"].append(msg.text) if msg.type == "error" else None)
        page.on("pageerror", lambda exc, rep=rep: rep["page_errors"].append(str(exc)))
        page.on("response", lambda r, rep=rep: rep["bad_responses"].append(f"{r.status} {r.url}")
                if r.status >= 400 else None)
        page.on("requestfailed", lambda r, rep=rep: rep["failed_requests"].append(f"{r.failure} {r.url}")
                if urlsplit(r.url).hostname == "127.0.0.1" else None)
        n_blocked = len(blocked)
        page.goto(f"{server}/{name}.html", wait_until="load")
        # Sphinx adds MathJax only to pages that contain math.
        rep["mathjax_loaded"] = page.locator('script[src*="mathjax"]').count() > 0
        if rep["mathjax_loaded"]:
            page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise")
            page.evaluate("() => MathJax.startup.promise")
        page.evaluate("() => document.fonts.ready.then(() => true)")
        rep.update(page.evaluate(_PAGE_SCRIPT))
        stem = name.replace("/", "__")
        rep["slider_checks"] = _check_sliders(page, shots, stem)
        rep["raw_markup"] = page.evaluate(_RAW_MARKUP_SCRIPT)
        rep["reading"] = page.evaluate(READING_SCRIPT)
        page.evaluate("() => window.scrollTo(0, 0)")
        rep["screenshot"] = str(shots / f"{stem}.jpg")
        page.screenshot(path=rep["screenshot"], full_page=True, type="jpeg", quality=70)
        page.set_viewport_size(NARROW)
        page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
        rep["narrow"] = page.evaluate(_NARROW_SCRIPT)
        rep["reading_390"] = page.evaluate(READING_SCRIPT)
        rep["screenshot_390"] = str(shots / f"{stem}-390.jpg")
        page.screenshot(path=rep["screenshot_390"], full_page=True, type="jpeg", quality=70)
        colab = _expected_colab_url(name)
        rep["colab_link"] = (colab if page.locator(f'a[href="{colab}"]').count() else None) \
            if (ROOT / f"{name}.ipynb").exists() else "n/a"
        rep["blocked"] = blocked[n_blocked:]
        page.close()
        # Links: same-site targets must exist, and their fragments must be ids there.
        broken, checked = [], 0
        for href in sorted(set(rep.pop("links"))):
            parts = urlsplit(href)
            if parts.scheme not in ("http", "https") or parts.netloc != urlsplit(server).netloc:
                continue
            checked += 1
            target = _resolve(html_dir, parts.path)
            if not target.exists():
                broken.append(f"{href} (no file {target.relative_to(html_dir)})")
            elif parts.fragment and target.suffix == ".html" and unquote(parts.fragment) not in _ids_of(target):
                broken.append(f"{href} (no id {parts.fragment!r} in {target.relative_to(html_dir)})")
        rep["links_checked"], rep["broken_links"] = checked, broken
        reports[name] = rep
    (shots / "report.json").write_text(json.dumps(reports, indent=1, ensure_ascii=False))
    return reports


@pytest.mark.parametrize("name", PAGES)
def test_page_reads_offline(reports, name):
    rep = reports[name]
    assert rep["blocked"] == [], f"{name} tried to load from the network: {rep['blocked']}"
    assert rep["console_errors"] == [] and rep["page_errors"] == [], \
        f"{name}: console errors {rep['console_errors']}, exceptions {rep['page_errors']}"
    assert rep["bad_responses"] == [] and rep["failed_requests"] == [], \
        f"{name}: failed requests {rep['bad_responses'] + rep['failed_requests']}"
    assert rep["math_untypeset"] == [], f"{name}: math not typeset: {rep['math_untypeset'][:5]}"
    assert rep["math_errors"] == [], f"{name}: TeX errors: {rep['math_errors'][:5]}"
    bad_images = [img["src"] for img in rep["images"] if not img["ok"]]
    assert bad_images == [], f"{name}: images that did not load: {bad_images[:5]}"
    assert rep["dead_widgets"] == 0, f"{name}: {rep['dead_widgets']} widget views that cannot render without a kernel"
    assert rep["broken_links"] == [], f"{name}: broken internal links: {rep['broken_links'][:10]}"
    assert rep["colab_link"] is not None, f"{name}: no Colab launch link to {_expected_colab_url(name)}"
    assert rep["raw_markup"] == [], f"{name}: MyST markup shown as text: {rep['raw_markup'][:5]}"


@pytest.mark.parametrize("name", PAGES)
def test_page_reads_at_phone_width(reports, name):
    """At 390 px (a phone) nothing is cut off: wide display math and images scroll sideways
    in their own box. The full-page screenshot is saved as <page>-390.jpg."""
    narrow = reports[name]["narrow"]
    assert narrow["viewport"] <= NARROW["width"]
    assert narrow["math_cut"] == [], f"{name}: display math cut off at 390 px: {narrow['math_cut'][:3]}"
    assert narrow["images_cut"] == [], f"{name}: images cut off at 390 px: {narrow['images_cut'][:3]}"


@pytest.mark.parametrize("name", [p for p in PAGES if re.match(r"book/\d\d_", p)])
def test_chapter_has_math_and_figures(reports, name):
    rep = reports[name]
    assert rep["math_total"] > 0 and rep["mjx_containers"] >= rep["math_total"], \
        f"{name}: {rep['math_total']} math elements, {rep['mjx_containers']} typeset"
    assert sum(img["ok"] for img in rep["images"]) > 0, f"{name}: no figure was displayed"


def test_saved_figures_are_counted_from_the_notebooks():
    """The expectations below come from the notebooks' saved outputs: every chapter holds
    figures, and the slider chapters hold a slider of several frames (no build needed)."""
    for name in PAGES:
        chapter = re.match(r"book/(\d\d)_", name)
        saved = _saved_figures(name)
        if chapter:
            assert saved is not None and saved[0] > 0, f"{name}: its notebook holds no saved figure"
            if chapter.group(1) in SLIDER_CHAPTERS:
                assert saved[1] and all(n > 1 for n in saved[1]), f"{name}: saved sliders {saved[1]}"


@pytest.mark.parametrize("name", [p for p in PAGES if _saved_figures(p) is not None])
def test_page_shows_every_saved_figure(reports, name):
    """As many figures on the page as image outputs in the notebook (a page that lost figures
    in the build fails), each one displayed, and every slider with all its saved frames."""
    rep = reports[name]
    figures, sliders = _saved_figures(name)
    assert len(rep["figures"]) == figures, \
        f"{name}: the notebook's saved outputs hold {figures} figures, the page shows {len(rep['figures'])}"
    assert all(rep["figures"]), f"{name}: {rep['figures'].count(False)} of {figures} figures did not load"
    assert rep["slider_frames"] == sliders, \
        f"{name}: sliders with {rep['slider_frames']} frames on the page, {sliders} in the notebook"


@pytest.mark.parametrize("name", PAGES)
def test_static_sliders_move(reports, name):
    rep = reports[name]
    chapter = re.match(r"book/(\d\d)_", name)
    if chapter and chapter.group(1) in SLIDER_CHAPTERS:
        assert rep["slider_checks"], f"{name} needs a static slider over {SLIDER_CHAPTERS[chapter.group(1)]}"
    same = [s for s in rep["slider_checks"] if not s["distinct_frames"]]
    assert not same, f"{name}: sliders with identical frames (the image does not depend on the parameter): {same}"
    failed = [s for s in rep["slider_checks"] if not s["ok"]]
    assert not failed, f"{name}: sliders that did not change the shown image: {failed}"


def _bib_entries() -> dict[str, tuple[str, str]]:
    """key -> (author field, year field) of every entry of references.bib."""
    text = (ROOT / "book" / "references.bib").read_text(encoding="utf-8")
    entries = {}
    for match in re.finditer(r"^@\w+\{([^,\s]+),(.*?)^\}", text, re.M | re.S):
        fields = dict(re.findall(r"^\s*(\w+)\s*=\s*\{(.*?)\},?\s*$", match.group(2), re.M | re.S))
        entries[match.group(1)] = (fields.get("author", ""), fields.get("year", ""))
    return entries


def test_citations_link_to_their_entries(html_dir):
    """Every citation on every page links to its own entry of the bibliography: the anchor
    is the cited key (`bibtex_cite_id`), the entry exists, and the link's author and year are
    that entry's. Positional anchors (#id26) had sent an incrementally built page's citations
    to the entries that moved into their places after an edit of the .bib."""
    entries = _bib_entries()
    ids = set(re.findall(r'id="([^"]+)"', (html_dir / "book" / "bibliography.html").read_text()))
    link = re.compile(r'href="(?:[./]*book/)?bibliography\.html#([^"]+)"[^>]*>(.*?)</a>', re.S)
    wrong, seen = [], 0
    for page in sorted((html_dir / "book").glob("*.html")):
        for fragment, label in link.findall(page.read_text(encoding="utf-8")):
            seen += 1
            key = fragment.removeprefix("cite-")
            text = re.sub(r"<[^>]+>", "", label)
            author, year = entries.get(key, ("", ""))
            # "Zhang et al., 2024" (cite:p), or the year alone after the authors' names (cite:t)
            first = text.split()[0] if text.split() else ""
            named = first == text or first.lower() in author.lower()
            if (not fragment.startswith("cite-") or fragment not in ids or key not in entries
                    or not named or not year or not text.endswith(year)):
                wrong.append(f"{page.name}: '{text}' -> #{fragment}")
    assert seen > 50, f"only {seen} citation links found: has the citation markup changed?"
    assert not wrong, "citations linked to the wrong entry or to none:\n" + "\n".join(wrong[:20])


def test_root_redirects_to_the_introduction(server, browser_context, html_dir):
    context, blocked = browser_context
    page = context.new_page()
    n_blocked = len(blocked)
    page.goto(f"{server}/index.html")
    page.wait_for_url(re.compile(re.escape(PAGES[0]) + r"\.html$"))
    page.close()
    assert blocked[n_blocked:] == []


def test_wide_outputs_and_tables_say_they_scroll_on_a_phone(server, browser_context):
    """At 390 px, a printed output or a table wider than the column says above it that it
    scrolls sideways (wide_hint.js marks it, reading.css writes the line); at 1280 px none does."""
    context, _ = browser_context
    page = context.new_page()
    hints = """() => [...document.querySelectorAll('.wide-box')].map(
        e => getComputedStyle(e, '::before').content)"""
    try:
        page.set_viewport_size({"width": 390, "height": 800})
        page.goto(f"{server}/book/08_experiments.html")
        page.wait_for_load_state("load")
        narrow = page.evaluate(hints)
        page.set_viewport_size({"width": 1280, "height": 800})
        page.wait_for_timeout(200)
        wide = page.evaluate(hints)
    finally:
        page.close()
    assert any("whole table" in h for h in narrow)  # the complexity table of 8.1
    assert any("whole output" in h for h in narrow)
    assert any("whole line" in h for h in narrow)  # code of 80 columns
    assert wide == []


def test_errata_and_glossary_tables_fit_a_phone(server, browser_context):
    """At 390 px the errata's and the glossary's tables (class stack-on-phone) show each row's
    cells one above the other and fit the column: a reviewer found every line of their prose cut
    at the screen's edge, to be read by swiping back and forth; at 1280 px they stay tables."""
    context, _ = browser_context
    page = context.new_page()
    widths = """() => [...document.querySelectorAll('.bd-article table.stack-on-phone')].map(
        t => [t.scrollWidth, t.parentElement.clientWidth, getComputedStyle(t).display])"""
    try:
        for name, tables in (("appendix_errata", 3), ("glossary", 6)):
            page.set_viewport_size({"width": 390, "height": 800})
            page.goto(f"{server}/book/{name}.html")
            page.wait_for_load_state("load")
            page.evaluate("() => window.MathJax && MathJax.startup && MathJax.startup.promise")
            narrow = page.evaluate(widths)
            assert len(narrow) == tables, (name, narrow)
            assert all(w <= box + 1 and shown == "block" for w, box, shown in narrow), (name, narrow)
            page.set_viewport_size({"width": 1280, "height": 800})
            page.wait_for_timeout(200)
            assert {shown for _, _, shown in page.evaluate(widths)} == {"table"}, name
    finally:
        page.close()


def test_slider_control_stays_in_view_while_its_figure_scrolls(server, browser_context):
    """At 390 px a static slider's figure scrolls sideways in its box; the control scrolled off
    with it, so a reader could not move the slider and watch the right-hand panels (a reviewer
    found it). Its label now sticks to the box's left edge."""
    context, _ = browser_context
    page = context.new_page()
    where = """() => [...document.querySelectorAll('.linattn-slider')].map(s => {
      let box = s.parentElement;
      while (box && getComputedStyle(box).overflowX !== 'auto') box = box.parentElement;
      box.scrollLeft = box.scrollWidth;
      const r = s.querySelector('label').getBoundingClientRect();
      return [box.scrollLeft, Math.round(r.left), Math.round(r.right)];
    })"""
    try:
        page.set_viewport_size({"width": 390, "height": 800})
        page.goto(f"{server}/book/03_performer_favor.html")
        page.wait_for_load_state("load")
        (scrolled, left, right), = page.evaluate(where)
    finally:
        page.close()
    assert scrolled > 100 and 0 <= left and right <= 390, (scrolled, left, right)


# inline formulas that begin a line right after a character written against them ("(", a letter)
_MATHS_CUT_FROM_ITS_TEXT = """() => {
  let cut = 0;
  for (const c of document.querySelectorAll(".bd-article mjx-container:not([display='true'])")) {
    const m = c.closest('span.math') || c;
    const prev = m.previousSibling;
    if (prev && prev.nodeType === 3 && /\\S$/.test(prev.data)) {
      const r = document.createRange();
      r.setStart(prev, prev.data.length - 1);
      r.setEnd(prev, prev.data.length);
      if (c.getBoundingClientRect().top > r.getBoundingClientRect().bottom - 2) cut++;
    }
  }
  return [cut, document.querySelectorAll('.math-glue').length];
}"""


def test_inline_maths_keeps_its_punctuation_on_a_phone(server, browser_context):
    """At 390 px no inline formula starts a line while the text before it ends against it (an
    opening parenthesis left at the end of the line above): math_glue.js binds them. Without it,
    chapter 8 had 4 such breaks at this width."""
    context, _ = browser_context
    page = context.new_page()
    try:
        page.set_viewport_size({"width": 390, "height": 800})
        page.goto(f"{server}/book/08_experiments.html")
        page.wait_for_function("document.documentElement.dataset.mathGlued === '1'", timeout=30000)
        cut, glued = page.evaluate(_MATHS_CUT_FROM_ITS_TEXT)
    finally:
        page.close()
    assert glued > 20 and cut == 0


def _reading_totals(reports, key: str, width: str) -> list[str]:
    return [f"{name}: {item}" for name, rep in reports.items() for item in rep[width][key]]


def test_display_equations_are_whole(reports):
    """No display equation is cut at 1280 px; at 390 px at most MAX_CLIPPED_NARROW in the
    book (a box that scrolls counts as cut: nothing shows that it scrolls)."""
    print(table(reports))
    wide = _reading_totals(reports, "math_clipped", "reading")
    narrow = _reading_totals(reports, "math_clipped", "reading_390")
    assert len(wide) <= MAX_CLIPPED_WIDE, f"display equations cut at 1280 px: {wide}"
    assert len(narrow) <= MAX_CLIPPED_NARROW, \
        f"{len(narrow)} display equations cut at 390 px (at most {MAX_CLIPPED_NARROW}): {narrow}"


def test_formulas_in_the_text_and_in_solutions_are_whole(reports):
    """With every fold (solutions included) opened, no inline formula of the text and no display
    equation inside a fold is cut off, at 1280 or 390 px: a reader reviewing the pages in
    Chromium found four such cut on a phone (a denominator lost, an identity ending mid-way),
    which the display-equation count above does not see."""
    cut = [item for width in ("reading", "reading_390") for key in ("inline_math_clipped", "folded_math_clipped")
           for item in _reading_totals(reports, key, width)]
    assert len(cut) <= MAX_CLIPPED_FORMULAS, f"formulas cut off: {cut}"


def test_code_blocks_fit_their_box(reports):
    scrolling = _reading_totals(reports, "code_scrolling", "reading")
    assert len(scrolling) <= MAX_SCROLLING_CODE, \
        f"{len(scrolling)} code blocks scroll sideways at 1280 px (at most {MAX_SCROLLING_CODE}): {scrolling}"


@pytest.mark.parametrize("name", PAGES)
def test_page_fits_a_phone(reports, name):
    overflow = reports[name]["reading_390"]["page_overflow_px"]
    assert overflow == 0, f"{name} is {overflow} px wider than a 390-px phone"


@pytest.mark.parametrize("name", PAGES)
def test_fact_checks_do_not_interrupt(reports, name):
    facts = reports[name]["reading"]["fact_checks"]
    assert len(facts) <= MAX_FACT_CHECKS, \
        f"{name}: {len(facts)} fact-check boxes (at most {MAX_FACT_CHECKS}; the rest go to the errata): {facts}"


@pytest.mark.parametrize("name", [p for p in PAGES if re.match(r"book/\d\d_", p)])
def test_chapter_is_mostly_lesson(reports, name):
    """Code cells and their text output take at most MAX_CODE_SHARE of a chapter's page."""
    rep = reports[name]["reading"]
    assert rep["code_share"] <= MAX_CODE_SHARE, \
        f"{name}: code and text output are {rep['code_share']:.0%} of the page " \
        f"({rep['code_px']} of {rep['article_px']} px; at most {MAX_CODE_SHARE:.0%})"


@pytest.mark.parametrize("name", [p for p in PAGES if re.match(r"book/\d\d_", p)])
def test_chapter_shows_its_key_figure_early(reports, name):
    top = reports[name]["reading"]["first_figure_px"]
    assert top is not None and top <= FIRST_FIGURE_PX, \
        f"{name}: the first figure starts at {top} px (within the first two screens: <= {FIRST_FIGURE_PX})"


@pytest.mark.parametrize("name", [p for p in PAGES if re.match(r"book/\d\d_", p)])
def test_figure_text_is_readable_on_the_page(reports, name):
    """The book's figures are laid out at figure.dpi with text of at least MIN_FONT_PT; shown
    at 1280 px, each one's scale keeps that text at MIN_TEXT_PX or more."""
    from linattn_lib.chapters.plots import BOOK_RC, MIN_FONT_PT

    natural_px = MIN_FONT_PT * BOOK_RC["figure.dpi"] / 72
    small = [round(s, 2) for s in reports[name]["reading"]["figure_scales"] if natural_px * s < MIN_TEXT_PX - 0.05]
    assert not small, f"{name}: figures shown at scales {small}: their smallest text is below {MIN_TEXT_PX} px"


@pytest.mark.parametrize("name", [p for p in PAGES if re.match(r"book/\d\d_", p)])
def test_figures_are_sharp_on_a_high_density_screen(reports, name):
    """Every figure has at least MIN_FIGURE_DENSITY PNG pixels per CSS pixel shown, at 1280 and
    at 390 px (where it scrolls at up to twice the column): a reviewer found the 100-dpi figures
    blurry on a phone, whose screen has 2 to 3 pixels per CSS pixel."""
    blurry = [(width, round(d, 2)) for width in ("reading", "reading_390")
              for d in reports[name][width]["figure_density"] if d < MIN_FIGURE_DENSITY]
    assert not blurry, f"{name}: figures with fewer than {MIN_FIGURE_DENSITY} PNG pixels per pixel shown: {blurry}"
