# specdec image: every service (draft, target, coordinator on Ray) runs this image with a different
# `specdec` subcommand. Only the shipped distilled draft (models/) is baked in: mount other models at /models, or let an init container
# fetch them at start (see deploy/).
#
# Both variants: `make image` (docker buildx bake, docker-bake.hcl), or by hand:
# CPU (default):  docker build -t ghcr.io/specdec/specdec:0.1.0 .
# GPU variant:    docker build --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu130 \
#                   -t ghcr.io/specdec/specdec:0.1.0-cuda .
#                 (the CUDA wheels carry their own CUDA runtime; nodes need the NVIDIA driver and the
#                 NVIDIA device plugin, pods request nvidia.com/gpu)
# The CUDA index: cu124 has no torch 2.13.0 (that index's builds stopped long before). cu130 is
# the CUDA line recent torch releases ship (2.11 and 2.12 have cu130 wheels), but whether it
# serves 2.13.0 was NOT checked: the machine this was written on cannot reach
# download.pytorch.org (tests/test_image.py resolves the pins against the configured index
# only). Check before building, and before changing either pin:
#   pip index versions torch --index-url https://download.pytorch.org/whl/cu130
FROM python:3.11.9-slim-bookworm

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    HF_HUB_OFFLINE=1 \
    HF_HOME=/tmp/hf \
    SPECDEC_MODELS_DIR=/opt/specdec/models \
    SPECDEC_BENCHMARKS_DIR=/opt/specdec/benchmarks \
    SPECDEC_CACHE_DIR=/tmp/specdec-cache
# SPECDEC_CACHE_DIR: the dequantized copy of a quantized target (README: Model specs) goes to /tmp,
# the one writable path of the pods (an emptyDir): a restarted container skips the dequantization.

# A C compiler (and OpenMP): the lean pass's few-row kernel (specdec/modeling/fewrow.py) is compiled
# on first use into SPECDEC_CACHE_DIR; without one every CPU product falls back to torch's.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --gid 10001 specdec && useradd --uid 10001 --gid 10001 --create-home specdec

WORKDIR /opt/specdec
# torch first, from the chosen index: a bare `torch` requirement would pick an arbitrary build.
RUN pip install --index-url "${TORCH_INDEX}" "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md ./
COPY specdec ./specdec
COPY draft_service ./draft_service
COPY target_service ./target_service
COPY coordinator ./coordinator
COPY proto ./proto
# the distilled draft for the default target (a few tens of MB); other models are mounted
COPY models ./models
# the prompt sets `specdec bench` and `specdec distill` default to (SPECDEC_BENCHMARKS_DIR)
COPY benchmarks ./benchmarks
RUN pip install . && python -c "import specdec.v1.coordinator_pb2, coordinator.serve_app"

USER 10001:10001
EXPOSE 50051 50061 50062 9000
ENTRYPOINT ["specdec"]
CMD ["--help"]
