# nbkit — `make setup` once, then `make test` (ruff, then pytest), `make lint`, `make crash`, `make demo`, `make bench`; `make dist` builds the wheel.
#
# Two stacks, each in its own venv (README, "Tested with"):
#   make setup / make test                 .venv: Colab's TPU runtime: Python 3.13, torch 2.9.0,
#                                          torchvision 0.24.0, torch_xla 2.9.0 (the whole suite)
#   make setup-newest / make test-newest   .venv-newest: Python 3.13 with the newest torch and
#                                          torchvision that install and import together, no torch_xla
#                                          (the tests that need torch_xla skip)
# torch_xla runs on the CPU with PJRT_DEVICE=CPU.
# Both also build the test environments that some tests run in (tests/testenvs.py): ipywidgets 7.7.1 and
# ipykernel 6 (.venvs/ipywidgets7, .venvs/ipykernel6) and the classic Notebook 6 (.venvs/classic-py3.13).
# None holds torch, so the two stacks share them. The tests never install: make test and make
# test-newest run pytest with the package index unreachable (OFFLINE below).

# Colab's TPU runtime runs Python 3.13: use it (on PATH or under pyenv); python3 only when there is none.
PY313 ?= $(shell for p in $$(pyenv root 2>/dev/null || echo $$HOME/.pyenv)/versions/3.13*/bin/python3.13 $$(command -v python3.13); do "$$p" -c "" 2>/dev/null && { echo "$$p"; break; }; done)
PYTHON ?= $(or $(PY313),python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
# dist and notebooks need no venv: the venv's python if there is one, else $(PYTHON).
PYTHON_RUN = $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
TORCH_STACK  := torch==2.9.0 torchvision==0.24.0 torch_xla==2.9.0
# JAX as Colab's TPU runtime ships it beside torch (issue 30); the newest venv gets the newest jax and grain
# through the dev extra.
JAX_STACK    := jax==0.7.2 jaxlib==0.7.2 grain==0.2.18
# The newest pair that installs and imports together on Python 3.13 here (checked 2026-11-23: the
# registry's torchvision 0.29.2 is built against torch 2.15.0, both CUDA 13.2 builds that run on the
# CPU). A machine-wide pip constraint may cap torch below it (/etc/xdg/pip on our build machines):
# PIP_CONSTRAINT=/dev/null lifts it for this venv's installs only.
NEWEST_STACK := torch==2.15.0 torchvision==0.29.2 torch-tpu==0.2.0
VENV_NEWEST  ?= .venv-newest
export PJRT_DEVICE ?= CPU
# The environment of every pytest run: whatever the suite starts finds no package index (pip, uv).
# tests/test_environment.py checks that the test targets use it.
OFFLINE := PIP_NO_INDEX=1 PIP_INDEX_URL=http://127.0.0.1:9/simple UV_OFFLINE=1

.PHONY: FORCE setup setup-newest lint test test-newest crash demo bench notebooks dist clean python-check

# Warn (not fail) when no Python 3.13 exists: the suite runs on 3.10+, but Colab's TPU runtime is 3.13.
python-check:
	@test -n "$(PY313)" || [ "$(origin PYTHON)" != file ] || echo "make: no python3.13 found (on PATH or under pyenv): using $$(python3 -V 2>&1), not Colab's Python 3.13; install 3.13 or run make PYTHON=/path/to/python3.13" >&2

# testenvs.py build: builds the test environments that are missing or out of date, says the rest are up to date.
setup: python-check $(VENV)/.installed
	$(BIN)/python tests/testenvs.py build

# A venv built by another Python (e.g. an older .venv on 3.11) is rebuilt with $(PYTHON).
pyver = $(shell $(1) -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)
stale = $(if $(wildcard $(1)/bin/python),$(if $(filter-out $(call pyver,$(PYTHON)),$(call pyver,$(1)/bin/python)),FORCE))

# $(1): venv, $(2): torch stack, $(3): environment for pip. The uninstall removes what a venv made
# before the rename holds (the distribution was "nbkit", the package index's unrelated project's name).
define venv_recipe
	@if [ -x $(1)/bin/python ] && [ "$$($(1)/bin/python -c 'import sys; print(sys.version_info[:2])')" != "$$($(PYTHON) -c 'import sys; print(sys.version_info[:2])')" ]; then \
	  echo "make: $(1) was built with another Python than $(PYTHON): rebuilding it" >&2; rm -rf $(1); fi
	test -x $(1)/bin/python || $(PYTHON) -m venv $(1)
	$(1)/bin/python -m pip install --upgrade pip
	$(3) $(1)/bin/python -m pip install $(2)
	$(1)/bin/python -m pip uninstall -y -q nbkit 2>/dev/null || true
	$(3) $(1)/bin/python -m pip install -e '.[dev]' $(2)
	sh scripts/install-system-deps.sh
	$(1)/bin/python -c 'import sys, torch, torchvision; print("$(1):", sys.version.split()[0], "torch", torch.__version__, "torchvision", torchvision.__version__)'
	touch $(1)/.installed
endef

$(VENV)/.installed: pyproject.toml scripts/install-system-deps.sh $(call stale,$(VENV))
	$(call venv_recipe,$(VENV),$(TORCH_STACK) $(JAX_STACK))

setup-newest: python-check $(VENV_NEWEST)/.installed
	$(VENV_NEWEST)/bin/python tests/testenvs.py build

$(VENV_NEWEST)/.installed: pyproject.toml scripts/install-system-deps.sh $(call stale,$(VENV_NEWEST))
	$(call venv_recipe,$(VENV_NEWEST),$(NEWEST_STACK),PIP_CONSTRAINT=/dev/null)

# The linter first (pyproject's [tool.ruff]: the house habits it holds), then the suite.
lint: setup
	$(BIN)/ruff check .

# TEST_MARKS / NEWEST_MARKS: a pytest -m expression. Empty, make test runs everything; .ci/run uses
# them only to run the torch-independent crash and benchmark tests in the shorter suite.
TEST_MARKS ?=
test: setup lint
	$(OFFLINE) $(BIN)/python -m pytest $(if $(TEST_MARKS),-m "$(TEST_MARKS)")

# Every crash point of every operation (docs/CRASH.md); make test runs a fixed budget of them.
# The summary table also goes to out/crash-report.json.
crash: setup
	$(OFFLINE) NBKIT_CRASH=all NBKIT_CRASH_REPORT=out/crash-report.json $(BIN)/python -m pytest -m crash tests/crash -p no:cacheprovider

# The same suite on the newest torch, without torch_xla: what needs torch_xla skips and says why.
# Tests marked one_stack check nothing the torch stack changes (pyproject's markers): make test runs them.
NEWEST_MARKS ?= not one_stack
test-newest: setup-newest
	$(VENV_NEWEST)/bin/ruff check .
	$(OFFLINE) $(VENV_NEWEST)/bin/python -m pytest -m "$(NEWEST_MARKS)"

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

# dist/nbkit_cache-<version>-py3-none-any.whl (the distribution is nbkit-cache; the index's nbkit is unrelated): upload it to a Colab runtime's /content and the notebooks'
# install cell uses it (or attach it to a release and give its URL in the cell's nbkit_source field).
dist:
	$(PYTHON_RUN) -m pip wheel --no-deps -w dist .
	@ls -1 dist/nbkit_cache-*.whl

clean:
	rm -rf out test-artifacts .pytest_cache dist
