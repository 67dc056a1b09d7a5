"""Open a chapter in JupyterLab as a reader would, and run its first cells: `make lab-check`.

1. Starts the README's command, `make lab`, on a free local port with a random token and --no-browser (lab
   settings, workspaces, checkpoints and runtime files in a temporary folder; autosave off, so nothing is
   written back).
2. Opens chapters/01_method.ipynb in headless Chromium, clears the stored outputs, then runs the first cells from
   the keyboard (Shift+Enter), as a reader does: the import cell must run without an error and the first printing
   cell must print exactly its stored text.
3. Types a new cell in the UI that prints the kernel's sys.prefix, where tfm_numpy was imported from and the
   working folder: they must be the project's venv, the repository's tfm_numpy and chapters/.
4. Runs the chapter's graded exercise as a reader first meets it: the skeleton cell, then the check cell, which must
   print its stored friendly failure ("not written yet"); then types a wrong attempt (a forward without its bias) in
   a new cell and runs it with `check`, which must report the failed checks in words, not raise.
5. No browser request may leave the server, and the notebook file must be unchanged on disk.
Shuts down the browser, the kernel and the server at the end, also on failure. Exits non-zero on any failure.
"""

import hashlib
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import nbformat
import psutil
from playwright.sync_api import sync_playwright

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "chapters/01_method.ipynb"
CHROMIUM = "/usr/bin/chromium"
SHOTS = ROOT / "_build" / "screenshots"
START_TIMEOUT_S = 60  # server start and first kernel start, on a loaded 2-core machine
RUN_TIMEOUT_S = 90  # the import cell loads torch
# Typed into the lab as a reader's first wrong attempt at chapter 1's exercise: a forward without its bias.
WRONG_ATTEMPT = 'linear_forward = lambda x, W, b: x @ W.T  # forgot b\nresult = check("linear_forward", linear_forward)'
PROBE = 'import os, sys, tfm_numpy; print(sys.prefix, tfm_numpy.__file__, os.getcwd(), sep="|")'

# The notebook open in the lab, read through the page's application object (exposed by --expose_app_in_browser).
KERNEL_STATUS = "() => jupyterapp.shell.currentWidget?.sessionContext?.session?.kernel?.status ?? 'none'"
CELL_OUTPUTS = """(i) => {
  const cell = jupyterapp.shell.currentWidget.content.widgets[i];
  return cell.model.type === 'code' ? cell.outputArea.model.toJSON() : [];
}"""
CELL_COUNT = "() => jupyterapp.shell.currentWidget.content.widgets.length"
ACTIVE_INDEX = "() => jupyterapp.shell.currentWidget.content.activeCellIndex"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(port: int, token: str, path: str, method: str = "GET") -> object:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    req.add_header("Authorization", f"token {token}")
    with urllib.request.urlopen(req, data=b"" if method == "POST" else None, timeout=10) as r:
        body = r.read()
    return json.loads(body) if body else None


def lab_settings(tmp: Path) -> Path:
    """A private user-settings folder: autosave off, so running cells never writes the chapter back."""
    settings = tmp / "settings"
    plugin = settings / "@jupyterlab" / "docmanager-extension"
    plugin.mkdir(parents=True)
    (plugin / "plugin.jupyterlab-settings").write_text(json.dumps({"autosave": False}))
    notices = settings / "@jupyterlab" / "apputils-extension"
    notices.mkdir(parents=True)  # no "get news?" prompt over the notebook
    (notices / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
    return settings


def start_lab(tmp: Path, port: int, token: str) -> subprocess.Popen:
    args = [
        "--no-browser",
        f"--IdentityProvider.token={token}",
        "--ServerApp.port_retries=0",
        f"--LabApp.user_settings_dir={lab_settings(tmp)}",
        f"--LabApp.workspaces_dir={tmp / 'workspaces'}",
        "--LabApp.expose_app_in_browser=True",
        f"--FileCheckpoints.checkpoint_dir={tmp / 'checkpoints'}",  # not chapters/.ipynb_checkpoints
    ]
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(tmp / "runtime"), JUPYTER_CONFIG_DIR=str(tmp / "config"))
    cmd = ["make", "--no-print-directory", "lab", f"LAB_PORT={port}", f"LAB_ARGS={' '.join(args)}"]
    log = open(tmp / "lab.log", "w")  # the server writes to it until stop_lab
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait_ready(proc: subprocess.Popen, port: int, token: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"`make lab` exited with {proc.returncode} before serving")
        try:
            api(port, token, "/api/status")
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the lab did not answer on port {port} within {START_TIMEOUT_S} s")


