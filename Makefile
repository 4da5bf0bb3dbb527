# dsv4-parity — the two commands a new user runs: `make parity` and `make test`.
# Without PYTHON=..., both bootstrap a CPU virtual environment in .venv (torch==2.13.0 + the project's
# dependencies). On a GPU runner whose Python already has CUDA torch (and optionally cudnn-frontend /
# FlashMLA), pass it instead: `make parity PYTHON=python3` runs in that interpreter, installing nothing.

VENV      ?= .venv
# `make parity` runs the GPU gate suite when CUDA is available (the cudnn / flashmla providers, where installed,
# are then required for every stage they support), else the CPU smoke suite with the CPU-only metamorphic oracle
# (the poisoned output gradient). On CUDA with cudnn-frontend and FlashMLA installed, PROVIDER `cudnn` = the
# production set, each required for every stage it supports on this architecture (a silent fallback fails the run);
# otherwise `auto` (the torch provider on a CPU). One probe (cli/make_defaults.py: "<suite> <provider> <oracles|->"),
# run once and only by the targets that read these variables; a CPU build of torch is not even imported.
# (not exported: a PARITY_DEFAULTS in the environment is not handed to the recipes' commands)
PARITY_DEFAULTS = $(eval PARITY_DEFAULTS := $$(shell $$(PY) -m cli.make_defaults 2>/dev/null || echo smoke auto padding-dout))$(PARITY_DEFAULTS)
unexport PARITY_DEFAULTS
SUITE     ?= $(word 1,$(PARITY_DEFAULTS))
PROVIDER  ?= $(word 2,$(PARITY_DEFAULTS))
OUT       ?= reports/out/latest
CPU_ORACLES ?= $(filter-out -,$(wordlist 3,$(words $(PARITY_DEFAULTS)),$(PARITY_DEFAULTS)))
WORKERS   ?= 2
# CI hooks (empty by default: `make parity` runs exactly as without them): JUNIT=path also writes JUnit XML there;
# RUN_ARGS adds `run` options, e.g. RUN_ARGS='--impl megatron --megatron ../Megatron-LM' (then `make parity` gates
# production's unfused AND fused path, each against its own baseline). BASELINE: each gated run's drift and coverage
# baseline in `make parity` / `make drift` / `make summary` (auto = ARCH/<its default name>: SUITE for the fused
# composition, megatron-<provider>-SUITE for production; none = not gated against one).
JUNIT     ?=
RUN_ARGS  ?=
BASELINE  ?= auto

ifdef PYTHON
PY        := $(PYTHON)
BOOTSTRAP :=
else
PY        := $(VENV)/bin/python
BOOTSTRAP := $(VENV)/.installed
endif

export PYTHONPATH := $(CURDIR)$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: help parity test test-all report drift summary mutants bench cases venv clean clean-cache

help:
	@echo "make parity   the gate: every production path of the implementation (SUITE=$(SUITE), PROVIDER=$(PROVIDER)),"
	@echo "              each against its BASELINE (drift + coverage); a report under reports/out/"
	@echo "make test     run the project's own tests (pytest, $(WORKERS) workers)"
	@echo "make report   render the latest run's terminal/CSV/HTML report"
	@echo "make drift    the drift gate: OUT's run(s) against BASELINE (exit 1 when a tensor class regressed or coverage was lost)"
	@echo "make summary  OUT's run as markdown on stdout, <= 64 KiB (CI job summary, PR comment)"
	@echo "make mutants  run the mutation suite (every planted bug must be caught)"
	@echo "make bench    benchmark the reference, the fused path and the harness"
	@echo "make clean-cache  delete the compiled-kernel cache (\$$DSV4_PARITY_CACHE_DIR, default ~/.cache/dsv4-parity)"
	@echo "Variables: PYTHON=python3 (use an existing interpreter, e.g. CUDA torch), SUITE, PROVIDER, OUT, WORKERS,"
	@echo "           JUNIT, RUN_ARGS, BASELINE"

venv: $(BOOTSTRAP)

$(VENV)/.installed: pyproject.toml
	@echo "bootstrap: creating $(VENV) (first run only; later runs reuse it)"
	python3 -m venv $(VENV)
	@echo "bootstrap: upgrading pip"
	$(VENV)/bin/python -m pip install -q --upgrade pip
	@echo "bootstrap: installing torch==2.13.0, CPU build (a large download: a few minutes)"
	$(VENV)/bin/python -m pip install -q torch==2.13.0
	@echo "bootstrap: installing dsv4-parity and its dependencies (pyproject.toml: pandas, rich, Jinja2, matplotlib, hypothesis, pytest)"
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	@echo "bootstrap: done; the CLI is $(VENV)/bin/dsv4-parity (or: source $(VENV)/bin/activate)"
	touch $@

# One command (cli/gate_command.py): a run per production path of the implementation (fused: PROVIDER; --impl
# megatron: unfused + cudnn on a GPU with the kernels, else unfused + emulated), each judged against its own baseline
# (drift and coverage), then the CPU oracles, then one summary naming the report to open; exit 1 if any run failed.
parity: $(BOOTSTRAP)
	$(PY) -m cli gate --suite $(SUITE) --provider $(PROVIDER) --workers auto --out $(OUT) --make-default \
		--baseline $(BASELINE) $(if $(JUNIT),--junit $(JUNIT)) $(foreach o,$(CPU_ORACLES),--with-oracle $(o)) \
		$(RUN_ARGS)

test: $(BOOTSTRAP)
	$(PY) tests/setup_browser.py || true
	$(PY) -m pytest -n $(WORKERS) -q

report: $(BOOTSTRAP)
	$(PY) -m cli report $(OUT)

drift: $(BOOTSTRAP)
	$(PY) -m cli compare $(OUT) --baseline $(BASELINE)

summary: $(BOOTSTRAP)
	@$(PY) -m cli report $(OUT) --format markdown --no-html --no-csv --baseline $(BASELINE)

mutants: $(BOOTSTRAP)
	$(PY) -m cli mutants --suite smoke

bench: $(BOOTSTRAP)
	$(PY) -m cli bench

cases: $(BOOTSTRAP)
	$(PY) -m cli cases --suite $(SUITE)

clean-cache: $(BOOTSTRAP)
	$(PY) -m cli cache --clear

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis reports/out
