"""The printed method is the lesson: every function or method a chapter prints with `show_source` holds that
chapter's math, at most one line of checking, and no branch for another chapter's option.

The list of printed methods is read from the notebooks themselves (every `show_source(...)` call in a code cell),
so a chapter that starts printing a method puts it under this test without anyone editing the test. Checks belong
at the door (a module's `_check_forward` and friends, run by `tfm_numpy.Module` / `tfm_torch.Module` for a call
from outside the library); options of later chapters belong in variants outside the printed body.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "chapters").glob("*.ipynb"))

# Options that belong to one chapter and must not branch the methods other chapters print: the attention kernel
# switch and its tile (15b), the pitfall switches (16a), the flash loops' instrumentation, recomputation (20).
OTHER_CHAPTERS_OPTIONS = {
    "attn_impl",
    "tile_size",
    "block_size",
    "score_scale",
    "q_scale",
    "head_projection",
    "dropout_place",
    "ff_dropout",
    "after_norm",
    "stats",
    "recompute",
    "flash",
}
CHECK_CALL = re.compile(r"^_?(check|refuse|validate)")


def _imports(nb: dict) -> str:
    """The notebook's import lines of the project's own code (what the printed objects are named through)."""
    lines = []
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        for line in "".join(cell["source"]).splitlines():
            if re.match(r"(import|from)\s+(tfm_|bench\b|step_breakdown\b)", line):
                lines.append(line.split("#")[0].rstrip())
    return "\n".join(lines)


def _show_calls(nb: dict):
    """(object expression, methods or None) for every show_source call of the notebook."""
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(line for line in "".join(cell["source"]).splitlines(keepends=True) if not line.startswith("%"))
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "show_source":
                methods = next((ast.literal_eval(k.value) for k in node.keywords if k.arg == "methods"), None)
                yield ast.unparse(node.args[0]), methods


def printed_functions():
    """(chapter, printed name, function object) for every function or method the chapters print."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    out = []
    for path in CHAPTERS:
        nb = json.loads(path.read_text())
        calls = list(_show_calls(nb))
        if not calls:
            continue
        namespace: dict = {}
        exec(_imports(nb), namespace)  # noqa: S102 - the project's own import lines
        for expr, methods in calls:
            obj = eval(expr, namespace)  # noqa: S307 - a name like tnp.MultiHeadAttention
            if methods:
                funcs = [(f"{expr}.{m}", getattr(obj, m)) for m in methods]
            elif inspect.isclass(obj):  # the whole class: its methods written in the module (not a dataclass's)
                funcs = [(f"{expr}.{n}", f) for n, f in vars(obj).items() if inspect.isfunction(f) and _written(f)]
            else:
                funcs = [(expr, obj)]
            out += [(path.stem, name, inspect.unwrap(f)) for name, f in funcs]
    return out


def _written(func) -> bool:
    try:
        inspect.getsource(func)
    except OSError:  # made at run time (a dataclass's __init__, __repr__): nothing printed
        return False
    return True


def _is_check(stmt: ast.stmt) -> bool:
    """A statement that checks instead of computing: raise, assert, an `if` that only raises, a check_* call."""
    if isinstance(stmt, (ast.Raise, ast.Assert)):
        return True
    if isinstance(stmt, ast.If) and all(isinstance(s, ast.Raise) for s in stmt.body) and not stmt.orelse:
        return True
    value = stmt.value if isinstance(stmt, (ast.Expr, ast.Assign, ast.AnnAssign)) else None
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return bool(CHECK_CALL.match(name))
    return False


def _statements(body: list[ast.stmt]):
    for stmt in body:
        yield stmt
        for field in ("body", "orelse", "finalbody", "handlers"):
            inner = getattr(stmt, field, None)
            if isinstance(inner, list) and not _is_check(stmt):
                yield from _statements([s for s in inner if isinstance(s, ast.stmt)])


def _names(node: ast.AST) -> set[str]:
    found = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            found.add(n.id)
        elif isinstance(n, ast.Attribute):
            found.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            found.add(n.value)
    return found


def _function_node(func) -> ast.FunctionDef:
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    return next(n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


# Printed because their checks are the lesson: the refusal of a backward before (or twice after) a forward.
CHECKS_ARE_THE_LESSON = {"tnp.Module._saved"}
PRINTED = printed_functions()


def test_the_chapters_print_library_code():
    assert len(PRINTED) > 100, f"only {len(PRINTED)} printed functions found: is the notebook parsing broken?"


@pytest.mark.parametrize("chapter, name, func", PRINTED, ids=[f"{c}:{n}" for c, n, _ in PRINTED])
def test_printed_method_holds_at_most_one_line_of_checking(chapter, name, func):
    if name in CHECKS_ARE_THE_LESSON:
        pytest.skip("its checks are what the chapter shows")
    node = _function_node(func)
    body = node.body[1:] if ast.get_docstring(node) else node.body
    checks = [ast.unparse(s).splitlines()[0] for s in _statements(body) if _is_check(s)]
    assert len(checks) <= 1, f"{name} (printed in {chapter}) checks {len(checks)} times: {checks}"


@pytest.mark.parametrize("chapter, name, func", PRINTED, ids=[f"{c}:{n}" for c, n, _ in PRINTED])
def test_printed_method_has_no_branch_for_another_chapters_option(chapter, name, func):
    node = _function_node(func)
    tests = [n.test for n in ast.walk(node) if isinstance(n, (ast.If, ast.IfExp, ast.While))]
    options = {opt for t in tests for opt in _names(t) & OTHER_CHAPTERS_OPTIONS}
    isinstance_cache = [t for t in tests if "isinstance" in _names(t) and "_cache" in _names(t)]
    assert not options, f"{name} (printed in {chapter}) branches on {sorted(options)}"
    assert not isinstance_cache, f"{name} (printed in {chapter}) tests the type of its cache"
