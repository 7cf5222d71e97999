# syntax=docker/dockerfile:1
# Two images from one file:
#   docker build --target slim   -t infergate:0.1.0 .          gateway and dispatcher (no torch)
#   docker build --target worker -t infergate-worker:0.1.0 .   GPU worker (torch with CUDA)
# Without --target the last stage, slim, is built.

ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS base
# INFERGATE_HOST / INFERGATE_METRICS_HOST: a container is reached from outside
# itself, so its ports listen on every interface (the processes default to 127.0.0.1).
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    INFERGATE_HOST=0.0.0.0 \
    INFERGATE_METRICS_HOST=0.0.0.0
# A numeric user, so Kubernetes' runAsNonRoot can verify it.
RUN groupadd --system --gid 10001 infergate \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin infergate

FROM base AS build
RUN python -m venv /opt/venv
WORKDIR /src
# pyproject.toml maps each of these folders onto the one import root, `infergate`.
# requirements.lock: the versions CI tested, read as constraints by every install.
COPY pyproject.toml README.md requirements.lock ./
COPY cli/ cli/
COPY base/ base/
COPY policies/ policies/
COPY gateway/ gateway/
COPY dispatcher/ dispatcher/
COPY gpu/ gpu/
COPY loadtest/ loadtest/
RUN pip install -c requirements.lock .

FROM build AS build-worker
# PyPI's Linux torch wheels bundle the CUDA libraries (the nvidia-* wheels): the
# host needs only the NVIDIA driver and the NVIDIA Container Toolkit. For another
# CUDA build, e.g. --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
ARG TORCH_SPEC=torch
ARG TORCH_INDEX_URL=https://pypi.org/simple
RUN pip install -c requirements.lock --index-url "$TORCH_INDEX_URL" "$TORCH_SPEC" \
    && pip install -c requirements.lock ".[torch]"

FROM base AS worker
# HOME=/tmp: torch and transformers keep caches under $HOME, and the root filesystem
# may be read-only (Kubernetes); /tmp is a writable volume there. HF_HUB_OFFLINE: the
# model is a local directory (--model), never a download.
ENV HOME=/tmp \
    HF_HUB_OFFLINE=1 \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
COPY --from=build-worker /opt/venv /opt/venv
USER 10001:10001
EXPOSE 9100
ENTRYPOINT ["infergate"]
CMD ["worker", "--backend", "transformers", "--model", "/models", "--metrics-port", "9100"]

FROM base AS slim
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
EXPOSE 8000 9100
ENTRYPOINT ["infergate"]
CMD ["gateway", "--port", "8000", "--policy", "/etc/infergate/policy.yaml", "--metrics-port", "9100"]
