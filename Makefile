# Developer shortcuts; every target is also spelled out in the README.
PYTHON ?= python3
# Extra pip flags for the torch install only. The plain pin takes the CUDA build from the
# public index (right on a GPU machine); on a CPU-only machine take PyTorch's CPU wheels:
#   make install TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
TORCH_PIP_ARGS ?=

.PHONY: install test test-durations test-fast test-gpu lint typecheck import-rules docs-rules format bench control-plane kueue node image

# The control plane `make control-plane` builds from the Go module proxy (docs/kelastic-local.md).
K8S_VERSION ?= v1.37.2
ETCD_VERSION ?= v3.7.3
# The real nodes' components `make node` builds from the Go module proxy (docs/real-nodes.md).
CONTAINERD_VERSION ?= v2.4.2
RUNC_VERSION ?= v1.5.3
CNI_PLUGINS_VERSION ?= v1.10.0
KUBE_ROUTER_VERSION ?= v2.1.0
# BuildKit, which `make image` builds from the Go module proxy to build the Dockerfile (docs/real-nodes.md).
BUILDKIT_VERSION ?= v0.34.2
# The Kueue manager `make kueue` builds from the Go module proxy (docs/kueue.md).
KUEUE_VERSION ?= v0.17.0

install:  ## torch first and pinned (see TORCH_PIP_ARGS for a CPU-only machine), then kelastic
	$(PYTHON) -m pip install torch==2.13.0 $(TORCH_PIP_ARGS)
	$(PYTHON) -m pip install -e ".[local,dev]"

test:  ## the whole suite, as CI runs it: the fast subset, then the slow scenarios, in test processes side by side
	$(PYTHON) -m pytest -q -m "not slow" -n 2; fast=$$?; $(PYTHON) -m pytest -q -m slow -n 3 && exit $$fast

test-durations:  ## the whole suite, recording what each module took (the order in which test processes take them)
	$(PYTHON) -m pytest -q -n 3 --record-module-seconds tests/module_seconds.json

test-fast:  ## skip the slow multi-process and end-to-end scenarios; two test processes side by side
	$(PYTHON) -m pytest -q -m "not slow" -n 2

test-gpu:  ## the gpu lane: NCCL scenarios, needs CUDA and 2+ GPUs (docs/gpus.md); skipped elsewhere
	$(PYTHON) -m pytest -q -m gpu

control-plane:  ## build (or reuse) kube-apiserver, -controller-manager, -scheduler, kubectl, etcd; prints their directory last
	@K8S_VERSION=$(K8S_VERSION) ETCD_VERSION=$(ETCD_VERSION) nice -n 10 bash localcluster/controlplane/build.sh

node:  ## build (or reuse) kubelet, kube-proxy, containerd, runc, the CNI plugins, kube-router, pause; prints their directory last
	@K8S_VERSION=$(K8S_VERSION) CONTAINERD_VERSION=$(CONTAINERD_VERSION) RUNC_VERSION=$(RUNC_VERSION) \
		CNI_PLUGINS_VERSION=$(CNI_PLUGINS_VERSION) KUBE_ROUTER_VERSION=$(KUBE_ROUTER_VERSION) \
		nice -n 10 bash localcluster/node/build.sh

image:  ## build (or reuse) BuildKit, then the kelastic image from the Dockerfile and a plain PyTorch image (OCI tars; needs root and make node)
	@buildkit=$$(BUILDKIT_VERSION=$(BUILDKIT_VERSION) nice -n 10 bash localcluster/node/buildkit.sh | tail -1) && \
		nice -n 10 $(PYTHON) -m kelastic.localcluster.node.imagebuild --buildkit-dir "$$buildkit"

kueue:  ## build (or reuse) the Kueue manager and its CRDs; prints their directory last
	@KUEUE_VERSION=$(KUEUE_VERSION) nice -n 10 bash localcluster/kueue/build.sh

lint:  ## style, types, the import direction between the three parts, docs that name every module; CI runs this
	ruff check .
	ruff format --check .
	$(MAKE) --no-print-directory typecheck
	$(MAKE) --no-print-directory import-rules
	$(MAKE) --no-print-directory docs-rules

# The folders are installed as kelastic.agent, kelastic.operator and kelastic.localcluster
# (package-dir); mypy finds modules by their place on disk, so it reads them through links
# that give each folder its installed name. Strictness is set in pyproject.toml [tool.mypy].
MYPY_TREE := build/mypy/kelastic
typecheck:  ## mypy: strict for agent/ and operator/, checked for localcluster/
	@mkdir -p $(MYPY_TREE)
	@for part in agent operator localcluster; do ln -sfn ../../../$$part $(MYPY_TREE)/$$part; done
	cd build/mypy && $(PYTHON) -m mypy --config-file ../../pyproject.toml \
		-p kelastic.agent -p kelastic.operator -p kelastic.localcluster

import-rules:  ## agent imports nothing of ours; operator only the agent's contract; localcluster neither, and its parts import each other one way; no class over 500 lines, no function over 100
	$(PYTHON) -m pytest -q -p no:cacheprovider tests/packaging/test_pkg_imports.py

docs-rules:  ## docs/architecture.md names every module of agent/ and operator/, and every flag of the worker command
	$(PYTHON) -m pytest -q -p no:cacheprovider tests/packaging/test_pkg_docs.py

format:
	ruff check --fix .
	ruff format .

bench:  ## every benchmark prints its figures; none asserts a time
	for b in bench/bench_*.py; do echo "== $$b"; $(PYTHON) $$b || exit 1; done
