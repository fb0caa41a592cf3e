"""Publishing one node's training progress to the kelastic rendezvous store.

The agent hands its node's progress (the slowest local rank's step) to a
:class:`ProgressPublisher`; the operator reads the reports back
(``kelastic.agent.rendezvous.control.read_status``) into the job's status. This is the
only path by which progress reaches the store. With the job's secret (``job_key``) every
report carries the job's MAC (``control``'s module doc): the operator and the straggler rule
take no report a stranger wrote.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kelastic.agent.progress import NodeProgress

__all__ = ["ProgressPublisher"]

_log = logging.getLogger(__name__)

#: A node publishes at most this often on the agent's monitor ticks (seconds).
PUBLISH_PERIOD = 1.0
#: After the store could not be reached, publishing pauses this long (seconds).
PAUSE_AFTER_ERROR = 5.0


def _connect(endpoint: str) -> Any:
    from kelastic.agent.rendezvous import control  # torch.distributed: only when publishing

    return control.connect(endpoint, timeout=1.0)


def _publish(store: Any, run_id: str, node: str, **report: Any) -> None:
    from kelastic.agent.rendezvous import control

    control.publish_progress(store, run_id, node, **report)


def record_signer(job_key: bytes | None) -> Any:
    """The signer of the job's store records (``RecordSigner``; imported when first needed)."""
    from kelastic.agent.rendezvous.records import RecordSigner

    return RecordSigner.for_job(job_key)


class ProgressPublisher:
    """Best-effort publisher of one node's progress under ``node`` in run ``run_id``.

    It owns its own connection to the store at ``endpoint`` (opened on first use) and its
    back-off: after a failure it drops the connection, logs once, and publishes nothing
    for ``pause_after_error`` seconds, so the agent's monitor loop is never held up by a
    store that is restarting. Before the workers of a new attempt report, the last step
    published is repeated: a restarted worker resumes from its checkpoint, not from 0.
    ``job_key``: the job's secret, whose MAC every report carries (None: unsigned).
    Never raises.
    """

    def __init__(
        self,
        endpoint: str,
        run_id: str,
        node: str,
        *,
        period: float = PUBLISH_PERIOD,
        pause_after_error: float = PAUSE_AFTER_ERROR,
        connect: Callable[[str], Any] = _connect,
        publish: Callable[..., None] = _publish,
        clock: Callable[[], float] = time.monotonic,
        job_key: bytes | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.job_key = job_key
        self._signer: Any = None
        self.run_id = run_id
        self.node = node
        self._period = period
        self._pause_after_error = pause_after_error
        self._connect = connect
        self._publish = publish
        self._clock = clock
        self._store: Any = None
        self._last_publish: float | None = None
        self._paused_until = 0.0
        self._last_progress: tuple[int | None, int | None] = (None, None)
        self._failure_logged = False

    def due(self) -> bool:
        """Whether a monitor tick should publish now (at most once per ``period``)."""
        return self._last_publish is None or self._clock() - self._last_publish >= self._period

    def publish(
        self,
        progress: NodeProgress | None,
        *,
        restarts: int,
        local_world_size: int,
        recovery: tuple[float, float] | None = None,
        failure: tuple[str, float] | None = None,
        hang: tuple[tuple[int, ...], float, float] | None = None,
        checkpoint: dict[str, Any] | None = None,
        goodput: dict[str, Any] | None = None,
        round_: int | None = None,
    ) -> bool:
        """Publish now (unless paused after an error); True if the store took the report.

        ``round_``: the rendezvous round this node is a member of (signed with the report:
        readers of another round take it for none)."""
        now = self._clock()
        self._last_publish = now
        if now < self._paused_until:
            return False
        if progress is not None:
            self._last_progress = (progress.step, progress.total)
        step, total = self._last_progress
        try:
            if self._store is None:
                self._store = self._connect(self.endpoint)
            if self._signer is None:
                self._signer = record_signer(self.job_key)
            self._publish(
                self._store,
                self.run_id,
                self.node,
                step=step,
                total=total,
                restarts=restarts,
                local_world_size=local_world_size,
                recovery=recovery,
                failure=failure,
                hang=hang,
                checkpoint=checkpoint,
                goodput=goodput,
                signer=self._signer,
                round_=round_,
            )
        except Exception as e:  # progress is best effort; the store may be restarting
            self._store = None
            self._paused_until = now + self._pause_after_error
            if not self._failure_logged:
                _log.warning("could not publish progress to %s: %s", self.endpoint, e)
                self._failure_logged = True
            return False
        self._failure_logged = False
        return True

    def close(self) -> None:
        """Drop the store connection (the agent is stopping)."""
        self._store = None
