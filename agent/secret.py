"""The job's secret: read and checked, made for a run that needs none from outside, or refused.

The secret authenticates kelastic's own protocols (the checkpoint service, the rendezvous
peer links; :mod:`kelastic.agent.auth`). Where it comes from, in this order:

* **a file** (``--job-secret-file``, ``$KELASTIC_JOB_SECRET_FILE``): the operator mounts one
  Secret per job at :data:`~kelastic.agent.contract.JOB_SECRET_FILE`. Its bytes, with
  surrounding whitespace stripped, are the key: at least
  :data:`~kelastic.agent.contract.JOB_SECRET_MIN_BYTES` of them (64 hex digits are 64);
* **none, explicitly** (``--insecure-no-secret``): a fixed, public key, so that agents
  without a secret still speak the same protocol to each other; it authenticates nothing;
* **made here** (:func:`ephemeral_secret`): a single-node run whose services listen on
  loopback only (``--standalone``, a laptop) gets a random key of its own in a 0600 file,
  so even that run's checkpoint service answers only its own workers.

Anything else is refused before a service starts (:func:`decide`): an agent whose services
would listen beyond loopback, or a job of several nodes (whose agents must share one key),
with no secret and no explicit opt-out.

Workers are handed the secret's *path* (``$KELASTIC_JOB_SECRET_FILE``), never the key in
their environment; :func:`secret_from_env` reads it back in a worker.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from kelastic.agent.contract import (
    ENV_INSECURE_NO_SECRET,
    ENV_JOB_SECRET_FILE,
    FLAG_INSECURE_NO_SECRET,
    FLAG_JOB_SECRET_FILE,
    JOB_SECRET_FILE,
    JOB_SECRET_MIN_BYTES,
)

__all__ = [
    "INSECURE_KEY",
    "Decision",
    "JobSecret",
    "SecretError",
    "SecretSource",
    "advertised_address",
    "bind_address",
    "decide",
    "ephemeral_secret",
    "for_agent",
    "insecure_secret",
    "is_loopback",
    "read_secret_file",
    "resolve",
    "secret_from_env",
    "secret_from_file",
    "truthy",
]

#: The key of ``--insecure-no-secret``: public, so it proves nothing; it only keeps one protocol.
INSECURE_KEY = b"kelastic: no job secret (--insecure-no-secret); this key authenticates nothing"

#: A secret file larger than this is not one (a wrong path: a log, a binary).
_MAX_FILE_BYTES = 4096

#: How to make a secret by hand, for messages.
MAKE_ONE = (
    "make one with `python3 -c 'import secrets; print(secrets.token_hex(32))' > job-secret && "
    "chmod 600 job-secret` and give every agent of the job the same file"
)


class SecretError(ValueError):
    """The job's secret cannot be used (or is missing where one is needed); the message
    names the flag, the file and what to do. A configuration error: exit status 2."""


class SecretSource(str, Enum):
    """Where an agent's key came from."""

    #: ``--job-secret-file`` (the operator's Secret in a pod).
    FILE = "file"
    #: Made by this agent for a single-node run on loopback.
    EPHEMERAL = "ephemeral"
    #: ``--insecure-no-secret``: the public :data:`INSECURE_KEY`.
    INSECURE = "insecure"


@dataclass(frozen=True)
class JobSecret:
    """The key of kelastic's protocols and where it came from.

    ``path`` is the file workers read it from (None for :attr:`SecretSource.INSECURE`);
    ``owned`` is the folder this agent made for an ephemeral key (removed by :meth:`discard`).
    The key never appears in ``repr``.
    """

    key: bytes = field(repr=False)
    source: SecretSource
    path: str | None = None
    owned: str | None = None

    def worker_env(self) -> dict[str, str]:
        """What a worker needs to authenticate to its agent: the file's path, never the key."""
        if self.source is SecretSource.INSECURE:
            return {ENV_INSECURE_NO_SECRET: "1"}
        assert self.path is not None
        return {ENV_JOB_SECRET_FILE: self.path}

    def describe(self) -> str:
        """For the agent's start-up line (never the key)."""
        return {
            SecretSource.FILE: f"the job's secret from {self.path}",
            SecretSource.EPHEMERAL: f"a secret of this agent's own ({self.path}; loopback only)",
            SecretSource.INSECURE: f"no secret ({FLAG_INSECURE_NO_SECRET}): unauthenticated",
        }[self.source]

    def discard(self) -> None:
        """Remove an ephemeral key's folder (nothing for the other sources)."""
        if self.owned is not None:
            shutil.rmtree(self.owned, ignore_errors=True)


def truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def read_secret_file(path: str | os.PathLike[str], *, flag: str = FLAG_JOB_SECRET_FILE) -> bytes:
    """The key in ``path``; SecretError naming ``flag`` and the file when it cannot be one."""
    where = f"{flag} {os.fspath(path)}"
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise SecretError(
            f"{where}: no such file. In a pod the operator mounts the job's secret at {JOB_SECRET_FILE}; "
            f"elsewhere {MAKE_ONE}"
        ) from None
    except IsADirectoryError:
        raise SecretError(f"{where} is a directory; name the file in it (its key is job-secret)") from None
    except PermissionError:
        raise SecretError(
            f"{where}: permission denied; the agent's user ({os.getuid()}) must be able to read it"
        ) from None
    except OSError as e:
        raise SecretError(f"{where}: cannot read it: {e.strerror or e}") from None
    if len(data) > _MAX_FILE_BYTES:
        raise SecretError(f"{where} is over {_MAX_FILE_BYTES} bytes: not a job secret (a wrong path?)")
    key = data.strip()
    if len(key) < JOB_SECRET_MIN_BYTES:
        raise SecretError(
            f"{where} holds {len(key)} bytes; a job secret has at least {JOB_SECRET_MIN_BYTES} "
            f"(the operator writes 64 hex digits); {MAKE_ONE}"
        )
    return key


