"""Show library code inside a chapter: one source of truth, no copy in the notebook that can drift."""

from __future__ import annotations

import inspect
import math
import textwrap

from IPython.display import Markdown


def show_source(obj, *, methods: tuple[str, ...] | None = None) -> Markdown:
    """The source of a function or class (or only some of a class's methods), as a highlighted block.

    The book renders it as Python code; because it is read from the module at run time, a change
    in the library changes the stored output, and the strict notebook test asks for a re-run.
    """
    if methods:
        parts = [textwrap.dedent(inspect.getsource(getattr(obj, name))) for name in methods]
        src = f"# {obj.__module__}.{obj.__qualname__}\n" + "\n".join(parts)
    else:
        src = inspect.getsource(obj)
    return Markdown(f"```python\n{src.rstrip()}\n```")


def bound(x: float) -> str:
    """An error as the power of ten just above it ("< 1e-10"), or "0" for an exact zero.

    Errors near machine precision depend on the order of floating-point operations (BLAS kernels,
    thread counts); their power of ten is much less sensitive to it, so a re-run on another machine
    usually prints the same.
    """
    if x < 0 or x != x:
        raise ValueError(f"bound: expected a non-negative error, got {x}")
    if x == 0:
        return "0"
    return f"< 1e{math.floor(math.log10(x)) + 1:+03d}"


def print_errors(errors: dict[str, float], threshold: float, title: str = "relative error") -> bool:
    """A small table: one row per name, its error as a power-of-ten bound, and pass/fail against threshold."""
    width = max(len(name) for name in errors)
    print(f"{'':<{width}}  {title:<12}  below {threshold:.0e}")
    for name, err in errors.items():
        print(f"{name:<{width}}  {bound(err):<12}  {err < threshold}")
    return all(err < threshold for err in errors.values())
