# dsv4-parity — the two commands a new user runs: `make parity` and `make test`.
# Without PYTHON=..., both bootstrap a CPU virtual environment in .venv (torch==2.13.0 + the project's
# dependencies). On a GPU runner whose Python already has CUDA torch (and optionally cudnn-frontend /
# FlashMLA), pass it instead: `make parity PYTHON=python3` runs in that interpreter, installing nothing.

VENV      ?= .venv
# `make parity` runs the GPU gate suite when CUDA is available (the cudnn / flashmla providers, where installed,
# are then required for every stage they support), else the CPU smoke suite.
SUITE     ?= $(shell $(PY) -c 'import torch; print("gate" if torch.cuda.is_available() else "smoke")' 2>/dev/null || echo smoke)
# On CUDA with cudnn-frontend and FlashMLA importable, `cudnn` = the production set, each required for every stage it
# supports on this architecture (a silent fallback fails the run); otherwise `auto` (the torch provider on a CPU).
PROVIDER  ?= $(shell $(PY) -c 'import torch, cudnn, flash_mla; print("cudnn" if torch.cuda.is_available() else "auto")' 2>/dev/null || echo auto)
OUT       ?= reports/out/latest
# Metamorphic oracles `make parity` also runs on a CPU (fused, the smoke suite): the poisoned output gradient.
CPU_ORACLES ?= $(shell $(PY) -c 'import torch; print("" if torch.cuda.is_available() else "padding-dout")' 2>/dev/null || echo padding-dout)
WORKERS   ?= 2

ifdef PYTHON
PY        := $(PYTHON)
BOOTSTRAP :=
else
PY        := $(VENV)/bin/python
BOOTSTRAP := $(VENV)/.installed
endif

export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: help parity test test-all report mutants bench cases venv clean

help:
	@echo "make parity   run the parity suite (SUITE=$(SUITE), PROVIDER=$(PROVIDER)) and write a report under reports/out/"
	@echo "make test     run the project's own tests (pytest, $(WORKERS) workers)"
	@echo "make report   render the latest run's terminal/CSV/HTML report"
	@echo "make mutants  run the mutation suite (every planted bug must be caught)"
	@echo "make bench    benchmark the reference, the fused path and the harness"
	@echo "Variables: PYTHON=python3 (use an existing interpreter, e.g. CUDA torch), SUITE, PROVIDER, OUT, WORKERS"

venv: $(BOOTSTRAP)

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q torch==2.13.0
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $@

parity: $(BOOTSTRAP)
	$(PY) -m parity.cli run --suite $(SUITE) --provider $(PROVIDER) --workers auto --out $(OUT) --make-default
	@for oracle in $(CPU_ORACLES); do \
	  $(PY) -m parity.cli run --suite smoke --oracle $$oracle --provider $(PROVIDER) --quiet || exit 1; done

test: $(BOOTSTRAP)
	$(PY) tests/setup_browser.py || true
	$(PY) -m pytest -n $(WORKERS) -q

report: $(BOOTSTRAP)
	$(PY) -m parity.cli report $(OUT)

mutants: $(BOOTSTRAP)
	$(PY) -m parity.cli mutants --suite smoke

bench: $(BOOTSTRAP)
	$(PY) -m parity.cli bench

cases: $(BOOTSTRAP)
	$(PY) -m parity.cli cases --suite $(SUITE)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis reports/out