def secret_from_file(path: str) -> JobSecret:
    return JobSecret(read_secret_file(path), SecretSource.FILE, path=path)


def insecure_secret() -> JobSecret:
    return JobSecret(INSECURE_KEY, SecretSource.INSECURE)


def ephemeral_secret() -> JobSecret:
    """A random key in a 0600 file of a 0700 folder of this agent's own (see :meth:`JobSecret.discard`)."""
    folder = tempfile.mkdtemp(prefix="kelastic-secret-")  # 0700, ours alone
    path = os.path.join(folder, "job-secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        key = secrets.token_hex(32).encode()
        os.write(fd, key + b"\n")
    finally:
        os.close(fd)
    return JobSecret(key, SecretSource.EPHEMERAL, path=path, owned=folder)


def secret_from_env(environ: Mapping[str, str] | None = None) -> JobSecret:
    """A worker's key: the file its agent named, or the public key of an agent started with
    ``--insecure-no-secret``. SecretError when neither is set (not started by a kelastic agent
    that has a secret)."""
    env = os.environ if environ is None else environ
    path = env.get(ENV_JOB_SECRET_FILE)
    if path:
        return JobSecret(read_secret_file(path, flag=f"${ENV_JOB_SECRET_FILE}"), SecretSource.FILE, path=path)
    if truthy(env.get(ENV_INSECURE_NO_SECRET)):
        return insecure_secret()
    raise SecretError(
        f"no job secret: ${ENV_JOB_SECRET_FILE} is not set. The kelastic agent sets it for its workers; "
        "a process it did not start cannot talk to its services"
    )


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is a loopback address; unresolvable: False."""
    text = host.strip().strip("[]")
    try:
        return ipaddress.ip_address(text).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(text, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)


@dataclass(frozen=True)
class Decision:
    """What :func:`decide` says: the source to use (None: this agent needs no key), or why
    the agent refuses to start."""

    source: SecretSource | None
    refusal: str | None = None


def decide(
    *,
    secret_file: str | None,
    insecure: bool,
    serves: bool,
    listen: str,
    max_nodes: int,
) -> Decision:
    """Which key an agent uses (pure).

    ``serves``: the agent runs a kelastic protocol at all (checkpoint service, peer link);
    ``listen``: the address its services would listen on; ``max_nodes``: the job's most nodes.
    """
    if secret_file:
        return Decision(SecretSource.FILE)
    if insecure:
        return Decision(SecretSource.INSECURE)
    if not serves:
        return Decision(None)
    loopback = is_loopback(listen)
    if loopback and max_nodes <= 1:
        return Decision(SecretSource.EPHEMERAL)
    if not loopback:
        why = (
            f"its checkpoint service and peer link would listen on {listen}, beyond loopback, where anyone "
            "who reaches them could read, overwrite or run code through the job's checkpoints"
        )
    else:
        why = f"the {max_nodes} nodes this job may have must share one secret to talk to each other"
    return Decision(
        None,
        f"no job secret: pass {FLAG_JOB_SECRET_FILE} FILE (${ENV_JOB_SECRET_FILE}) or, on a network you "
        f"trust, {FLAG_INSECURE_NO_SECRET}: {why}. In a pod the operator mounts the job's secret at "
        f"{JOB_SECRET_FILE}; by hand, {MAKE_ONE} (docs/security.md)",
    )


def resolve(decision: Decision, secret_file: str | None) -> JobSecret | None:
    """The key a :func:`decide` answer names (reads the file, makes an ephemeral key);
    SecretError for a refusal or an unusable file."""
    if decision.refusal is not None:
        raise SecretError(decision.refusal)
    if decision.source is SecretSource.FILE:
        assert secret_file
        return secret_from_file(secret_file)
    if decision.source is SecretSource.INSECURE:
        return insecure_secret()
    if decision.source is SecretSource.EPHEMERAL:
        return ephemeral_secret()
    return None


# --- where an agent's services listen, and the key they need -----------------------------------
def advertised_address(local_addr: str | None, rdzv_endpoint: str) -> str:
    """The address peers reach this node's services on: ``--local-addr``, else the local
    address of the route to the rendezvous store, else loopback."""
    if local_addr:
        return local_addr
    host = rdzv_endpoint.rpartition(":")[0].strip("[]") if rdzv_endpoint else ""
    if host:
        try:
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((host, 9))  # no packet: only picks the route
                addr: str = s.getsockname()[0]
                return addr
        except OSError:
            pass
    return "127.0.0.1"


def bind_address(local_addr: str | None, advertised: str) -> str:
    """Where the checkpoint service listens: ``--local-addr``, loopback when that is where
    it is reached anyway, else every interface."""
    if local_addr:
        return local_addr
    return advertised if is_loopback(advertised) else "0.0.0.0"


def for_agent(
    *,
    secret_file: str | None,
    insecure: bool,
    serves: bool,
    local_addr: str | None,
    rdzv_endpoint: str,
    standalone: bool,
    max_nodes: int,
) -> JobSecret | None:
    """The key an agent with these flags uses (:func:`decide`, then :func:`resolve`);
    SecretError when it must refuse to start or the file is unusable."""
    endpoint = "127.0.0.1:0" if standalone else rdzv_endpoint
    listen = bind_address(local_addr, advertised_address(local_addr, endpoint))
    decision = decide(
        secret_file=secret_file, insecure=insecure, serves=serves, listen=listen, max_nodes=max_nodes
    )
    return resolve(decision, secret_file)
