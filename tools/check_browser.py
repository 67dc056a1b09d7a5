"""Open the built book in headless Chromium and check every page as a reader would see it.

For the front page and every chapter page (from file://, with no server):
  - the math is typeset: MathJax output elements are present and no raw `\\(` or `$$` is left;
  - every image has loaded (complete, with a natural width);
  - no request leaves the build folder (no CDN, no fonts, no analytics);
  - every link (href, src) of the page as rendered, scripts' additions included, stays inside the build folder
    and resolves (file and #anchor), or is an intentional external link of tools/external_links.txt;
  - the page's <title> does not repeat itself (Jupyter Book writes "<heading> — <book title>": a heading that
    is the book's title gives "Transformer, Twice — Transformer, Twice");
  - every cell of the notebook tagged `diagram` is rendered (Jupyter Book turns a cell's tags into CSS classes,
    `tag_diagram`), displays its image, and the image has loaded; each is screenshotted on its own into
    _build/screenshots/diagrams/<page>_<i>.png.
Before the browser, every link of every built page (genindex and search too) is checked the same way, from the
HTML files (tools/check_links.py). One screenshot per page is saved under _build/screenshots/, one per diagram
under its diagrams/ folder.
Exits non-zero on any failure.
"""

import json
import sys
from pathlib import Path

import yaml
from check_links import LinkChecker, built_pages
from playwright.sync_api import TimeoutError as PlaywrightTimeout
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]
HTML = ROOT / "_build" / "html"
SHOTS = ROOT / "_build" / "screenshots"
DIAGRAM_SHOTS = SHOTS / "diagrams"
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


DIAGRAM_IMAGES = """cell => [...cell.querySelectorAll('.cell_output img')].map(
  i => ({src: i.currentSrc || i.src, ok: i.complete && i.naturalWidth > 0}))"""


def tagged_diagrams(name: str) -> int:
    """How many cells of the page's notebook carry the tag `diagram` (0 for a page that is not a notebook)."""
    source = ROOT / f"{name}.ipynb"
    if not source.is_file():
        return 0
    cells = json.loads(source.read_text())["cells"]
    return sum("diagram" in c.get("metadata", {}).get("tags", []) for c in cells)


def title_problems(title: str) -> list[str]:
    """A page title whose " — "-separated parts repeat, as "Transformer, Twice — Transformer, Twice"."""
    parts = [part.strip().casefold() for part in title.split(" — ")]
    return [f"the page's title repeats itself: {title!r}"] if len(set(parts)) < len(parts) else []


def check_diagrams(page, name: str) -> tuple[int, list[str]]:
    """Screenshot every rendered diagram cell of the page; the problems: a tagged cell not rendered as one, a
    diagram without an image, an image that did not load."""
    problems, cells = [], page.locator(".tag_diagram").all()
    expected = tagged_diagrams(name)
    if len(cells) != expected:
        problems.append(f"{expected} cell(s) tagged 'diagram' in the notebook, {len(cells)} rendered as .tag_diagram")
    DIAGRAM_SHOTS.mkdir(parents=True, exist_ok=True)
    for i, cell in enumerate(cells):
        output = cell.locator(".cell_output")
        if output.count() == 0:
            problems.append(f"diagram {i} has no output")
            continue
        output.first.scroll_into_view_if_needed()
        try:
            page.wait_for_function(
                "cell => [...cell.querySelectorAll('.cell_output img')].every(i => i.complete)",
                arg=cell.element_handle(),
                timeout=5000,
            )
        except PlaywrightTimeout:
            pass  # reported below as not loaded
        images = cell.evaluate(DIAGRAM_IMAGES)
        if not images:
            problems.append(f"diagram {i} displays no image")
        problems += [f"diagram {i}: image did not load: {img['src']}" for img in images if not img["ok"]]
        output.first.screenshot(path=str(DIAGRAM_SHOTS / f"{Path(name).name}_{i}.png"))
    return len(cells), problems


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
    title = page.title()
    page.wait_for_timeout(300)
    SHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SHOTS / f"{name.replace('/', '_')}.png"), full_page=False)
    n_diagrams, diagram_problems = check_diagrams(page, name)
    page.close()
    needs_math = name == "intro" or name.startswith("chapters/")
    if needs_math and (not state["mathjax"] or state["typeset"] == 0):
        problems.append(f"math not typeset (MathJax loaded: {state['mathjax']}, typeset: {state['typeset']})")
    if state["raw_math"]:
        problems.append(f"{state['raw_math']} raw math delimiter(s) left in the text")
    problems += [f"image did not load: {img['src']}" for img in state["images"] if not img["ok"]]
    problems += [f"request outside the build folder: {url}" for url in outside]
    problems += links.check(path, state["links"])
    problems += title_problems(title) + diagram_problems
    summary = {"typeset": state["typeset"], "images": len(state["images"]), "outside": len(outside)}
    summary["diagrams"] = n_diagrams
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
    print(f"browser check: {len(pages())} pages, {failures} problem(s); screenshots in {SHOTS.relative_to(ROOT)}"
          f" (diagrams in {DIAGRAM_SHOTS.relative_to(ROOT)})")  # fmt: skip
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
