# kelastic: one image for the operator, the in-pod agent and the rendezvous store.
#
#   docker build -t kelastic:0.1.0 .
#   docker build --build-arg TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu" -t kelastic:0.1.0 .
#
# The first takes torch's CUDA build from the public index (nodes with GPUs); the second
# PyTorch's CPU-only build, a much smaller image (the operator and the store never use CUDA).
#
# Entrypoints (console scripts on PATH; pods pick one with `command:`):
#   kelastic-operator     the ElasticJob operator (the Helm chart runs this)
#   kelastic-agent        the elastic agent the operator wraps around worker commands
#                         (also `python -m kelastic.agent`)
#   kelastic-rendezvous   the rendezvous store the operator runs for each job
#
# kelastic is installed without its `local` extra: the local cluster's dependencies
# (cryptography, for a real control plane's certificates) are for a developer's machine,
# not for every cluster that pulls this image. localcluster/ is still copied, as the package
# lists it (the `kelastic` command lives there); in the image that command only says which
# extra it needs.
#
# The real-node lane (`make image`, docs/real-nodes.md) builds this file as it is with BuildKit
# and no registry: its `python:3.11-slim` is then a stand-in made from Debian packages
# (debootstrap bookworm minbase with python3 3.11, python3-pip and python3-venv; `python` and
# `pip` on PATH, pip allowed to install into the system, the host's CA certificates), named
# docker.io/library/python:3.11-slim. Its plain PyTorch image is this file up to the torch step,
# plus NumPy (as a PyTorch image has it; torch.distributed's object collectives need it).
FROM python:3.11-slim

ARG TORCH_VERSION=2.13.0
# Extra pip flags for the torch install only, e.g. PyTorch's CPU wheel index (above);
# the default takes torch from the configured index.
ARG TORCH_PIP_ARGS=""

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first and pinned: the package only asks for torch>=2.4, so installing it
# afterwards keeps this build instead of pulling another one. (hadolint takes
# the pass-through flags for an unpinned package.)
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ${TORCH_PIP_ARGS} "torch==${TORCH_VERSION}"

WORKDIR /opt/kelastic
COPY pyproject.toml README.md ./
COPY agent ./agent
COPY operator ./operator
COPY localcluster ./localcluster
# The package itself: its dependency ranges live in pyproject.toml, not here.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir . \
    && rm -rf build ./*.egg-info

# The example training script, so the examples run on the image as it is.
COPY examples /opt/kelastic/examples

# An unprivileged user with a fixed uid, matching the chart's runAsUser.
RUN groupadd --system --gid 10001 kelastic \
    && useradd --system --uid 10001 --gid kelastic --home-dir /home/kelastic --create-home --shell /usr/sbin/nologin kelastic
USER 10001:10001
# Manifests name the example as `examples/train.py`, relative to this directory,
# exactly as `kelastic local` runs it from a checkout of the repository.
WORKDIR /opt/kelastic

CMD ["kelastic-operator"]
