"""The book as a product: its table of contents, its stored outputs, its layout rules."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))


def toc_files() -> list[str]:
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    return [toc["root"]] + [ch["file"] for part in toc["parts"] for ch in part["chapters"]]


def test_every_notebook_is_in_the_toc_and_back():
    on_disk = {f"chapters/{p.stem}" for p in CHAPTERS}
    in_toc = {f for f in toc_files() if f.startswith("chapters/")}
    assert on_disk, "no notebooks in chapters/"
    assert on_disk - in_toc == set(), "notebooks missing from _toc.yml"
    assert in_toc - on_disk == set(), "_toc.yml entries without a notebook"
    for f in toc_files():
        assert (ROOT / f"{f}.ipynb").is_file() or (ROOT / f"{f}.md").is_file(), f


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_notebook_is_committed_executed(path):
    """Strict nbval passes a notebook without outputs trivially; this test does not."""
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code" and c.source.strip()]
    assert code, f"{path.name} has no code cells"
    counts = [c.execution_count for c in code]
    assert counts == list(range(1, len(code) + 1)), f"{path.name}: not executed top to bottom once: {counts}"
    assert sum(len(c.outputs) for c in code) > 0, f"{path.name} has no outputs"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name} stores an error output"
    assert nb.metadata.get("kernelspec", {}).get("name") == "python3"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_notebook_title_is_numbered(path):
    nb = nbformat.read(path, as_version=4)
    first = nb.cells[0].source.splitlines()[0]
    number = re.fullmatch(r"0*(\d+[a-z]?)", path.name.split("_")[0]).group(1)  # "14a_x.ipynb" -> "14a"
    assert first.startswith(f"# {number}. "), f"{path.name} should open with '# {number}. Title', got {first!r}"


def test_nbval_catches_a_changed_output(tmp_path):
    """Change one printed number in a stored output: the strict notebook test must fail."""
    nb = nbformat.read(CHAPTERS[0], as_version=4)
    for cell in nb.cells:
        outs = [o for o in getattr(cell, "outputs", []) if o.get("output_type") == "stream"]
        outs = [o for o in outs if re.search(r"\d", o.text)]
        if outs:
            outs[0].text = re.sub(r"\d", lambda m: str((int(m.group()) + 1) % 10), outs[0].text, count=1)
            break
    else:
        pytest.fail("no stored output with a digit to change")
    changed = tmp_path / CHAPTERS[0].name
    nbformat.write(nb, changed)
    cmd = [sys.executable, "-m", "pytest", "--nbval", "--nbval-current-env", "-q", "-p", "no:cacheprovider"]
    cmd.append(str(changed))
    result = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stdout[-2000:]
    assert "1 failed" in result.stdout


def python_files(package: str) -> set[str]:
    return {p.relative_to(ROOT / package).as_posix() for p in (ROOT / package).rglob("*.py")}


# A NumPy file without a twin, and why: the lean decoding step fuses the cached decoder's products by hand (2-3x at
# batch 8, measured); the torch searches run every cached step through Transformer.decode_step.
NUMPY_ONLY = {"fast_decode.py"}
# The graded exercises grade the reader's NumPy forward and backward against this track: nothing to mirror in torch.
NUMPY_ONLY |= {f"exercises/{p.name}" for p in (ROOT / "tfm_numpy" / "exercises").glob("*.py")}


def test_tracks_mirror_file_for_file():
    torch_only = {"reference.py"}  # the models built from torch.nn's own layers: nothing to mirror in NumPy
    assert python_files("tfm_numpy") - NUMPY_ONLY == python_files("tfm_torch") - torch_only


def test_numpy_track_never_imports_torch():
    for path in (ROOT / "tfm_numpy").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "torch" for n in names), f"{path} imports torch"
    code = "import sys, tfm_numpy; assert 'torch' not in sys.modules, 'torch was imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and "make book" in readme
    assert re.search(r"^make test$", ci, re.M), ".ci/run must call `make test`"


def test_dependencies_are_pinned():
    lock = (ROOT / "requirements.lock").read_text().splitlines()
    pins = dict(line.split("==") for line in lock if line and not line.startswith("#"))
    assert pins["torch"] == "2.13.0"
    assert pins["jupyter-book"].startswith("1.")
    assert all(v for v in pins.values())


def test_stored_translator_results_match_chapter_14a():
    """Chapter 14b reads chapter 14a's results from a file that 14a writes: the committed file must be the one
    that 14a's stored outputs report, or 14b run alone would compare against another run."""
    results = json.loads((ROOT / "chapters" / "results" / "translator_numpy.json").read_text(encoding="utf-8"))
    nb = nbformat.read(ROOT / "chapters" / "14a_translator_numpy.ipynb", as_version=4)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    # printed as "~value" (tfm_common.show.about): a float32 training's results vary between CPUs
    em, bleu, n = f"~{results['exact_match']:.4f}", f"~{results['bleu']:.2f}", f"~{len(results['errors'])}"
    assert f"wrote results/translator_numpy.json: exact match {em}, BLEU {bleu}, {n} errors" in text
    assert f"exact match: {em} ({n} wrong)" in text
