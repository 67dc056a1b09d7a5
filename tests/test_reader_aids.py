"""The reader's aids: every chapter's signpost box, no plotting code on show, diagrams that display, a front page
whose title does not repeat the book's.

The built page's title is checked in the browser (tools/check_browser.py); this file checks the sources.
"""

import ast
import html
import re
import sys
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))
HIDDEN = {"hide-input", "remove-input", "hide-cell", "remove-cell"}


def first_markdown(path: Path) -> str:
    nb = nbformat.read(path, as_version=4)
    return next(c.source for c in nb.cells if c.cell_type == "markdown")


# ---------------------------------------------------------------------------------------------------------------
# Signposts: the box of the helpers' brief, directly under the chapter's title.

BULLETS = ("You will build", "You need", "Runs in")


def signpost_problems(text: str, file_name: str) -> list[str]:
    """What is wrong with the signpost box at the top of a chapter's first markdown cell (empty: nothing)."""
    lines = text.splitlines()
    head = [":::{admonition} At a glance", ":class: signpost", ""]
    if len(lines) < 6 or lines[1] != "" or lines[2:5] != head:
        return [f"lines 2-5 should be a blank line and {head[:2]} and a blank line, got {lines[1:5]}"]
    bullets, i = [], 5
    while i < len(lines) and lines[i] != ":::":
        if lines[i].startswith("- "):
            bullets.append(lines[i])
        elif lines[i].startswith("  ") and bullets and lines[i].strip():
            bullets[-1] += " " + lines[i].strip()  # a bullet wrapped onto the next line
        else:
            return [f"line {i + 1} of the box is neither a bullet nor its continuation: {lines[i]!r}"]
        i += 1
    problems = []
    if i == len(lines):
        return ["the box is not closed by a line ':::'"]
    if i + 1 < len(lines) and lines[i + 1] != "":
        problems.append(f"the line after the box's ':::' should be blank, got {lines[i + 1]!r}")
    labels = [re.match(r"- \*\*([^*]+):\*\*", b) for b in bullets]
    found = tuple(m.group(1) if m else b for m, b in zip(labels, bullets, strict=True))
    if found != BULLETS:
        return problems + [f"the bullets should be {BULLETS}, in this order, got {found}"]
    for label, bullet in zip(BULLETS, bullets, strict=True):
        if not bullet.split(":**", 1)[1].strip():
            problems.append(f"'{label}' is empty")
    runs_in = bullets[2].split(":**", 1)[1].strip()
    expected = f"on a 2-core CPU (`make notebooks NB=chapters/{file_name}`)"
    if not re.fullmatch(r"about \S.* " + re.escape(expected), runs_in):
        problems.append(f"'Runs in' should read 'about <time> {expected}', got {runs_in!r}")
    return problems


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_chapter_opens_with_its_signpost(path):
    problems = signpost_problems(first_markdown(path), path.name)
    assert not problems, f"{path.name}: " + "; ".join(problems)


GOOD_BOX = """# 5. Scaled dot-product attention

:::{admonition} At a glance
:class: signpost

- **You will build:** attention.
- **You need:** chapters 1 and 4.
- **Runs in:** about 20 s on a 2-core CPU (`make notebooks NB=chapters/05_attention.ipynb`)
:::

Attention is the one operation that lets a token look at the other tokens."""


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s.replace("At a glance", "Overview"),
        lambda s: s.replace(":class: signpost\n", ""),
        lambda s: s.replace("- **You need:** chapters 1 and 4.\n", ""),
        lambda s: s.replace("chapters 1 and 4.", ""),
        lambda s: s.replace("05_attention.ipynb", "06_multi_head_attention.ipynb"),
        lambda s: s.replace("about 20 s", "20 s"),
        lambda s: s.replace("\n:::\n", "\n"),
        lambda s: s.replace("# 5. Scaled dot-product attention\n\n", "# 5. Scaled dot-product attention\n"),
        lambda s: s.replace("- **Runs in:**", "- **Runtime:**"),
    ],
)
def test_signpost_check_refuses_a_broken_box(change):
    assert signpost_problems(GOOD_BOX, "05_attention.ipynb") == []
    broken = change(GOOD_BOX)
    assert broken != GOOD_BOX
    assert signpost_problems(broken, "05_attention.ipynb") != []


# ---------------------------------------------------------------------------------------------------------------
# Plotting-only code cells hide their code.

