# Two commands set up and run everything on a fresh machine:
#   make test        create .venv if missing, install softmoe with its test extras, run the whole suite
#   make reproduce   the paper reproduction (arrives with the reproduction issue)
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: test venv clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VENV)/bin/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(VENV)/bin/python -m pytest tests

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
