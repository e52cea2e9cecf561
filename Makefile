# The two set-up commands of the README:
#   make serve   install what the daemon needs (./.venv) and serve the embedded default on 127.0.0.1:8000
#   make test    install what the tests need (./.venv) and run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch is pinned to the local CPU wheel on the reference machines; the package itself accepts a range.
# A torch already in the venv (a GPU machine's own build) is never replaced.
TORCH  ?= torch==2.13.0
# the exact versions of every other package the project is tested with (pyproject.toml has ranges)
CONSTRAINTS ?= constraints.txt

.PHONY: serve test install install-test bench lint

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: $(PY) pyproject.toml $(CONSTRAINTS)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[test]"
	touch $@

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

# the package's CLI (quiver_serve/cli.py: the quiver-serve console script), through the venv's
# interpreter: a console script's first line names the interpreter of the folder it was installed from
serve: install
	$(PY) -m quiver_serve $(ARGS)

test: install-test
	$(PY) -m pytest -q $(PYTEST_ARGS)

# the CPU-box pipeline target (bench/README.md lists every bench and the GPU suites)
bench: install-test
	$(PY) -m bench.engine.pipeline --config quiver_serve/defaults/default.yaml --cpu-efficiency $(ARGS)

lint: install-test
	$(PY) -m ruff check quiver_serve server.py tests bench
