"""The node-side controllers beside the kubelet, clients of the API server like it.

:mod:`.endpoints` says which pods back a Service, :mod:`.proxy` makes ClusterIP
Services reachable through them, and
:mod:`.provisioner` binds PersistentVolumeClaims to directories of the node. Like the
kubelet they import only :mod:`kelastic.localcluster.common`.
"""
