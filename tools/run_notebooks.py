"""Re-execute notebooks in place, top to bottom, in a fresh kernel each: `make notebooks`.

Usage: python tools/run_notebooks.py [NOTEBOOK ...]   (default: every chapters/*.ipynb)

Execution counts and outputs are stored; per-cell timing metadata is not, so a re-run of
unchanged code leaves the file unchanged apart from figures' bytes.
"""

import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]


def run(path: Path) -> float:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=1800,  # per cell: generous, for a crowded machine (the 3-minute budget is per notebook, measured idle)
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
        record_timing=False,
    )
    start = time.perf_counter()
    client.execute()
    elapsed = time.perf_counter() - start
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    nbformat.write(nb, path)
    return elapsed


def main(argv: list[str]) -> None:
    paths = [Path(a).resolve() for a in argv] or sorted((ROOT / "chapters").glob("*.ipynb"))
    total = 0.0
    for path in paths:
        elapsed = run(path)
        total += elapsed
        print(f"{elapsed:7.1f} s  {path.relative_to(ROOT)}", flush=True)
    print(f"{total:7.1f} s  total")


if __name__ == "__main__":
    main(sys.argv[1:])
