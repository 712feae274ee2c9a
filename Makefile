# nbkit — `make setup` once, then `make test`, `make demo`, `make bench`.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The Colab TPU runtime's stack; torch_xla runs on the CPU with PJRT_DEVICE=CPU.
TORCH_STACK := torch==2.9.0 torchvision==0.24.0 torch_xla==2.9.0
export PJRT_DEVICE ?= CPU

.PHONY: setup test demo bench clean

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

demo: setup
	$(BIN)/python -m nbkit.demo
	$(BIN)/python scripts/run_notebooks.py

bench: setup
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf out test-artifacts .pytest_cache
