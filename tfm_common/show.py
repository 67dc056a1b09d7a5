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


def bound(x: float, *, below: float | None = None, above: float | None = None) -> str:
    """An error as the power of ten just above it ("< 1e-10"), or "0 exactly"; `below`/`above` state the claim.

    Errors near machine precision depend on the order of floating-point operations (BLAS kernels, vector
    instructions, thread counts): 4e-16 here is 1.1e-15 on another CPU. So the printed power of ten is this
    machine's; the notebook tests mask it (.nbval_sanitize.cfg) and test the claim instead: `below=1e-12` raises
    unless x < 1e-12, `above=1e-3` unless x > 1e-3. State the claim with margin over the noise (a factor of 100).
    """
    if x < 0 or x != x:
        raise ValueError(f"bound: expected a non-negative error, got {x}")
    if below is not None and not x < below:
        raise AssertionError(f"bound: expected an error below {below:.0e}, got {x:.3e}")
    if above is not None and not x > above:
        raise AssertionError(f"bound: expected an error above {above:.0e}, got {x:.3e}")
    if x == 0:
        return "0 exactly"
    return f"< 1e{math.floor(math.log10(x)) + 1:+03d}"


def about(x: float, spec: str = ".4f") -> str:
    """A result that depends on the CPU's rounding, such as a float32 training run after thousands of steps (they
    amplify a last-bit difference between BLAS kernels): "~0.9935". The notebook tests mask what follows the
    "~" (.nbval_sanitize.cfg); the cell that prints it asserts its claim with a tolerance.
    """
    return f"~{x:{spec}}"


def print_errors(errors: dict[str, float], threshold: float, title: str = "relative error") -> bool:
    """A small table: one row per name, its error as a power-of-ten bound, and pass/fail against threshold."""
    width = max(len(name) for name in errors)
    print(f"{'':<{width}}  {title:<12}  below {threshold:.0e}")
    for name, err in errors.items():
        print(f"{name:<{width}}  {bound(err):<12}  {err < threshold}")
    return all(err < threshold for err in errors.values())
