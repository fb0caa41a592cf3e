"""Real Kubernetes nodes on this machine: ``make node``'s kubelet, containerd and CNI.

:mod:`.lane` runs N nodes beside the real control plane (``kelastic local up
--control-plane DIR --real-nodes N``): each in a network namespace and cgroup of its own,
joined by one host bridge (:mod:`.plan` names everything, :mod:`.network` wires it,
:mod:`.configs` writes the components' files, :mod:`.images` makes the images without a
registry, :mod:`.hostops` changes the host). :mod:`.janitor` removes all of it when the lane
ends, also when its process is killed. It imports only :mod:`kelastic.localcluster.common`
and :mod:`kelastic.localcluster.controlplane`.
"""
