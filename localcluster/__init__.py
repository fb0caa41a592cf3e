"""kelastic local: a Kubernetes API server emulator and a process kubelet on one machine."""

from .apiserver import ApiServer
from .errors import ApiError

__all__ = ["ApiError", "ApiServer"]
