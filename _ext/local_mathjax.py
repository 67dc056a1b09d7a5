"""Serve MathJax from the build folder instead of a CDN, so the book works offline.

MathJax 3 comes from the `django-static-mathjax` wheel on PyPI (its files only; Django is not
needed). At the end of the build the files the `tex-chtml` component loads are copied into
`_build/html/_static/mathjax/`, and every page points at that copy.
"""

import shutil
from pathlib import Path

import mathjax

ES5 = Path(mathjax.__file__).parent / "static" / "mathjax" / "es5"
# tex-chtml.js plus what it loads on demand (fonts, menu, assistive MathML, TeX extensions).
PARTS = ["tex-chtml.js", "a11y", "adaptors", "input", "output", "sre", "ui"]


def _point_at_local_copy(app, config):
    config.mathjax_path = "mathjax/tex-chtml.js"


def _copy_mathjax(app, exception):
    if exception is not None or app.builder.format != "html":
        return
    target = Path(app.outdir) / "_static" / "mathjax"
    for part in PARTS:
        src = ES5 / part
        if src.is_dir():
            shutil.copytree(src, target / part, dirs_exist_ok=True)
        else:
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target / part)


def setup(app):
    if not (ES5 / "tex-chtml.js").is_file():
        raise RuntimeError(f"local_mathjax: MathJax not found at {ES5}; install django-static-mathjax")
    app.connect("config-inited", _point_at_local_copy, priority=900)
    app.connect("build-finished", _copy_mathjax)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
