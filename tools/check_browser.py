"""Open the built book in headless Chromium and check every page as a reader would see it.

For the front page and every chapter page (from file://, with no server):
  - the math is typeset: MathJax output elements are present and no raw `\\(` or `$$` is left;
  - every image has loaded (complete, with a natural width);
  - no request leaves the build folder (no CDN, no fonts, no analytics);
  - every link (href, src) of the page as rendered, scripts' additions included, stays inside the build folder
    and resolves (file and #anchor), or is an intentional external link of tools/external_links.txt.
Before the browser, every link of every built page (genindex and search too) is checked the same way, from the
HTML files (tools/check_links.py). One screenshot per page is saved under _build/screenshots/.
Exits non-zero on any failure.
"""

import json
import sys
from pathlib import Path

import yaml
from check_links import LinkChecker, built_pages
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "_build" / "html"
SHOTS = ROOT / "_build" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

PAGE_STATE = """async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) { await MathJax.startup.promise; }
  const main = document.querySelector('main') || document.body;
  const imgs = [...document.images].map(i => ({src: i.currentSrc || i.src, ok: i.complete && i.naturalWidth > 0}));
  return {
    mathjax: !!window.MathJax,
    typeset: document.querySelectorAll('mjx-container').length,
    raw_math: (main.innerText.match(/\\\\\\(|\\\\\\[|\\$\\$/g) || []).length,
    images: imgs,
    links: [...document.querySelectorAll('[href], [src]')].map(e => e.getAttribute('href') ?? e.getAttribute('src')),
  };
}"""


def pages() -> list[tuple[str, Path]]:
    """The front page and every document in _toc.yml, as (name, html path)."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]] + [ch["file"] for part in toc["parts"] for ch in part["chapters"]]
    return [(f, HTML / f"{f}.html") for f in files]


def check_page(browser, name: str, path: Path, links: LinkChecker) -> list[str]:
    problems, outside = [], []
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    base = HTML.as_uri()

    def record(request):
        if not request.url.startswith((base, "data:", "blob:")):
            outside.append(request.url)

    page.on("request", record)
    page.goto(path.as_uri(), wait_until="load")
    state = page.evaluate(PAGE_STATE)
    page.wait_for_timeout(300)
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name.replace('/', '_')}.png"), full_page=False)
    page.close()
    needs_math = name == "intro" or name.startswith("chapters/")
    if needs_math and (not state["mathjax"] or state["typeset"] == 0):
        problems.append(f"math not typeset (MathJax loaded: {state['mathjax']}, typeset: {state['typeset']})")
    if state["raw_math"]:
        problems.append(f"{state['raw_math']} raw math delimiter(s) left in the text")
    problems += [f"image did not load: {img['src']}" for img in state["images"] if not img["ok"]]
    problems += [f"request outside the build folder: {url}" for url in outside]
    problems += links.check(path, state["links"])
    summary = {"typeset": state["typeset"], "images": len(state["images"]), "outside": len(outside)}
    summary["links"] = len(set(state["links"]))
    print(f"{'FAIL' if problems else 'ok  '} {name}: {json.dumps(summary)}")
    return problems


def main() -> int:
    if not (HTML / "index.html").is_file():
        print(f"no built book at {HTML}: run `make book` first")
        return 1
    links = LinkChecker()
    failures = 0
    for page, problems in links.check_built_pages().items():
        for problem in problems:
            print(f"FAIL {page.relative_to(HTML)}: {problem}")
            failures += 1
    print(f"links of the built files: {len(built_pages())} pages read, {links.checked} links checked")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        for name, path in pages():
            if not path.is_file():
                print(f"FAIL {name}: {path} was not built")
                failures += 1
                continue
            for problem in check_page(browser, name, path, links):
                print(f"     - {problem}")
                failures += 1
        browser.close()
    for problem in links.unused():
        print(f"FAIL {problem}")
        failures += 1
    print(f"browser check: {len(pages())} pages, {failures} problem(s); screenshots in {SHOTS.relative_to(ROOT)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
