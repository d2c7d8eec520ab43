"""How a built page reads: the numbers the browser test measures in the DOM (the reading rules).

`READING_SCRIPT` runs in the page at one viewport width and returns:

* ``math_clipped``: display equations whose typeset content is wider than the part of them
  a reader sees (their own box, cut by every ancestor that clips or scrolls, and the window);
  a box that scrolls sideways still counts: nothing on the page shows that it does;
* ``code_share``: the height of code cells (their source, or the bar of a folded one) and of
  their text output (prints, tables), as a fraction of the article's height;
* ``inline_math_clipped``: inline formulas of the text (not in tables, which scroll sideways
  as a whole) cut off the same way, measured with every fold (solutions included) opened;
* ``folded_math_clipped``: display equations inside folds (solutions) cut off, folds opened;
* ``fact_checks``: admonitions titled "Fact check";
* ``code_scrolling``: code blocks (cell sources, outputs, literal blocks) wider than their box,
  measured with every fold opened, so a folded cell that scrolls counts too;
* ``page_overflow_px``: how far the page itself is wider than the window;
* ``first_figure_px``: where the page's first figure starts, from the top of the page;
* ``figure_scales``: each figure's shown width over its width at the book's layout dpi (100;
  text of at least 10 pt is 13.9 px at scale 1): the PNG's width, or the width its `<img>`
  (or its inline style) gives, half of it for the retina PNGs the book draws at 200 dpi;
* ``figure_density``: each figure's PNG pixels per CSS pixel shown (2 or more is sharp on a
  phone's or a laptop's high-density screen).

`python tests/reading_metrics.py [report.json]` prints the per-page table from the browser
test's report (`_build/screenshots/report.json` under `make test`).
`python tests/reading_metrics.py --html DIR [--build] book/03_performer_favor ...` measures
the given pages of a built book in DIR (`--build` builds the whole book into DIR/.. first, so
that several people can measure their own copies) and prints the table and what fails.
"""
from __future__ import annotations

import argparse
import functools
import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The goals of issue 31 (the reading rules); test_browser.py asserts them.
MAX_CLIPPED_WIDE = 0          # display equations cut at 1280 px, whole book
MAX_CLIPPED_NARROW = 5        # display equations cut at 390 px, whole book
MAX_CLIPPED_FORMULAS = 0      # inline formulas, and display ones in folds, cut at 1280 or 390 px
MAX_CODE_SHARE = 0.30         # code + text output per chapter page, at 1280 px
MAX_FACT_CHECKS = 3           # fact-check notes per page
MAX_SCROLLING_CODE = 10       # code blocks that scroll sideways at 1280 px, whole book
FIRST_FIGURE_PX = 1800        # a chapter's key figure within its first two screens (900 px each)
MIN_TEXT_PX = 10              # figure text as rendered at 1280 px
MIN_FIGURE_DENSITY = 1.95     # PNG pixels per CSS pixel of every figure, at 1280 and 390 px

