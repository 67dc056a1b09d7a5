# Transformer, Twice: every command starts by making sure the pinned environment exists.
#   make book       build the HTML book into _build/html
#   make test       lint, unit tests, strict notebook tests, strict book build, browser check, lab check
#   make notebooks  re-execute every notebook in place (after changing a chapter or the libraries)
#   make lab        open the chapters in JupyterLab, with the project's kernel (LAB_PORT=8888, LAB_ARGS=...)
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Same thread settings everywhere, so a re-run computes the same numbers.
export OMP_NUM_THREADS ?= 2
export PYTHONHASHSEED := 0
export PYDEVD_DISABLE_FILE_VALIDATION := 1

.PHONY: venv book book-strict test lint unit nbval nbval-portable browser chromium lab-check notebooks lab clean

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

# Two test processes with one thread each (the tests' arrays are small: they wait on Python, not on BLAS).
unit: venv
	OMP_NUM_THREADS=1 $(BIN)/pytest tests -q -n 2

# Strict notebook tests in two passes. The chapters that train in float32 with two BLAS/torch threads (their
# numbers depend on it) and the benchmark chapter run one at a time; every other chapter sets its own threads or
# computes the same numbers with one, so those run two at a time, one thread each (--dist loadfile: each notebook
# whole in one worker, its cells in order).
NBVAL := $(BIN)/pytest --nbval --nbval-current-env --nbval-sanitize-with .nbval_sanitize.cfg -q
NBVAL_TWO_THREADS := 14a_translator_numpy 14b_translator_torch 15a_performance 17b_gpt 18_since_2017 21a_quantization 21c_sliding_window 20c_mixture_of_experts 22a_bert 22b_fine_tuning 22c_lora 22d_dpo
nbval: venv
	$(NBVAL) $(NBVAL_TWO_THREADS:%=chapters/%.ipynb)
	OMP_NUM_THREADS=1 $(NBVAL) -n 2 --dist loadfile chapters $(NBVAL_TWO_THREADS:%=--ignore=chapters/%.ipynb)

# The same strict notebook tests as on another CPU: other OpenBLAS kernels, torch's and MKL's kernels without
# AVX2/AVX-512 (NumPy's own loops too), another thread count than the stored run's. The stored outputs must pass here
# unchanged (what differs between CPUs is masked by .nbval_sanitize.cfg and checked by the cells' own claims).
# Another configuration:
#   make nbval-portable PORTABLE="OPENBLAS_CORETYPE=Haswell ATEN_CPU_CAPABILITY=avx2" PORTABLE_THREADS=4
PORTABLE ?= OPENBLAS_CORETYPE=Sandybridge ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=AVX \
	NPY_DISABLE_CPU_FEATURES="X86_V3 X86_V4 AVX512_ICL AVX512_SPR"
PORTABLE_THREADS ?= 1
# Two passes as in `make nbval` (14b reads the results file that 14a writes: never at the same time).
nbval-portable: venv
	env $(PORTABLE) OMP_NUM_THREADS=$(PORTABLE_THREADS) $(NBVAL) $(NBVAL_TWO_THREADS:%=chapters/%.ipynb)
	env $(PORTABLE) OMP_NUM_THREADS=$(PORTABLE_THREADS) $(NBVAL) -n 2 --dist loadfile chapters \
		$(NBVAL_TWO_THREADS:%=--ignore=chapters/%.ipynb)

chromium:
	@command -v chromium >/dev/null || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }

browser: venv chromium
	$(BIN)/python tools/check_browser.py

# `make lab` started as a reader would (free port, token, no browser window), a chapter opened and run in Chromium.
lab-check: venv chromium
	$(BIN)/python tools/check_lab.py

test: lint unit nbval book-strict browser lab-check

notebooks: venv
	$(BIN)/python tools/run_notebooks.py $(NB)

# JupyterLab on this machine only (127.0.0.1), serving the repository, opened on chapters/. Its python3 kernel is
# the venv's Python (jupyter_client runs the "python" of a kernel spec as the server's own interpreter, and
# JUPYTER_PREFER_ENV_PATH puts the venv's kernel specs before a user-wide one), where the editable install makes
# tfm_numpy, tfm_torch and tfm_common importable; the thread settings exported above reach the kernel.
# Nothing is fetched from the network: no news feed, no update check, no extension catalog. --allow-root: the
# book's machines and CI run as root, where the server refuses to start without it.
LAB_PORT ?= 8888
LAB_ARGS ?=
lab: venv
	JUPYTER_PREFER_ENV_PATH=1 $(BIN)/jupyter lab --ServerApp.ip=127.0.0.1 --ServerApp.port=$(LAB_PORT) \
		--ServerApp.root_dir="$(CURDIR)" --ServerApp.default_url=/lab/tree/chapters \
		--LabApp.news_url=None --LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate \
		--LabApp.extension_manager=readonly --allow-root $(LAB_ARGS)

clean:
	rm -rf _build
