# syntax=docker/dockerfile:1
# nanoserve on a CUDA machine. See docs/deployment.md:
#   docker build -t nanoserve .
#   docker run --gpus all -p 8000:8000 nanoserve
# Build arguments:
#   IMPORT_DEFAULT_MODEL=1   import SmolLM2-135M-Instruct into the image (0: serve only mounted
#                            models, e.g. --model /models/NAME, and keep the image ~270 MB smaller)

# The official PyTorch image: its CUDA torch and matching triton are kept as they are.
FROM pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime AS base

# ---- build: the wheel of the build context; nothing else from this stage reaches the image
FROM base AS build
WORKDIR /src
COPY docker/install.sh docker/preinstalled.py ./docker/
COPY pyproject.toml README.md ./
COPY nanoserve ./nanoserve
RUN PIP_NO_CACHE_DIR=1 sh docker/install.sh wheel /src /dist

# ---- runtime
FROM base AS runtime
ENV NANOSERVE_HOME=/var/lib/nanoserve \
    TRITON_CACHE_DIR=/var/lib/nanoserve/triton \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# Triton compiles a small C launcher per kernel signature the first time it runs, so a C compiler
# and libc headers are run-time needs here, not build tools; some base tags lack them. Not pinned:
# Ubuntu's security updates move these versions.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 nanoserve \
    && useradd --system --uid 10001 --gid nanoserve --create-home --home-dir /home/nanoserve \
        --shell /usr/sbin/nologin nanoserve \
    && mkdir -p /var/lib/nanoserve /models \
    && chown nanoserve:nanoserve /var/lib/nanoserve

COPY --chmod=0755 docker/healthcheck.py /usr/local/bin/nanoserve-healthcheck

# The same commands tests/test_docker.py runs in a fresh virtual environment.
RUN --mount=type=bind,from=build,source=/dist,target=/tmp/dist \
    --mount=type=bind,source=docker,target=/tmp/docker \
    sh /tmp/docker/install.sh install /tmp/dist/nanoserve-*.whl

USER 10001:10001
WORKDIR /home/nanoserve
# Declared here, not earlier: a changed value then only re-runs the import.
ARG IMPORT_DEFAULT_MODEL=1
RUN if [ "$IMPORT_DEFAULT_MODEL" = "1" ]; then nanoserve import-model; fi

EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=10s --start-period=300s --retries=3 \
    CMD ["nanoserve-healthcheck", "http://127.0.0.1:8000/health"]
ENTRYPOINT ["nanoserve"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000"]
