"""One picture convention in every chapter: masks through `plot_mask` (True = may attend = dark), attention maps
through `plot_attention` (queries in rows, keys in columns). Chapter 0 states both.

The test reads every chapter's code cells and looks at each call that draws an array as an image (`imshow`,
`matshow`, `pcolormesh`, ...). An image of something named like attention weights, scores or a mask fails: those
go through `tfm_common.plotting`. Any other image must be listed in ALLOWED, with the reason it is neither a mask
nor an attention map. Calls of the helpers themselves are checked too: a transposed attention map (keys in rows)
or a negated mask (torch's True = masked) fails.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))

IMAGE_CALLS = {"imshow", "matshow", "pcolormesh", "pcolor", "pcolorfast", "heatmap", "spy"}
ATTENTION_OR_MASK = re.compile(r"weight|attn|attention|score|mask|causal|padding|align", re.IGNORECASE)

# (notebook, the drawn array as written in the code): why it is neither a mask nor an attention map
ALLOWED = {
    ("03_layer_norm", "data"): "activations before and after LayerNorm (tokens x features)",
    ("06_multi_head_attention", "tok[h]"): "which token each cell of a head split reads (a layout diagram)",
    ("07_positional_encoding", "pe"): "the sinusoidal table (positions x dimensions)",
    ("07_positional_encoding", "M3"): "the rotation matrix M_k between positional encodings",
    ("07_positional_encoding", "table"): "sinusoidal and learned positional tables (positions x dimensions)",
    ("07_positional_encoding", "cm"): "cosine similarity between positions",
    ("11_data", "kind"): "a table of token kinds (pad, bos, eos) of a batch",
    ("19a_vit", "data.x_train[np.flatnonzero(data.y_train == d)[row], 0]"): "an image of a handwritten digit",
    ("19a_vit", "digit[0, 0]"): "an image of a handwritten digit",
    ("19a_vit", "patches[0].T"): "the patches of a digit, as the model's input rows",
    ("19a_vit", "cos[1 + i, 1:].reshape(G, G)"): "cosine similarity of learned position vectors on the patch grid",
    ("19a_vit", "data.x_val[i, 0]"): "an image of a handwritten digit",
    ("19a_vit", "heat"): "one query's (the class token's) weights laid over the image pixels, not a query x key map",
    ("19b_swin", "np.roll(label, (s, s), axis=(0, 1))"): "window regions of an image grid (labels, not a mask)",
    ("19b_swin", "label"): "window regions of an image grid (labels, not a mask)",
}

# Chapters outside this change that still draw an attention-shaped map by hand: strict xfail, so that the test
# turns red as soon as one is fixed (remove it from here then).
KNOWN_VIOLATIONS: dict[str, str] = {}


def code_of(cell_source: str) -> str:
    """A code cell as Python: IPython magics and shell lines (`%matplotlib inline`, `!ls`) left out."""
    return "\n".join(line for line in cell_source.splitlines() if not line.lstrip().startswith(("%", "!")))


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""


def violations(notebook: str, source: str) -> list[str]:
    """What one code cell of `notebook` draws against the conventions (an empty list when nothing)."""
    found = []
    for node in ast.walk(ast.parse(code_of(source))):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        name, arg = _name(node.func), ast.unparse(node.args[0])
        if name in IMAGE_CALLS:
            if ATTENTION_OR_MASK.search(arg):
                found.append(f"{name}({arg}): a mask or attention map drawn without tfm_common.plotting")
            elif (notebook, arg) not in ALLOWED:
                found.append(f"{name}({arg}): an image not in ALLOWED (use plot_attention / plot_mask, or list it)")
        elif name == "plot_attention" and re.search(r"\.T\b|\.mT\b|transpose|swapaxes", arg):
            found.append(f"plot_attention({arg}): transposed, keys would be in rows")
        elif name == "plot_mask" and isinstance(node.args[0], ast.UnaryOp) and isinstance(node.args[0].op, ast.Invert):
            found.append(f"plot_mask({arg}): a negated mask, True must mean 'may attend'")
    return found


def notebook_violations(path: Path) -> list[str]:
    nb = nbformat.read(path, as_version=4)
    return [
        f"{path.name} cell {i}: {v}"
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code"
        for v in violations(path.stem, cell.source)
    ]


def _param(path: Path):
    if path.stem in KNOWN_VIOLATIONS:
        return pytest.param(path, marks=pytest.mark.xfail(strict=True, reason=KNOWN_VIOLATIONS[path.stem]))
    return path


@pytest.mark.parametrize("path", [_param(p) for p in CHAPTERS], ids=lambda p: p.name)
def test_masks_and_attention_maps_go_through_the_helpers(path):
    found = notebook_violations(path)
    assert not found, "\n".join(found)


def test_every_allowed_image_still_exists():
    """A stale entry of ALLOWED would let a new image of the same name through unexamined."""
    drawn = set()
    for path in CHAPTERS:
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type != "code":
                continue
            for node in ast.walk(ast.parse(code_of(cell.source))):
                if isinstance(node, ast.Call) and node.args and _name(node.func) in IMAGE_CALLS:
                    drawn.add((path.stem, ast.unparse(node.args[0])))
    assert set(ALLOWED) - drawn == set(), "entries of ALLOWED that no chapter draws any more"
    assert set(KNOWN_VIOLATIONS) <= {p.stem for p in CHAPTERS}


@pytest.mark.parametrize(
    "source",
    [
        "ax.imshow(weights[0], cmap='viridis')",
        "plt.imshow(mha.attn_weights[0, 1])",
        "axes[0].matshow(scores)",
        "ax.imshow(pad_mask[0, 0], cmap='Greys')",
        "ax.imshow(np.broadcast_to(causal[0, 0], (T, T)))",
        "sns.heatmap(attn)",
        "ax.imshow(some_new_picture)",  # not in ALLOWED: must be looked at
        "plot_attention(w.T)",
        "plot_attention(np.swapaxes(w, -1, -2))",
        "plot_mask(~mask)",
    ],
)
def test_the_checker_catches(source):
    assert violations("00_notation", source), source


@pytest.mark.parametrize(
    "source",
    [
        "plot_attention(weights[0], x_labels=src, y_labels=tgt)",
        "plot_mask(dec[0], title='decoder mask', ax=axes[1])",
        "fig = plot_attention(w_hand.mean(0))",
        "%matplotlib inline\nplot_mask(mask)",
        "ax.imshow(pe, cmap='RdBu_r')",  # listed in ALLOWED for chapter 7 only
    ],
)
def test_the_checker_lets_through(source):
    notebook = "07_positional_encoding"
    assert violations(notebook, source) == [], source


def test_chapter_0_states_both_conventions():
    nb = nbformat.read(ROOT / "chapters" / "00_notation.ipynb", as_version=4)
    text = " ".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "dark = `True` = may attend" in text
    assert "queries in rows, keys in columns" in text
    code = " ".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "plot_mask(" in code and "plot_attention(" in code
