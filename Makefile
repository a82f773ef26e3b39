# The two commands of the README. Both create .venv and install everything they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup setup-test waste test bench

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch==2.13.0 first: the CPU build that lies on this disk. The package itself does not pin torch.
setup: $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[datasets,plot]'

setup-test: $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'

waste: setup
	$(BIN)/packkit waste --plot waste.png --overwrite

test: setup-test
	HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} TRITON_INTERPRET=1 $(BIN)/python -m pytest -q

bench: setup-test
	$(BIN)/pip install --quiet -e '.[bench]'
