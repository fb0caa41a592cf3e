"""Kueue beside a real control plane: the manager ``make kueue`` built, run as a process.

``KueueManager(directory, control_plane).start()`` installs Kueue's CRDs, writes its
configuration, signs its webhook certificate with the cluster's CA, starts
``<directory>/bin/kueue`` with the cluster's admin credentials and, once it is ready,
registers the webhooks of Kueue's own API (Workloads, ClusterQueues, LocalQueues, ...)
at its loopback address. The webhooks of the job kinds Kueue can also manage (Jobs,
pods, ...) are not registered: they would make the cluster refuse those kinds whenever
Kueue is down, and kelastic needs none of them.
"""

from __future__ import annotations

from kelastic.localcluster.kueue.manager import (
    ELASTICJOB_FRAMEWORK,
    KueueBinaries,
    KueueFailed,
    KueueManager,
    KueueUnsupported,
    find_kueue_dir,
)

__all__ = [
    "ELASTICJOB_FRAMEWORK",
    "KueueBinaries",
    "KueueFailed",
    "KueueManager",
    "KueueUnsupported",
    "find_kueue_dir",
]
