"""Stored outputs that any CPU reproduces: what the notebook tests mask is only what truly varies, and each masked
number carries its claim.

`.nbval_sanitize.cfg` masks the power of ten that `tfm_common.show.bound` prints (round-off differs between BLAS
kernels, vector instructions and thread counts) and the "~value" of `tfm_common.show.about` (float32 trainings
amplify a last-bit difference). So every `bound(...)` call in a chapter states its claim (`below=` or `above=`),
which the notebook test then checks on the reader's machine; `about(...)` values are checked by an `assert` in the
same cell.
"""

import ast
import json
import re
from pathlib import Path

import pytest

CHAPTERS = sorted(Path(__file__).resolve().parent.parent.joinpath("chapters").glob("*.ipynb"))


def code_cells(path):
    for cell in json.loads(path.read_text())["cells"]:
        if cell["cell_type"] == "code":
            src = "".join(cell["source"])
            yield "\n".join(line for line in src.splitlines() if not line.lstrip().startswith(("%", "!")))


def calls(tree, name):
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == name]


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_printed_bound_states_its_claim(path):
    bare = []
    for src in code_cells(path):
        for call in calls(ast.parse(src), "bound"):
            if not {kw.arg for kw in call.keywords} & {"below", "above"}:
                bare.append(ast.unparse(call))
    assert not bare, f"bound(...) without below= or above= (its power of ten is masked, so state the claim): {bare}"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.stem)
def test_every_cell_that_prints_about_asserts(path):
    loose = [
        src[:80] for src in code_cells(path) if calls(ast.parse(src), "about") and not re.search(r"\bassert\b", src)
    ]
    assert not loose, f"cells that print about(...) (masked) without an assert of their claim: {loose}"
