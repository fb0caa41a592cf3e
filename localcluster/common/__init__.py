"""What every part of the local cluster shares: the API client and small helpers.

:mod:`.client` is the one way a part reaches an API server (the emulator or a real
kube-apiserver): over HTTP, as a real node's components do. :mod:`.ipam` hands out the
loopback addresses of pods and Services; :mod:`.podlogs` says where containers' logs lie
(the kubelet writes them, the emulator reads them); :mod:`.interrupts` keeps a signal's
exception out of the sections that must not be cut in two. This part imports no other part.
"""
