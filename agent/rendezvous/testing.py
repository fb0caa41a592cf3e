"""Helpers for tests and benchmarks that drive several handlers from one process."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo, RendezvousParameters

from kelastic.agent.contract import ENV_JOB_SECRET_FILE
from kelastic.agent.secret import read_secret_file

from .handler import KelasticRendezvousHandler, create_handler
from .protocol import RunKeys
from .records import RecordSigner

__all__ = [
    "in_thread",
    "job_key",
    "job_keys",
    "kelastic_handler",
    "rendezvous_concurrently",
    "shutdown_handlers",
]

# Every handler kelastic_handler made and shutdown_handlers has not shut down yet.
_live: list[KelasticRendezvousHandler] = []


def kelastic_handler(
    endpoint: str,
    run_id: str,
    name: str,
    min_nodes: int,
    max_nodes: int,
    *,
    local_addr: str = "127.0.0.1",
    **conf: Any,
) -> KelasticRendezvousHandler:
    """A ``kelastic`` handler for node ``name`` (``conf`` as in ``--rdzv-conf``).

    The handler is remembered until :func:`shutdown_handlers` shuts it down.
    """
    params = RendezvousParameters(
        "kelastic", endpoint, run_id, min_nodes, max_nodes, local_addr=local_addr, node_name=name, **conf
    )
    handler = create_handler(params)
    _live.append(handler)
    return handler


def shutdown_handlers() -> None:
    """Shut down every handler :func:`kelastic_handler` made (tests call it after each test)."""
    while _live:
        _live.pop().shutdown()


def rendezvous_concurrently(
    handlers: Sequence[RendezvousHandler], timeout: float = 60.0
) -> list[RendezvousInfo]:
    """Call ``next_rendezvous`` on every handler at once (one thread each).

    Returns the infos in handler order; re-raises the first error; raises
    TimeoutError naming how many handlers were still waiting after ``timeout`` s.
    """
    results: list[Any] = [None] * len(handlers)
    done = threading.Semaphore(0)

    def run(i: int) -> None:
        try:
            results[i] = handlers[i].next_rendezvous()
        except BaseException as exc:
            results[i] = exc
        finally:
            done.release()

    threads = [
        threading.Thread(target=run, args=(i,), name=f"rendezvous-{i}", daemon=True)
        for i in range(len(handlers))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
    pending = sum(t.is_alive() for t in threads)
    if pending:
        raise TimeoutError(
            f"{pending} of {len(handlers)} handlers were still in next_rendezvous after {timeout:.0f}s"
        )
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


def in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    """Run ``fn`` on a daemon thread; the list gets its result, or the exception it raised."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def job_key() -> bytes | None:
    """The job's secret as its agents read it from ``$KELASTIC_JOB_SECRET_FILE`` (None without one)."""
    path = os.environ.get(ENV_JOB_SECRET_FILE)
    return read_secret_file(path, flag=ENV_JOB_SECRET_FILE) if path else None


def job_keys(run_id: str, *, controlled: bool = False) -> RunKeys:
    """The keys of run ``run_id`` signing as the job's agents do, with the secret of
    ``$KELASTIC_JOB_SECRET_FILE`` (unsigned without one): for a test that writes records by hand."""
    return RunKeys(run_id, RecordSigner.for_job(job_key()), controlled)
