# specdec image: every service (draft, target, coordinator on Ray) runs this image with a different
# `specdec` subcommand. Only the shipped distilled draft (models/) is baked in: mount other models at /models, or let an init container
# fetch them at start (see deploy/).
#
# Three ways to build it, one Dockerfile:
# CPU (default):  docker build -t ghcr.io/specdec/specdec:0.1.0 .      (or `make image`: both variants,
#                 docker buildx bake, docker-bake.hcl)
# GPU variant:    docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130 \
#                   -t ghcr.io/specdec/specdec:0.1.0-cuda .
#                 (the CUDA wheels carry their own CUDA runtime; nodes need the NVIDIA driver and the
#                 NVIDIA device plugin, pods request nvidia.com/gpu)
# Without Docker Hub or the PyTorch index (an air-gapped or proxied site): `make image-local`
#                 (tools/image.py) builds on a Debian base made with mmdebstrap (BASE_IMAGE), puts the
#                 CPU torch wheel it has on disk and the versions `make install` resolved into
#                 deploy/image/ (bound into two RUN steps, never copied into a layer), and hands pip the
#                 host's CA bundle as the BuildKit secret `ca` (never in a layer either).
# The CUDA index: cu124 has no torch 2.13.0 (that index's builds stopped long before). cu130 is
# the CUDA line recent torch releases ship (2.11 and 2.12 have cu130 wheels), but whether it
# serves 2.13.0 was NOT checked: the machine this was written on cannot reach
# download.pytorch.org (tests/test_image.py resolves the pins against the configured index
# only). Check before building, and before changing either pin:
#   pip index versions torch --index-url https://download.pytorch.org/whl/cu130
ARG BASE_IMAGE=python:3.11.9-slim-bookworm
FROM ${BASE_IMAGE}

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

# The packages live in a virtual environment: the same layout on python:slim and on Debian's own
# python3 (whose system site-packages Debian reserves for apt).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    HF_HOME=/tmp/hf \
    SPECDEC_MODELS_DIR=/opt/specdec/models \
    SPECDEC_BENCHMARKS_DIR=/opt/specdec/benchmarks \
    SPECDEC_CACHE_DIR=/tmp/specdec-cache
# SPECDEC_CACHE_DIR: the dequantized copy of a quantized target (README: Model specs) and the
# compiled few-row kernel go to /tmp, the one writable path of the pods (an emptyDir): a restarted
# container skips the dequantization.

# A C compiler (and OpenMP): the lean pass's few-row kernel (specdec/modeling/fewrow.py) is compiled
# on first use into SPECDEC_CACHE_DIR; without one every CPU product falls back to torch's. The
# local base (tools/image.py) already has them; python:slim gets them from apt.
RUN if ! command -v gcc >/dev/null; then \
        apt-get update \
        && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 \
        && rm -rf /var/lib/apt/lists/*; \
    fi
RUN groupadd --gid 10001 specdec && useradd --uid 10001 --gid 10001 --create-home specdec
# Where a volume can keep the compiled kernel and dequantized targets across restarts
# (SPECDEC_CACHE_DIR=/var/cache/specdec): a new named volume takes this folder's owner.
RUN mkdir -p /var/cache/specdec && chown 10001:10001 /var/cache/specdec
RUN python3 -m venv /opt/venv

WORKDIR /opt/specdec
# torch first: a bare `torch` requirement would pick an arbitrary build. The wheel in
# deploy/image/wheels when there is one (make image-local; its dependencies from the package index,
# at the constrained versions), else from TORCH_INDEX.
RUN --mount=type=secret,id=ca --mount=type=bind,source=deploy/image,target=/image \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    if [ -s /image/constraints.txt ]; then export PIP_CONSTRAINT=/image/constraints.txt; fi; \
    wheel=$(ls /image/wheels/torch-"${TORCH_VERSION}"*.whl 2>/dev/null | head -n 1); \
    if [ -n "$wheel" ]; then \
        pip install "$wheel"; \
    else \
        pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"; \
    fi
COPY pyproject.toml README.md ./
COPY specdec ./specdec
COPY replica ./replica
COPY coordinator ./coordinator
COPY proto ./proto
# the distilled draft for the default target (a few tens of MB); other models are mounted
COPY models ./models
# the prompt sets `specdec bench` and `specdec distill` default to (SPECDEC_BENCHMARKS_DIR)
COPY benchmarks ./benchmarks
# deploy/image/constraints.txt (make image-local): the versions `make install` resolved, so the
# image runs what the tests ran.
RUN --mount=type=secret,id=ca --mount=type=bind,source=deploy/image,target=/image \
    if [ -s /run/secrets/ca ]; then export PIP_CERT=/run/secrets/ca; fi; \
    if [ -s /image/constraints.txt ]; then export PIP_CONSTRAINT=/image/constraints.txt; fi; \
    pip install . && python -c "import specdec.v1.coordinator_pb2, coordinator.serve_app"

USER 10001:10001
EXPOSE 50051 50061 50062 9000
ENTRYPOINT ["specdec"]
CMD ["--help"]
