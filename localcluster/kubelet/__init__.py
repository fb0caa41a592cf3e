"""The process kubelet: runs the one node's pods as local processes.

:mod:`.kubelet` watches and binds pods and runs each one (:mod:`.runtime` and the
container :mod:`.shim`, :mod:`.podenv`, :mod:`.volumes`, :mod:`.probes`,
:mod:`.podstatus`, :mod:`.gpus`, :mod:`.images`, …); :mod:`.kubeletserver` answers a
real API server's requests for container logs. It reaches any API server only through
:mod:`kelastic.localcluster.common.client`, never the emulator's registry.
"""