READING_SCRIPT = """() => {
  const vw = document.documentElement.clientWidth;
  const article = document.querySelector('article.bd-article') || document.querySelector('main')
                  || document.body;
  // visible to a reader: Chromium keeps layout boxes (and client rects) for the content of a
  // closed <details>, so ask checkVisibility() where the browser has it
  const shown = e => (e.checkVisibility ? e.checkVisibility() : e.getClientRects().length > 0);
  const height = e => e.getBoundingClientRect().height;
  const label = e => (e.getAttribute('aria-label') || e.textContent).replace(/\\s+/g, ' ')
                     .slice(0, 70);
  // the horizontal extent a reader sees of an element: cut by clipping ancestors and the window
  const seen = el => {
    let left = 0, right = vw;
    for (let e = el; e && e !== document.documentElement; e = e.parentElement) {
      if (getComputedStyle(e).overflowX !== 'visible') {
        const r = e.getBoundingClientRect();
        left = Math.max(left, r.left); right = Math.min(right, r.right);
      }
    }
    return [left, right];
  };
  const mathClipped = [...article.querySelectorAll('mjx-container[display="true"]')]
    .filter(shown).filter(m => {
      const r = (m.querySelector('mjx-math') || m).getBoundingClientRect();
      const [left, right] = seen(m);
      return r.right > right + 1 || r.left < left - 1;
    }).map(label);
  // code cells: the source when shown, the toggle bar when folded; text outputs
  const cells = [...article.querySelectorAll('.cell')];
  let code = 0;
  for (const cell of cells) {
    for (const input of cell.querySelectorAll('.cell_input')) if (shown(input)) code += height(input);
    for (const d of cell.querySelectorAll('details.hide')) {  // a folded cell: its toggle bar
      const bar = d.querySelector('summary');
      if (!d.open && bar) code += height(bar);
    }
    for (const out of cell.querySelectorAll('.cell_output > .output, .cell_output > div')) {
      if (!shown(out) || out.querySelector('img, .linattn-slider')) continue;
      code += height(out);
    }
  }
  const facts = [...article.querySelectorAll('.admonition')].filter(a => {
    const t = a.querySelector('.admonition-title');
    return t && /^\\s*Fact check/.test(t.textContent);
  }).map(a => a.querySelector('.admonition-title').textContent.trim().slice(0, 70));
  // open every fold to find code blocks that scroll sideways, then restore
  // (solutions are sphinx-togglebutton dropdowns: shown by dropping their toggle-hidden class)
  const closed = [...document.querySelectorAll('details')].filter(d => !d.open);
  const toggled = [...document.querySelectorAll('.toggle-hidden')];
  closed.forEach(d => { d.open = true; });
  toggled.forEach(e => e.classList.remove('toggle-hidden'));
  const scrolling = [...article.querySelectorAll('pre')].filter(shown)
    .filter(p => p.scrollWidth > p.clientWidth + 1)
    .map(p => p.textContent.split('\\n').reduce((a, b) => (b.length > a.length ? b : a), '')
                .slice(0, 90));
  // formulas cut off with solutions and other folds opened: inline ones of the text (a table
  // scrolls sideways as a whole, so formulas in tables are left out), and display ones that
  // only an opened fold shows
  const cut = m => {
    const r = (m.querySelector('mjx-math') || m).getBoundingClientRect();
    const [left, right] = seen(m);
    return r.width > 0 && (r.right > right + 1 || r.left < left - 1);
  };
  const inlineClipped = [...article.querySelectorAll('mjx-container:not([display="true"])')]
    .filter(shown).filter(m => !m.closest('table')).filter(cut).map(label);
  const foldedClipped = [...article.querySelectorAll(
    'details mjx-container[display="true"], .toggle mjx-container[display="true"]')]
    .filter(shown).filter(cut).map(label);
  closed.forEach(d => { d.open = false; });
  toggled.forEach(e => e.classList.add('toggle-hidden'));
  const imgs = [...article.querySelectorAll('.cell_output img, img')].filter(shown);
  const tops = imgs.map(i => i.getBoundingClientRect().top + window.scrollY);
  const figures = [...article.querySelectorAll('.cell_output img')].filter(shown)
    .filter(i => i.naturalWidth > 0);
  // a figure's width at its layout dpi (100): a retina PNG's <img> says it (myst-nb's inline
  // style, or a width attribute: static sliders' frames); another PNG is that wide itself
  const layoutWidth = i => parseFloat(i.style.width) || Number(i.getAttribute('width'))
    || i.naturalWidth;
  return {
    first_figure_px: tops.length ? Math.round(Math.min(...tops)) : null,
    figure_scales: figures.map(i => i.getBoundingClientRect().width / layoutWidth(i)),
    figure_density: figures.map(i => i.naturalWidth / i.getBoundingClientRect().width),
    viewport: vw,
    page_overflow_px: Math.max(0, document.documentElement.scrollWidth - vw),
    article_px: Math.round(height(article)),
    code_px: Math.round(code),
    code_share: height(article) > 0 ? code / height(article) : 0,
    math_display: article.querySelectorAll('mjx-container[display="true"]').length,
    math_clipped: mathClipped,
    inline_math_clipped: inlineClipped,
    folded_math_clipped: foldedClipped,
    fact_checks: facts,
    code_scrolling: scrolling,
  };
}"""


