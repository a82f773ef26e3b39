# The two commands of the README. Both create .venv and install everything they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup setup-test waste test test-fast test-thorough test-bounds bench

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch==2.13.0 first: the CPU build that lies on this disk. The package itself does not pin torch.
setup: $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[datasets,plot,chat]'

# mosaicml-streaming's own reader checks the MDS output (tests/test_formats.py). Installed without its
# dependencies: they would downgrade numpy and transformers and pull cloud SDKs and a CUDA torchvision, none of
# which its local MDS reader uses; the few it does use are named here.
MDS_READER := mosaicml-streaming==0.13.0 Brotli python-snappy cramjam zstd catalogue

setup-test: $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps $(MDS_READER)

waste: setup
	$(BIN)/packkit waste --plot waste.png --overwrite

# Two pytest-xdist workers (this machine has two cores), each test file whole on one worker (--dist loadfile:
# a file's module fixtures are built once, and its subprocesses and process groups run beside no other test
# of that file), longest files first (by the seconds the last whole run recorded in .pytest_cache; see
# tests/conftest.py), an order xdist keeps with --no-loadscope-reorder. `make test XDIST=` runs in one process.
XDIST ?= -n 2 --dist loadfile --no-loadscope-reorder

test: setup-test
	HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} TRITON_INTERPRET=1 $(BIN)/python -m pytest -q $(XDIST)

# The inner loop: everything but the tests marked slow (real Trainer runs, spawned processes, Ray, the
# Triton interpreter sweeps past their first case, fault injection; see tests/conftest.py).
test-fast: setup-test
	HYPOTHESIS_PROFILE=$${HYPOTHESIS_PROFILE:-ci} TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m "not slow" $(XDIST)

# The property tests only (every @given test carries the `property` marker, see tests/conftest.py),
# under the `thorough` profile and a random seed, printed first: `make test-thorough SEED=<seed>`
# replays a failure. pytest exits 5 (a failure here) if the selection were ever empty.
test-thorough: setup-test
	@seed=$(SEED); seed=$${seed:-$$($(BIN)/python -c 'import random; print(random.randrange(2**32))')}; \
	echo "make test-thorough: hypothesis seed $$seed (replay: make test-thorough SEED=$$seed)"; \
	HYPOTHESIS_PROFILE=thorough TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -m property \
		--hypothesis-seed=$$seed tests

# The tests that touch transformers', TRL's and accelerate's private surface (.ci/bounds.py names them) with each
# framework at the lowest release of the range packkit declares (packkit/integrations/*.py: SUPPORTED), installed
# in a temporary folder put first on PYTHONPATH, .venv left as it is. CI runs it after make test.
test-bounds: setup-test
	$(BIN)/python .ci/bounds.py

bench: setup-test
	$(BIN)/pip install --quiet -e '.[bench]'
