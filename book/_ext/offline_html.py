"""Sphinx extension for the book's HTML: nothing from the network, no script errors.

Loaded from `_config.yml` (`sphinx: local_extensions`). On every page it

* removes sphinx-thebe's scripts. Jupyter Book always loads sphinx-thebe, whose inline
  configuration (`const THEBE_JS_URL = ...`) ends up twice in each page: the second copy throws
  "Identifier 'THEBE_JS_URL' has already been declared". The book has no Thebe button (live code
  would need a Binder server over the network); readers run the notebooks locally or on Colab.
  If `launch_buttons.thebe` is switched on, the scripts stay and only the duplicate goes;
* drops any other duplicate script;
* warns (an error under `-W`) when a page would load a script or stylesheet from another host:
  the book must read offline, so such files are vendored into `book/_static`;
* sets the theme's `default_mode` (pydata-sphinx-theme leaves it empty, and a first visit then
  logs "Got invalid theme mode" as a console error).

tests/test_browser.py checks the result in Chromium.
"""
from __future__ import annotations

from urllib.parse import urlsplit

from sphinx.util import logging

logger = logging.getLogger(__name__)


def _filename(asset) -> str:
    return str(getattr(asset, "filename", asset) or "")


def _is_remote(url: str) -> bool:
    return url.startswith("//") or urlsplit(url).scheme in ("http", "https")


def _config_inited(app, config) -> None:
    config.html_context.setdefault("default_mode", "auto")


def _page_context(app, pagename, templatename, context, doctree) -> None:
    thebe = bool((app.config.html_theme_options or {}).get("launch_buttons", {}).get("thebe"))
    scripts = context.get("script_files")
    if scripts is not None:
        kept, seen = [], set()
        for js in scripts:
            name = _filename(js)
            body = getattr(js, "attributes", {}).get("body", "")
            if not thebe and ("THEBE_JS_URL" in body or name.endswith("sphinx-thebe.js")):
                continue
            key = (name, body)
            if key in seen:
                continue
            seen.add(key)
            kept.append(js)
        scripts[:] = kept
    for kind in ("script_files", "css_files"):
        for asset in context.get(kind) or []:
            url = _filename(asset)
            if _is_remote(url):
                logger.warning(
                    f"{pagename}: the page would load {url} from the network; vendor it into book/_static "
                    "(the book must read offline)", type="offline_html", subtype="remote_asset")


def setup(app):
    app.connect("config-inited", _config_inited)
    app.connect("html-page-context", _page_context, priority=900)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
