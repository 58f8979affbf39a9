# Two commands on a fresh clone: `make demo` and `make test`. Both create .venv when it is missing.
# `make wheel` builds the installable wheel (stable-ABI C kernels, tag cp311-abi3) into dist/.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is installed first and pinned: the pinned CPU wheel is on disk, an unpinned torch pulls a multi-GB CUDA build.
# This pin is the demo's and the tests'; the package itself accepts a range (pyproject.toml).
TORCH_PIN := torch==2.13.0
DEMO_DIR ?= demo-out

.PHONY: install demo test wheel completions clean

# setup.py builds the C kernels of dedup and pack (smolctl/data/_minhash.c, _pack.c): editing them re-runs the install.
$(BIN)/smolctl: pyproject.toml setup.py smolctl/data/_minhash.c smolctl/data/_pack.c smolctl/data/_buffers.h
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_PIN)
	echo "$(TORCH_PIN)" > $(VENV)/constraints.txt
	# A kernel built before the stable-ABI switch would shadow the new _minhash.abi3.so (Python prefers it).
	rm -f smolctl/data/_minhash.cpython-*.so
	$(BIN)/python -m pip install -q -c $(VENV)/constraints.txt -e '.[test]'
	touch $(BIN)/smolctl

install: $(BIN)/smolctl

demo: install
	PATH="$(CURDIR)/$(BIN):$$PATH" bash scripts/demo.sh $(DEMO_DIR)

# Both cores, one test file per worker at a time: a module's fixtures (e.g. the torchrun reference run of
# test_checkpoints) are built once, and every torchrun test picks a free port (--standalone) or its own.
test: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=15 tests

# Built with the venv's setuptools (no build isolation), so it needs no network. Published wheels come from
# cibuildwheel ([tool.cibuildwheel] in pyproject.toml), which also makes them manylinux.
wheel: install
	rm -rf dist
	$(BIN)/python -m pip wheel --no-deps --no-build-isolation -q -w dist .
	ls dist/*.whl

completions: install
	$(BIN)/python -m smolctl.completions completions

clean:
	rm -rf $(VENV) $(DEMO_DIR) .pytest_cache build dist smolctl/data/_minhash*.so smolctl/data/_pack*.so
