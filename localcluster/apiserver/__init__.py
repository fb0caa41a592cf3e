"""The API server emulator: kelastic's own Kubernetes API server, in one process.

:mod:`.apiserver` serves the REST API over HTTP; :mod:`.registry` holds the objects'
semantics (with :mod:`.storage`, :mod:`.schema`, :mod:`.cel`, :mod:`.ssa`,
:mod:`.patch`, :mod:`.podsecurity`, :mod:`.kinds`, …), :mod:`.gc` the garbage
collector and namespace termination. It imports only :mod:`kelastic.localcluster.common`
and knows nothing of the kubelet or of who its clients are.
``python -m kelastic.localcluster.apiserver`` runs it alone.
"""
