# Transformer, Twice: every command starts by making sure the pinned environment exists.
#   make book       build the HTML book into _build/html
#   make test       lint, unit tests, strict notebook tests, strict book build, browser check
#   make notebooks  re-execute every notebook in place (after changing a chapter or the libraries)
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Same thread settings everywhere, so a re-run computes the same numbers.
export OMP_NUM_THREADS ?= 2
export PYTHONHASHSEED := 0
export PYDEVD_DISABLE_FILE_VALIDATION := 1

.PHONY: venv book book-strict test lint unit nbval browser chromium notebooks clean

venv: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q -r requirements.lock
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	@# Build matplotlib's font cache here, not inside the first notebook (its message would be an output).
	MPLBACKEND=Agg $(BIN)/python -c "import matplotlib.pyplot"
	touch $(STAMP)

book: venv
	$(BIN)/jupyter-book build -W -n --keep-going .

book-strict: venv
	$(BIN)/jupyter-book build --all -W -n --keep-going .

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

unit: venv
	$(BIN)/pytest tests -q

nbval: venv
	$(BIN)/pytest --nbval --nbval-current-env --nbval-sanitize-with .nbval_sanitize.cfg chapters -q

chromium:
	@command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

browser: venv chromium
	$(BIN)/python tools/check_browser.py

test: lint unit nbval book-strict browser

notebooks: venv
	$(BIN)/python tools/run_notebooks.py $(NB)

clean:
	rm -rf _build