def table(reports: dict[str, dict]) -> str:
    """One row per page: code share, clipped equations at both widths and inline ones at 390 px, fact checks,
    scrolling code blocks, page overflow at 390 px."""
    head = (f"{'page':34} {'code':>5} {'cut1280':>7} {'cut390':>6} {'inl390':>6} {'facts':>5} {'scroll':>6} "
            f"{'wide390':>7}")
    rows = [head]
    for name, rep in reports.items():
        wide, narrow = rep.get("reading"), rep.get("reading_390")
        if not wide or not narrow:
            continue
        rows.append(
            f"{name:34} {wide['code_share']:5.0%} {len(wide['math_clipped']):7d} "
            f"{len(narrow['math_clipped']):6d} {len(narrow.get('inline_math_clipped', ())):6d} "
            f"{len(wide['fact_checks']):5d} "
            f"{len(wide['code_scrolling']):6d} {narrow['page_overflow_px']:7d}"
        )
    return "\n".join(rows)


def measure(html_dir: Path, pages: list[str], chromium: str = "/usr/bin/chromium") -> dict:
    """Open each page of a built book in headless Chromium; READING_SCRIPT at 1280 and 390 px."""
    from playwright.sync_api import sync_playwright

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(html_dir)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    out = {}
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--headless", "--no-sandbox"])
            for name in pages:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                page.goto(f"http://127.0.0.1:{httpd.server_port}/{name}.html", wait_until="load")
                if page.locator('script[src*="mathjax"]').count():
                    page.wait_for_function("() => window.MathJax && MathJax.startup && MathJax.startup.promise")
                    page.evaluate("() => MathJax.startup.promise")
                out[name] = {"reading": page.evaluate(READING_SCRIPT)}
                page.set_viewport_size({"width": 390, "height": 844})
                page.evaluate("() => new Promise(r => requestAnimationFrame(() => requestAnimationFrame(r)))")
                out[name]["reading_390"] = page.evaluate(READING_SCRIPT)
                page.close()
            browser.close()
    finally:
        httpd.shutdown()
    return out


def _details(reports: dict) -> str:
    lines = []
    for name, rep in reports.items():
        wide, narrow = rep["reading"], rep["reading_390"]
        for label, items in (("cut at 1280", wide["math_clipped"]), ("cut at 390", narrow["math_clipped"]),
                             ("inline cut at 1280", wide.get("inline_math_clipped", ())),
                             ("inline cut at 390", narrow.get("inline_math_clipped", ())),
                             ("folded cut at 390", narrow.get("folded_math_clipped", ())),
                             ("scrolls at 1280", wide["code_scrolling"]), ("fact check", wide["fact_checks"])):
            lines += [f"{name}: {label}: {item}" for item in items]
        for width, where in (("1280", wide), ("390", narrow)):
            blurry = [round(d, 2) for d in where.get("figure_density", ()) if d < MIN_FIGURE_DENSITY]
            if blurry:
                lines.append(f"{name}: figures blurry at {width} (PNG px per px shown): {blurry}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pages", nargs="*", help="pages such as book/03_performer_favor (with --html)")
    ap.add_argument("--report", default="_build/screenshots/report.json")
    ap.add_argument("--html", help="a built book's html folder to measure")
    ap.add_argument("--build", action="store_true", help="build the book into --html's parent first")
    args = ap.parse_args(argv)
    if not args.html:
        print(table(json.loads(Path(args.report).read_text())))
        return
    html = Path(args.html).resolve()
    if args.build:
        out = html.parent.parent if html.name == "html" else html.parent
        jb = Path(sys.executable).with_name("jupyter-book")
        # no -W: a page not yet in _toc.yml (a new notebook) must not stop the measurement
        subprocess.run([str(jb), "build", str(ROOT), "-n", "--keep-going", "--path-output", str(out)],
                       check=True, stdout=subprocess.DEVNULL)
        html = out / "_build" / "html"
    reports = measure(html, args.pages)
    print(table(reports))
    print(_details(reports))


if __name__ == "__main__":
    main()
