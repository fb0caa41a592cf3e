"""The real control plane's runner: ``kelastic local --control-plane DIR``.

:mod:`.controlplane` runs etcd, kube-apiserver, kube-controller-manager and
kube-scheduler from ``DIR``; :mod:`.pki` makes their certificates, :mod:`.tmpfs` keeps
etcd's data in RAM and sweeps what a killed cluster left. It imports only
:mod:`kelastic.localcluster.common`.
"""
