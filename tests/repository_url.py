"""The repository's URL lives in one place, `repository.url` in `_config.yml`; this script
copies it everywhere else a reader or a tool needs it (`make repo-url URL=...`).

    python tests/repository_url.py                       # list every place and its URL
    python tests/repository_url.py https://host/me/fork  # set _config.yml and every place

The places: the Colab bootstrap cell of every notebook (`url = "git+<URL>"`), the README's
and the introduction's install lines (`git+<URL>`, `git clone <URL>` and the folder that
makes), and pyproject.toml's Homepage. The book's launch and repository buttons read
`_config.yml` itself. tests/test_book_structure.py checks that every place agrees with it.

This is a script, not a test module: pytest only collects test_*.py files.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "_config.yml"
_CONFIG_URL = re.compile(r"^(repository:\n(?:[ \t]+.*\n)*?[ \t]+url:[ \t]*)(\S+)", re.M)
URL = r"[a-z]+://[^\s\"'`)]+?"
# (file glob, pattern whose group "url" is the repository URL) for every place but _config.yml
PLACES = [
    ("book/*.ipynb", re.compile(rf'url = \\"git\+(?P<url>{URL})\\"')),
    ("README.md", re.compile(rf'git\+(?P<url>{URL})"')),
    ("book/intro.md", re.compile(rf'git\+(?P<url>{URL})"')),
    ("book/intro.md", re.compile(rf"git clone (?P<url>{URL})\n")),
    ("pyproject.toml", re.compile(rf'^Homepage = "(?P<url>{URL})"', re.M)),
]
_CD = re.compile(r"(git clone \S+\ncd )(\S+)")


def configured_url() -> str:
    """`repository.url` of _config.yml, without a trailing slash."""
    m = _CONFIG_URL.search(CONFIG.read_text(encoding="utf-8"))
    if m is None:
        raise SystemExit(f"{CONFIG}: no repository.url")
    return m.group(2).rstrip("/")


def found() -> list[tuple[str, str]]:
    """(file relative to the root, URL) for every place the URL is written outside _config.yml."""
    out = []
    for pattern, regex in PLACES:
        for path in sorted(ROOT.glob(pattern)):
            text = path.read_text(encoding="utf-8")
            out += [(str(path.relative_to(ROOT)), m.group("url")) for m in regex.finditer(text)]
    return out


def set_url(url: str) -> list[str]:
    """Write `url` into _config.yml and every place; returns the files changed."""
    url = url.rstrip("/")
    if not re.fullmatch(URL, url):
        raise SystemExit(f"not a URL: {url!r}")
    changed = []
    text = CONFIG.read_text(encoding="utf-8")
    new = _CONFIG_URL.sub(lambda m: m.group(1) + url, text, count=1)
    files = {CONFIG: (text, new)}
    for pattern, regex in PLACES:
        for path in sorted(ROOT.glob(pattern)):
            old, cur = files.get(path, (None, None))
            cur = cur if cur is not None else path.read_text(encoding="utf-8")
            cur = regex.sub(lambda m: m.group(0).replace(m.group("url"), url), cur)
            if path.name == "intro.md":
                cur = _CD.sub(lambda m: m.group(1) + url.rsplit("/", 1)[-1].removesuffix(".git"), cur)
            files[path] = (old if old is not None else path.read_text(encoding="utf-8"), cur)
    for path, (old, cur) in files.items():
        if cur != old:
            path.write_text(cur, encoding="utf-8")
            changed.append(str(path.relative_to(ROOT)))
    return changed


def main(argv: list[str]) -> int:
    if argv:
        for name in set_url(argv[0]):
            print(f"updated {name}")
        return 0
    print(f"_config.yml: {configured_url()}")
    for name, url in found():
        print(f"{name}: {url}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