def stored_cells(count: int) -> list:
    return nbformat.read(ROOT / NOTEBOOK, as_version=4).cells[:count]


def first_printing_cell(cells: list) -> int:
    for i, cell in enumerate(cells):
        if cell.cell_type == "code" and any(o.output_type == "stream" for o in cell.outputs):
            return i
    raise RuntimeError(f"{NOTEBOOK} has no cell that prints")


def stream_text(outputs: list) -> str:
    return "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")


def wait_for(page, script: str, arg, want, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = page.evaluate(script, arg)
        if want(got):
            return got
        page.wait_for_timeout(250)
    return page.evaluate(script, arg)


def run_first_cells(page, problems: list[str]) -> None:
    cells = nbformat.read(ROOT / NOTEBOOK, as_version=4).cells
    last = first_printing_cell(cells)
    page.evaluate("() => jupyterapp.commands.execute('notebook:clear-all-cell-outputs')")
    if page.evaluate(CELL_OUTPUTS, last):
        problems.append(f"cell {last} still shows outputs after 'clear all outputs'")
    page.locator(".jp-Notebook .jp-Cell").first.click()
    page.keyboard.press("Escape")  # command mode, on the first cell
    for _ in range(last + 1):
        page.keyboard.press("Shift+Enter")
    want = stream_text(cells[last].outputs)
    got = wait_for(page, CELL_OUTPUTS, last, lambda o: stream_text(o) == want, RUN_TIMEOUT_S)
    if stream_text(got) != want:
        problems.append(f"cell {last} printed {stream_text(got)!r}, its stored output is {want!r}")
    for i in range(last + 1):
        errors = [o for o in page.evaluate(CELL_OUTPUTS, i) if o.get("output_type") == "error"]
        problems += [f"cell {i} raised {e.get('ename')}: {e.get('evalue')}" for e in errors]
    print(f"ran cells 0-{last} of {NOTEBOOK} from the keyboard; cell {last} printed {len(stream_text(got))} characters")


def probe_kernel(page, problems: list[str]) -> None:
    """Type a cell in the UI that reports the kernel's environment, and run it."""
    page.keyboard.press("Escape")
    page.keyboard.press("b")  # a new code cell below the active one
    index = page.evaluate(ACTIVE_INDEX)
    page.keyboard.press("Enter")
    page.keyboard.type(PROBE)
    page.keyboard.press("Shift+Enter")
    got = stream_text(wait_for(page, CELL_OUTPUTS, index, lambda o: "|" in stream_text(o), RUN_TIMEOUT_S)).strip()
    fields = got.split("|")
    if len(fields) != 3:
        problems.append(f"the probe cell printed {got!r}")
        return
    prefix, module, cwd = (Path(f).resolve() for f in fields)
    expected = {
        "sys.prefix": (prefix, (ROOT / ".venv").resolve()),
        "tfm_numpy": (module, (ROOT / "tfm_numpy" / "__init__.py").resolve()),
        "working folder": (cwd, (ROOT / "chapters").resolve()),
    }
    for what, (seen, want) in expected.items():
        print(f"kernel {what}: {seen}")
        if seen != want:
            problems.append(f"kernel {what} is {seen}, expected {want}")


def tagged(cells: list, tag: str) -> int:
    return next(i for i, c in enumerate(cells) if tag in c.metadata.get("tags", []))


def run_exercise(page, problems: list[str], shift: int) -> None:
    """The skeleton and check cells of the chapter's exercise, then a wrong attempt typed in a new cell.

    `shift`: cells the check typed above the exercise (the probe cell), so stored index i is i + shift in the lab.
    """
    cells = nbformat.read(ROOT / NOTEBOOK, as_version=4).cells
    skeleton, check = tagged(cells, "exercise-skeleton") + shift, tagged(cells, "exercise-check") + shift
    page.evaluate(f"() => {{ jupyterapp.shell.currentWidget.content.activeCellIndex = {skeleton}; }}")
    page.keyboard.press("Escape")
    page.keyboard.press("Shift+Enter")
    page.keyboard.press("Shift+Enter")
    want = stream_text(cells[check - shift].outputs)
    got = stream_text(wait_for(page, CELL_OUTPUTS, check, lambda o: stream_text(o) == want, RUN_TIMEOUT_S))
    if got != want or "not written yet" not in got:
        problems.append(f"the exercise's check cell printed {got!r}, its stored output is {want!r}")
    page.evaluate(f"() => {{ jupyterapp.shell.currentWidget.content.activeCellIndex = {check}; }}")
    page.keyboard.press("Escape")
    page.keyboard.press("b")
    attempt = page.evaluate(ACTIVE_INDEX)
    page.keyboard.press("Enter")
    page.keyboard.type(WRONG_ATTEMPT)
    page.keyboard.press("Shift+Enter")
    got = stream_text(wait_for(page, CELL_OUTPUTS, attempt, lambda o: "checks failed" in stream_text(o), 30))
    errors = [o for o in page.evaluate(CELL_OUTPUTS, attempt) if o.get("output_type") == "error"]
    if "linear_forward: 4 of 4 checks failed" not in got or "y = x W^T + b" not in got or errors:
        problems.append(f"the wrong attempt's check printed {got!r}" + (f" and raised {errors}" if errors else ""))
    print(f"exercise: the skeleton's check printed {len(want)} characters as stored; a wrong attempt reported:")
    print("\n".join("    " + line for line in got.splitlines()[:2]))


def check_in_browser(port: int, token: str) -> list[str]:
    problems, outside = [], []
    base = f"http://127.0.0.1:{port}/"
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("request", lambda r: None if r.url.startswith((base, "data:", "blob:")) else outside.append(r.url))
            page.goto(f"{base}lab/tree/{NOTEBOOK}?token={token}", wait_until="load")
            page.wait_for_function("() => window.jupyterapp?.shell?.currentWidget?.content?.widgets?.length > 0")
            status = wait_for(page, KERNEL_STATUS, None, lambda s: s == "idle", START_TIMEOUT_S)
            if status != "idle":
                problems.append(f"the chapter's kernel is '{status}', not idle, {START_TIMEOUT_S} s after opening")
            else:
                print(f"opened {NOTEBOOK}: {page.evaluate(CELL_COUNT)} cells, kernel idle")
                run_first_cells(page, problems)
                probe_kernel(page, problems)
                run_exercise(page, problems, shift=1)
            SHOTS.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(SHOTS / "lab.png"))
        finally:
            browser.close()
    return problems + [f"request outside the lab server: {url}" for url in outside]


