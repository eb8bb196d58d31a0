# One-command entry points for a fresh machine (see README.md).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
EXAMPLE := work/example

.PHONY: install run test test-all lint format clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $@

## The main job: generate a small synthetic xBD-format example and cut its chip pairs.
run: install
	$(BIN)/python -m data_prep.synthetic --out $(EXAMPLE)
	$(BIN)/local-damage prepare xbd --root $(EXAMPLE)/xbd --out $(EXAMPLE)/chips

## The test suite (fast tests plus real-data tests when ../shared/data is present).
test: install
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

## Everything, slow tests included.
test-all: install
	$(BIN)/python -m pytest -m ""

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) work .pytest_cache .ruff_cache .hypothesis
