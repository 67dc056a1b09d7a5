"""Every link of the built book either stays inside _build/html and resolves, or is an intentional external link.

Run alone (`python tools/check_links.py`) or from tools/check_browser.py, which also feeds it the links the
pages' scripts add at run time. For every `href` and `src` of every page (the .html files of _build/html,
except the theme's templates in _static/ and the copied sources in _sources/):
  - an internal link must name an existing file inside _build/html, and its #anchor an existing id (or <a name>)
    of that file; a bare "#anchor" must exist in the page itself ("#" alone is a button's dummy link);
  - a link that leaves _build/html (http:, https:, mailto:, //host, ...) must be listed in
    tools/external_links.txt, with the reason it is there; a listed link that no page uses is reported too.
"""

import sys
from collections.abc import Iterable
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "_build" / "html"
ALLOWLIST = Path(__file__).resolve().parent / "external_links.txt"
NOT_PAGES = ("_static", "_sources")


class _Collector(HTMLParser):
    """The href/src values and the anchor targets (id, <a name>) of one HTML file."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name in ("href", "src"):
                self.links.append(value)
            elif name == "id" or (tag == "a" and name == "name"):
                self.ids.add(value)


def parse(path: Path) -> _Collector:
    collector = _Collector()
    collector.feed(path.read_text(encoding="utf-8"))
    return collector


def load_allowlist(path: Path = ALLOWLIST) -> dict[str, str]:
    """URL -> reason. One entry a line: the exact URL, whitespace, the reason; '#' starts a comment line."""
    allowed: dict[str, str] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        url, _, reason = line.partition(" ")
        if not is_external(url) or urlsplit(url).scheme != "https":
            raise ValueError(f"{path.name}:{number}: {url!r} is not an https:// URL")
        if not reason.strip():
            raise ValueError(f"{path.name}:{number}: {url} has no reason")
        if url in allowed:
            raise ValueError(f"{path.name}:{number}: {url} is listed twice")
        allowed[url] = reason.strip()
    return allowed


def is_external(href: str) -> bool:
    """True for a link that leaves the build folder: any scheme (http:, mailto:, file:, ...) or //host."""
    parts = urlsplit(href.strip())
    return bool(parts.scheme) or bool(parts.netloc)


def classify(href: str, page: Path, root: Path = HTML) -> tuple[str, Path | None, str]:
    """("external", None, ""), ("internal", file, anchor) or ("outside", file, anchor) for a link on `page`.

    "outside" is a relative link that climbs out of `root` (it would open the reader's own files).
    A bare "#anchor" points at `page` itself; a query string is ignored.
    """
    href = href.strip()
    if is_external(href):
        return "external", None, ""
    parts = urlsplit(href)
    target = page if not parts.path else (page.parent / unquote(parts.path)).resolve()
    kind = "internal" if target == root.resolve() or root.resolve() in target.parents else "outside"
    return kind, target, unquote(parts.fragment)


def link_problems(
    href: str, page: Path, allowed: dict[str, str], ids_of, root: Path = HTML, used: set[str] | None = None
) -> list[str]:
    """What is wrong with one link ([] if nothing). `ids_of(file)` gives the anchor targets of a built file."""
    kind, target, anchor = classify(href, page, root)
    if kind == "external":
        if href.strip() in allowed:
            if used is not None:
                used.add(href.strip())
            return []
        return [f"external link not in {ALLOWLIST.name}: {href}"]
    if kind == "outside":
        return [f"link leaves the build folder: {href}"]
    if target.is_dir():
        target = target / "index.html"
    if not target.is_file():
        return [f"link to a missing file: {href}"]
    if anchor and target.suffix == ".html" and anchor not in ids_of(target):
        return [f"link to a missing anchor: {href}"]
    return []


def built_pages(root: Path = HTML) -> list[Path]:
    return sorted(p for p in root.rglob("*.html") if p.relative_to(root).parts[0] not in NOT_PAGES)


class LinkChecker:
    """Checks the links of the built pages, plus any extra (page, href) pairs, against one allowlist."""

    def __init__(self, root: Path = HTML, allowlist: Path = ALLOWLIST) -> None:
        self.root = root
        self.allowed = load_allowlist(allowlist)
        self.used: set[str] = set()
        self._ids: dict[Path, set[str]] = {}
        self.checked = 0

    def ids_of(self, path: Path) -> set[str]:
        if path not in self._ids:
            self._ids[path] = parse(path).ids
        return self._ids[path]

    def check(self, page: Path, hrefs: Iterable[str]) -> list[str]:
        problems = []
        for href in dict.fromkeys(hrefs):  # each distinct link of a page once
            self.checked += 1
            problems += link_problems(href, page, self.allowed, self.ids_of, self.root, self.used)
        return problems

    def check_built_pages(self) -> dict[Path, list[str]]:
        return {page: self.check(page, parse(page).links) for page in built_pages(self.root)}

    def unused(self) -> list[str]:
        return [f"{ALLOWLIST.name} lists {url}, which no page links to" for url in self.allowed if url not in self.used]


def main() -> int:
    if not (HTML / "index.html").is_file():
        print(f"no built book at {HTML}: run `make book` first")
        return 1
    checker = LinkChecker()
    found = checker.check_built_pages()
    problems = [f"{page.relative_to(HTML)}: {p}" for page, ps in found.items() for p in ps] + checker.unused()
    for problem in problems:
        print(f"     - {problem}")
    print(f"link check: {len(found)} pages, {checker.checked} links, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