PLOT_ROOT = re.compile(r"(plt|mpl|matplotlib|fig\w*|ax\w*|axes\w*)")


def _root(node) -> str:
    """The name at the root of `a.b[0].c(...)`: 'a' ('' if it is not a name)."""
    while isinstance(node, (ast.Attribute, ast.Subscript, ast.Call)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else ""


def _is_plot_call(node) -> bool:
    """A call on a matplotlib object (plt.*, fig.*, ax.*, axes[i].*), or display(fig)."""
    if not isinstance(node, ast.Call):
        return False
    if isinstance(node.func, ast.Name) and node.func.id == "display":
        return bool(node.args) and all(isinstance(a, ast.Name) and PLOT_ROOT.fullmatch(a.id) for a in node.args)
    return isinstance(node.func, ast.Attribute) and bool(PLOT_ROOT.fullmatch(_root(node.func)))


def _is_plot_statement(stmt, read_later: set[str]) -> bool:
    """Plotting calls; `fig, ax = plt.subplots(...)`; loops, ifs and withs of plotting statements; and the
    assignments that only feed this cell's plot (names no later cell reads)."""
    if isinstance(stmt, ast.Expr):
        return _is_plot_call(stmt.value)
    if isinstance(stmt, (ast.Assign, ast.AnnAssign)):
        targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
        if isinstance(stmt.value, ast.Call) and _root(stmt.value.func) == "plt":
            return True
        names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        if all(isinstance(t, (ast.Name, ast.Tuple, ast.List)) for t in targets):
            return not set(names) & read_later
        return all(PLOT_ROOT.fullmatch(_root(t)) for t in targets)  # ax.title = ..., fig.axes[0].x = ...
    if isinstance(stmt, (ast.For, ast.If, ast.With)):
        body = stmt.body + getattr(stmt, "orelse", [])
        return all(_is_plot_statement(s, read_later) for s in body)
    if isinstance(stmt, ast.Import):
        return all(a.name.startswith("matplotlib") for a in stmt.names)
    if isinstance(stmt, ast.ImportFrom):
        return (stmt.module or "").startswith("matplotlib")
    return isinstance(stmt, ast.Pass)


def _parse(source: str) -> ast.Module:
    """A code cell as Python, its IPython magics and shell lines blanked."""
    return ast.parse("\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in source.splitlines()))


def plotting_cells_on_show(cells) -> list[tuple[int, int]]:
    """(cell index, lines of code) of the code cells that only plot, have more than 3 lines and show their code."""
    code = [(i, c) for i, c in enumerate(cells) if c.cell_type == "code"]
    trees = [_parse(c.source) for _, c in code]
    reads = [{n.id for n in ast.walk(t) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} for t in trees]
    shown = []
    for k, (i, cell) in enumerate(code):
        tree, read_later = trees[k], set().union(*reads[k + 1 :])
        lines = [ln for ln in cell.source.splitlines() if ln.strip() and not ln.strip().startswith("#")]
        plots = any(_is_plot_call(n) for n in ast.walk(tree))
        if plots and tree.body and all(_is_plot_statement(s, read_later) for s in tree.body) and len(lines) > 3:
            if not HIDDEN & set(cell.metadata.get("tags", [])):
                shown.append((i, len(lines)))
    return shown


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_plotting_only_cells_hide_their_code(path):
    shown = plotting_cells_on_show(nbformat.read(path, as_version=4).cells)
    assert not shown, f"{path.name}: plotting-only code cells shown (index, lines), tag them hide-input: {shown}"


def _cells(*sources, tags=None):
    return [nbformat.v4.new_code_cell(s, metadata={"tags": tags or []}) for s in sources]


PLOT = """fig, ax = plt.subplots(figsize=(6, 3))
for name, values in curves.items():
    ax.plot(values, label=name)
ax.set(xlabel="step", ylabel="loss")
ax.legend()
display(fig)"""


def test_plotting_check_finds_what_it_should():
    assert plotting_cells_on_show(_cells(PLOT)) == [(0, 6)]
    assert plotting_cells_on_show(_cells(PLOT, tags=["hide-input"])) == []
    assert plotting_cells_on_show(_cells(PLOT, tags=["remove-input"])) == []
    assert plotting_cells_on_show(_cells("ax.plot(x)\nax.legend()\nfig")) == []  # 3 lines: may stay visible
    # a cell that computes something (a print, an assert) is not plotting-only
    assert plotting_cells_on_show(_cells(PLOT + "\nprint(len(curves))")) == []
    assert plotting_cells_on_show(_cells(PLOT + "\nassert curves")) == []
    # data prepared for the plot alone counts as plotting; data a later cell reads does not
    prepared = "smooth = {k: v[::2] for k, v in curves.items()}\n" + PLOT.replace("curves", "smooth")
    assert plotting_cells_on_show(_cells(prepared)) == [(0, 7)]
    assert plotting_cells_on_show(_cells(prepared, "print(smooth)")) == []
    # inside an if, and after a magic
    guarded = "if curves:\n" + "\n".join("    " + ln for ln in PLOT.splitlines())
    assert plotting_cells_on_show(_cells("%matplotlib inline\n" + guarded)) == [(0, 8)]


# ---------------------------------------------------------------------------------------------------------------
# Diagrams: drawn by the book's diagram modules, tagged `diagram` (the browser check screenshots each), displayed.

DIAGRAM_MODULES = sorted((ROOT / "tfm_common").glob("diagrams*.py"))


def diagram_functions() -> set[str]:
    names = set()
    for module in DIAGRAM_MODULES:
        tree = ast.parse(module.read_text())
        names |= {f.name for f in tree.body if isinstance(f, ast.FunctionDef) and not f.name.startswith("_")}
    return names


def test_diagram_modules_are_found():
    assert {"architecture_figure", "plot_mha_dataflow", "plot_beam_tree"} <= diagram_functions()


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_diagram_cells_are_tagged_and_display_an_image(path):
    functions = diagram_functions()
    problems = []
    for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type != "code":
            continue
        tags = cell.metadata.get("tags", [])
        calls = {n.func.id for n in ast.walk(_parse(cell.source)) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Name)}  # fmt: skip
        if calls & functions and "diagram" not in tags:
            problems.append(f"cell {i} draws {sorted(calls & functions)} without the tag 'diagram'")
        if "diagram" in tags:
            images = [o for o in cell.outputs if {"image/png", "image/svg+xml"} & set(o.get("data", {}))]
            if not images:
                problems.append(f"cell {i} is tagged 'diagram' but its stored outputs display no image")
    assert not problems, f"{path.name}: " + "; ".join(problems)


def test_the_book_has_diagram_cells():
    tagged = [
        c for p in CHAPTERS for c in nbformat.read(p, as_version=4).cells if "diagram" in c.metadata.get("tags", [])
    ]
    assert len(tagged) >= 7


# ---------------------------------------------------------------------------------------------------------------
# The front page: Jupyter Book titles a page "<its heading> — <the book's title>"; the heading must not be the title.


def test_front_page_heading_is_not_the_book_title():
    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    root = next(p for p in (ROOT / f"{toc['root']}.md", ROOT / f"{toc['root']}.ipynb") if p.is_file())
    heading = next(ln for ln in root.read_text().splitlines() if ln.startswith("# "))[2:].strip()
    assert heading.casefold() != config["title"].strip().casefold(), (
        f"{root.name}'s heading {heading!r} is the book's title: its page would be titled '{heading} — {heading}'"
    )


def test_browser_check_refuses_a_repeated_title():
    sys.path.insert(0, str(ROOT / "tools"))
    import check_browser  # a script folder, not a package

    assert check_browser.title_problems("Transformer, Twice — Transformer, Twice")
    assert check_browser.title_problems("About this book — About this book")
    assert check_browser.title_problems("About this book — Transformer, Twice") == []
    assert check_browser.title_problems("5. Scaled dot-product attention — Transformer, Twice") == []


def test_built_front_page_title_does_not_repeat_itself():
    """The built page, where a build exists (the browser check reads it too, in every build it checks)."""
    built = ROOT / "_build" / "html" / "intro.html"
    if not built.is_file():
        pytest.skip("no built book: `make book` first")
    sources = (ROOT / "intro.md", ROOT / "_config.yml")
    if built.stat().st_mtime < max(s.stat().st_mtime for s in sources):
        pytest.skip("the built book is older than intro.md or _config.yml: `make book` first")
    title = re.search(r"<title>(.*?)</title>", built.read_text(), re.S).group(1).strip()
    parts = [p.strip().casefold() for p in html.unescape(title).split(" — ")]
    assert len(set(parts)) == len(parts), f"the front page is titled {title!r}"
