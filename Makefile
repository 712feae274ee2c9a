# nbkit — `make setup` once, then `make test`, `make demo`, `make bench`; `make dist` builds the wheel.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# dist and notebooks need no venv: the venv's python if there is one, else $(PYTHON).
PYTHON_RUN = $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
# The Colab TPU runtime's stack; torch_xla runs on the CPU with PJRT_DEVICE=CPU.
TORCH_STACK := torch==2.9.0 torchvision==0.24.0 torch_xla==2.9.0
export PJRT_DEVICE ?= CPU

# A second interpreter the suite also runs under in CI (`make test-py313`); Colab runs 3.12.
PY313 ?= $(shell for p in $$(pyenv root 2>/dev/null || echo $$HOME/.pyenv)/versions/3.13*/bin/python3.13 $$(command -v python3.13); do "$$p" -c "" 2>/dev/null && { echo "$$p"; break; }; done)

.PHONY: setup test test-py313 demo bench notebooks dist clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml scripts/install-system-deps.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install $(TORCH_STACK)
	$(BIN)/python -m pip install -e '.[dev]' $(TORCH_STACK)
	sh scripts/install-system-deps.sh
	touch $@

test: setup
	$(BIN)/python -m pytest

# The same suite in a second venv (.venv-3.13) built with Python 3.13.
test-py313:
	@test -n "$(PY313)" || { echo "test-py313: no python3.13 found (on PATH or under pyenv); install it, or run: make test-py313 PY313=/path/to/python3.13" >&2; exit 2; }
	$(MAKE) test PYTHON=$(PY313) VENV=.venv-3.13

demo: setup
	$(BIN)/python -m nbkit.demo
	$(BIN)/python scripts/run_notebooks.py

bench: setup
	$(BIN)/python benchmarks/run.py

# Write pyproject.toml's [project.urls] Repository into every notebook's install cell and Colab
# badge (and the README's badges), and check that no notebook carries outputs.
notebooks:
	$(PYTHON_RUN) scripts/stamp_notebooks.py
	$(PYTHON_RUN) scripts/run_notebooks.py --check-stripped

# dist/nbkit-<version>-py3-none-any.whl: upload it to a Colab runtime's /content and the notebooks'
# install cell uses it (or attach it to a release and give its URL in the cell's nbkit_source field).
dist:
	$(PYTHON_RUN) -m pip wheel --no-deps -w dist .
	@ls -1 dist/nbkit-*.whl

clean:
	rm -rf out test-artifacts .pytest_cache dist
