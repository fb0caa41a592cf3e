"""The node-side controllers beside the kubelet, clients of the API server like it.

:mod:`.endpoints` keeps Services' EndpointSlices current (only without a real
controller-manager), :mod:`.proxy` makes ClusterIP Services reachable, and
:mod:`.provisioner` binds PersistentVolumeClaims to directories of the node. Like the
kubelet they import only :mod:`kelastic.localcluster.common`.
"""
