# All set-up lives here: a fresh machine needs only `make test` (and, once the services land, `make up`).
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test test-serial test-fast test-extended test-kernels test-durations demo up lint format install system-deps clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Python writes each module's bytecode when it first imports it, whatever the caller's environment
# says: the venvs are installed without compiling (below), and a test starts many processes.
unexport PYTHONDONTWRITEBYTECODE

# torch first, pinned, so pip takes the CPU build from local disk instead of a multi-GB CUDA build.
# --no-compile: pip would compile all ~15,000 modules (two thirds of the install's time), of which the
# services and tests import about a quarter. What the services import is compiled here instead, once,
# so that the first processes a run starts side by side do not each compile torch: torch's own while
# pip installs the rest (numpy, which torch looks for, is not complete yet), then the remainder.
$(VENV)/.torch: $(BIN)/python
	$(BIN)/pip install --quiet --no-compile torch==2.13.0
	touch $@

$(VENV)/.torch-compiled: $(VENV)/.torch
	$(BIN)/python -W ignore -c 'import sys; sys.modules["numpy"] = None; import torch'
	touch $@

$(VENV)/.deps: $(VENV)/.torch pyproject.toml
	$(BIN)/pip install --quiet --no-compile -e '.[test,bench]'
	touch $@

$(STAMP): $(VENV)/.deps $(VENV)/.torch-compiled
	$(BIN)/python -c 'import importlib, trident.launcher.warm as w; [importlib.import_module(m) for m in w.PRELOAD]'
	touch $(STAMP)

# The Kubernetes manifests' offline checks (tests/kubernetes): kubernetes-validate and checkov in a
# venv of their own (checkov pins much that the project also uses), and the @kubernetes-models npm
# packages, which carry KEDA's, the Prometheus operator's and cert-manager's CRD schemas compiled to
# validators (KEDA's 2.x models know the fallback's `behavior`). `kubectl kustomize` (the test that
# renders every overlay) is the machine's own kubectl.
TOOLS := .venv-tools
K8S_TOOLS := checkov==3.3.30 kubernetes-validate==1.37.0
CRD_MODELS := @kubernetes-models/keda@2.0.0 @kubernetes-models/prometheus-operator@6.0.0 \
	@kubernetes-models/cert-manager@6.0.0
TOOLS_STAMP := $(TOOLS)/.installed-$(subst ==,-,$(subst $(eval) ,_,$(K8S_TOOLS)))-keda2.0.0-po6.0.0-cm6.0.0

$(TOOLS_STAMP):
	rm -rf $(TOOLS)
	$(PY) -m venv $(TOOLS)
	$(TOOLS)/bin/pip install --quiet --no-compile $(K8S_TOOLS)
	@command -v npm >/dev/null || (apt-get update -qq && apt-get install -y -qq nodejs npm >/dev/null)
	npm install --silent --no-audit --no-fund --prefix $(TOOLS)/npm $(CRD_MODELS)
	touch $(TOOLS_STAMP)

# The two venvs are built side by side, and torch is compiled while the rest of its venv unpacks.
install: system-deps
	@$(MAKE) --no-print-directory -j3 $(STAMP) $(TOOLS_STAMP)

# redis-server, and prometheus/promtool (the monitoring profile's tests), come from Debian; installed
# only when missing.
system-deps:
	@(command -v redis-server && command -v promtool && command -v prometheus) >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq redis-server prometheus >/dev/null)

# Two lanes side by side (tests/lanes.py: units of work weighed from tests/durations.json, the
# heaviest first to whichever lane runs low): the suite mostly waits on processes, so two lanes on
# two cores take little more than half of it. Tests marked `alone` (a time or memory bound that a
# lane beside them would move) run last, by themselves, once the other lane has ended.
# `make test-serial` is the one-lane run. Tests marked `extended` (the top of the pyramid: Compose
# beyond its smoke test, three hosts in network namespaces, the soak, benchmark scripts run whole)
# are `make test-extended`, CI's second step (.ci/run), not part of `make test`.
LANES := -n 2 --dist loadscope

test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q $(LANES) -m "not extended"

test-serial: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -m "not extended"

test-extended: install test-kernels
	$(BIN)/python -m pytest -q $(LANES) -m extended

# The GPU's Triton kernels against their torch references, run by Triton's interpreter on the CPU
# (CPU torch ships without Triton, so elsewhere these tests skip). Triton goes into a folder of its
# own, put on the path of this one run only: the services and the other tests never see it.
KERNELS := .venv-kernels
KERNELS_STAMP := $(KERNELS)/.installed-triton-3.9.0

$(KERNELS_STAMP): $(BIN)/python
	rm -rf $(KERNELS)
	$(BIN)/pip install --quiet --no-compile --no-deps --target $(KERNELS) triton==3.9.0
	touch $@

test-kernels: install $(KERNELS_STAMP)
	PYTHONPATH=$(KERNELS) TRITON_INTERPRET=1 TRIDENT_REQUIRE_TRITON=1 \
		$(BIN)/python -m pytest -q tests/engine/test_triton_kernels.py

# `make test`, recording each test's seconds into tests/durations.json (commit it): run it when the
# suite's shape has changed, so that the units are weighed as they now are.
test-durations: install
	$(BIN)/python -m pytest -q $(LANES) -m "not extended" --store-durations

# The quick loop: every test that starts no deployment (tests/tiers.py says which are slow; every
# `alone` test is slow too).
test-fast: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q $(LANES) -m "not slow"

demo: install
	$(BIN)/python -c "import numpy as np; from PIL import Image; \
	Image.fromarray(np.random.default_rng(0).integers(0, 256, (96, 96, 3), dtype=np.uint8)).save('.trident-demo.png')"
	$(BIN)/trident generate --prompt "What is in this picture?" --image .trident-demo.png --max-tokens 24 --json

up: install
	$(BIN)/trident up

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) $(TOOLS) $(KERNELS) .pytest_cache build *.egg-info