def stop_lab(proc: subprocess.Popen, port: int, token: str) -> None:
    """Shut down the kernels and the server through the API, then end whatever of ours is left."""
    family = [proc]
    try:
        family += psutil.Process(proc.pid).children(recursive=True)  # make, jupyter, the kernel(s)
    except psutil.NoSuchProcess:
        pass
    try:
        for kernel in api(port, token, "/api/kernels"):
            api(port, token, f"/api/kernels/{kernel['id']}", method="DELETE")
        api(port, token, "/api/shutdown", method="POST")
        proc.wait(timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        pass
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)  # the session `make lab` leads (make, jupyter)
    for p in family[1:]:  # psutil checks each is still the process it was (no reused pid); kernels run apart
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def main() -> int:
    start = time.monotonic()
    path = ROOT / NOTEBOOK
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    checkpoints = (path.parent / ".ipynb_checkpoints").exists()
    port, token = free_port(), secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="lab-check-") as tmp:
        proc = start_lab(Path(tmp), port, token)
        try:
            wait_ready(proc, port, token)
            print(f"`make lab` serving on 127.0.0.1:{port} after {time.monotonic() - start:.1f} s")
            problems = check_in_browser(port, token)
        except Exception as e:  # report, then shut down all the same
            problems = [f"{type(e).__name__}: {e}"]
        finally:
            stop_lab(proc, port, token)
            log = (Path(tmp) / "lab.log").read_text()
        if problems:
            print("--- end of the lab's log ---\n" + log[-3000:])
    if hashlib.sha256(path.read_bytes()).hexdigest() != before:
        problems.append(f"{NOTEBOOK} changed on disk")
    if not checkpoints and (path.parent / ".ipynb_checkpoints").exists():
        problems.append("the lab wrote chapters/.ipynb_checkpoints")
    for problem in problems:
        print(f"     - {problem}")
    print(f"lab check: {'FAIL' if problems else 'ok'}, {len(problems)} problem(s), {time.monotonic() - start:.1f} s")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
