"""Fixtures shared by the API server tests (``test_api_*.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kelastic.localcluster.apiserver.apiserver import ApiServer


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    """A running API server on loopback with a kubeconfig at ``api.data_dir / "kubeconfig"``."""
    data = tmp_path_factory.mktemp("api")
    server = ApiServer(data_dir=data)
    server.start()
    server.write_kubeconfig(data / "kubeconfig")
    try:
        yield server
    finally:
        server.stop()
