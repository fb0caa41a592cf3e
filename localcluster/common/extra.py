"""The ``local`` extra: what only ``kelastic local`` needs beyond the operator's and the agent's
dependencies (the operator's image installs kelastic without it).

:func:`missing_local_dependencies` names the extra's distributions that do not import here;
:func:`missing_extra_message` says what to install. The ``kelastic`` command checks before it
imports anything of the local cluster, so a missing one is a sentence, not a traceback. This
module imports nothing outside the standard library.
"""

from __future__ import annotations

import importlib

__all__ = ["LOCAL_DEPENDENCIES", "LOCAL_EXTRA", "missing_extra_message", "missing_local_dependencies"]

LOCAL_EXTRA = "local"
#: Import name → distribution, of what pyproject.toml's ``local`` extra installs.
LOCAL_DEPENDENCIES = {
    "aiohttp": "aiohttp",  # the API server emulator and every part's API client
    "yaml": "pyyaml",  # manifests, kubeconfigs
    "cryptography": "cryptography",  # a real control plane's and Kueue's certificates
}


def missing_local_dependencies() -> list[str]:
    """The distributions of the ``local`` extra that cannot be imported (in the extra's order)."""
    missing = []
    for module, distribution in LOCAL_DEPENDENCIES.items():
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(distribution)
    return missing


def missing_extra_message(missing: list[str]) -> str:
    """What to tell a user of ``kelastic local`` whose installation lacks ``missing``."""
    return (
        f"kelastic local needs the '{LOCAL_EXTRA}' extra, which is not installed here "
        f"(missing: {', '.join(missing)}). Install it with: "
        f"python3 -m pip install 'kelastic[{LOCAL_EXTRA}]' (in a checkout: python3 -m pip install -e '.[{LOCAL_EXTRA}]')"
    )
