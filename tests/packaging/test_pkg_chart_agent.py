"""The chart tells the operator which image to inject into workers and to run store pods with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip(
    "helm_python", reason="helm-python-sdk is a dev dependency: pip install -e '.[dev]'"
)

CHART = Path(__file__).resolve().parents[2] / "helm" / "kelastic"


def operator_args(values: dict[str, Any]) -> list[str]:
    helm.disable_logging()
    with helm.Chart.load(CHART) as chart:
        rendered = chart.render(values, name="kelastic", namespace="default", is_install=True)
    (deployment,) = [
        d
        for path, text in rendered.items()
        if path.endswith(".yaml")
        for d in yaml.safe_load_all(text)
        if d and d.get("kind") == "Deployment"
    ]
    return list(deployment["spec"]["template"]["spec"]["containers"][0]["args"])


def test_agent_image_defaults_to_the_operators_image() -> None:
    args = operator_args({"image": {"repository": "registry.example/kelastic", "tag": "1.2"}})
    assert "--agent-image=registry.example/kelastic:1.2" in args
    assert not [
        a for a in args if a.startswith("--store-image")
    ]  # the operator defaults it to the agent image


def test_agent_and_store_images_can_be_set() -> None:
    args = operator_args({"agent": {"image": "mirror/kelastic:1.2", "storeImage": "mirror/store:1"}})
    assert "--agent-image=mirror/kelastic:1.2" in args and "--store-image=mirror/store:1" in args
    from kelastic.operator.cli import build_parser

    parsed = build_parser().parse_args(args[args.index("--agent-image=mirror/kelastic:1.2") :][:2])
    assert (parsed.agent_image, parsed.store_image) == ("mirror/kelastic:1.2", "mirror/store:1")


def test_helper_resources_reach_the_operator() -> None:
    store = {"requests": {"cpu": "100m", "memory": "300Mi"}, "limits": {"memory": "1Gi"}}
    args = operator_args({"agent": {"storeResources": store, "injectResources": {"limits": {"cpu": "1"}}}})
    from kelastic.operator.cli import build_parser

    flags = [a for a in args if a.startswith(("--store-resources=", "--inject-resources="))]
    parsed = build_parser().parse_args(flags)
    assert parsed.store_resources == store and parsed.inject_resources == {"limits": {"cpu": "1"}}
    assert not [a for a in operator_args({}) if "resources" in a]  # the operator's defaults apply
