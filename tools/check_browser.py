"""Open the built book in headless Chromium and check every page as a reader would see it.

For the front page and every chapter page (from file://, with no server):
  - the math is typeset: MathJax output elements are present and no raw `\\(` or `$$` is left;
  - every image has loaded (complete, with a natural width);
  - no request leaves the build folder (no CDN, no fonts, no analytics).
One screenshot per page is saved under _build/screenshots/. Exits non-zero on any failure.
"""

import json
import sys
from pathlib import Path

import yaml
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
  };
}"""


def pages() -> list[tuple[str, Path]]:
    """The front page and every document in _toc.yml, as (name, html path)."""
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    files = [toc["root"]] + [ch["file"] for part in toc["parts"] for ch in part["chapters"]]
    return [(f, HTML / f"{f}.html") for f in files]


def check_page(browser, name: str, path: Path) -> list[str]:
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
    summary = {"typeset": state["typeset"], "images": len(state["images"]), "outside": len(outside)}
    print(f"{'FAIL' if problems else 'ok  '} {name}: {json.dumps(summary)}")
    return problems


def main() -> int:
    if not (HTML / "index.html").is_file():
        print(f"no built book at {HTML}: run `make book` first")
        return 1
    failures = 0
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        for name, path in pages():
            if not path.is_file():
                print(f"FAIL {name}: {path} was not built")
                failures += 1
                continue
            for problem in check_page(browser, name, path):
                print(f"     - {problem}")
                failures += 1
        browser.close()
    print(f"browser check: {len(pages())} pages, {failures} problem(s); screenshots in {SHOTS.relative_to(ROOT)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
