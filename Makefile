# The two set-up commands of the README:
#   make serve   install what the daemon needs (./.venv) and serve the embedded default on 127.0.0.1:8000
#   make test    install what the tests need (./.venv) and run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch is pinned to the local CPU wheel on the reference machines; the package itself accepts a range.
TORCH  ?= torch==2.13.0

.PHONY: serve test install install-test bench lint

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: $(PY) pyproject.toml
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

serve: install
	$(PY) server.py $(ARGS)

test: install-test
	$(PY) -m pytest -q $(PYTEST_ARGS)

# the CPU-box pipeline target (bench/README.md lists every bench and the GPU suites)
bench: install-test
	$(PY) -m bench.engine.pipeline --config configs/default.yaml --cpu-efficiency $(ARGS)

lint: install-test
	$(PY) -m ruff check quiver_serve server.py tests bench
