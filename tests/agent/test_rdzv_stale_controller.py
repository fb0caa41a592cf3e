"""No stall on a known-dead member while the controller is down and its membership stale.

The controller (operator) published a membership listing three nodes, then stopped:
nobody updates the list. One node is lost. The survivors know within a second or two
(peer link for a killed process, heartbeat for a frozen one) and must re-form at
once, although the stale list still names the lost node and ``controller_timeout``
(the fall-back for a listed node that never joins) is a minute.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest

from kelastic.agent.rendezvous import control, start_server_process
from kelastic.agent.rendezvous.protocol import RunKeys, read_membership
from kelastic.agent.rendezvous.testing import kelastic_handler, rendezvous_concurrently, shutdown_handlers

VICTIM = """
    import sys, time
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from kelastic.agent.rendezvous import get_rendezvous_handler
    endpoint, run_id = sys.argv[1:3]
    handler = get_rendezvous_handler(RendezvousParameters(
        "kelastic", endpoint, run_id, 2, 3, local_addr="127.0.0.1", node_name="victim", join_timeout=60))
    info = handler.next_rendezvous()
    print(f"rank {info.rank} world {info.world_size}", flush=True)
    time.sleep(120)
"""

#: A stall would wait this long; every bound below is far shorter.
CONTROLLER_TIMEOUT = 60


@pytest.fixture
def victim_procs() -> Iterator[list[subprocess.Popen[str]]]:
    procs: list[subprocess.Popen[str]] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "how",
    [signal.SIGKILL, signal.SIGSTOP],  # link drops / only the heartbeat stops
    ids=["killed", "frozen"],
)
def test_dead_member_still_listed_does_not_delay_the_round(
    how: signal.Signals, victim_procs: list[subprocess.Popen[str]]
) -> None:
    server = start_server_process("127.0.0.1", 0, timeout=60)
    try:
        run = f"stale-controller-{how.name}"
        store = control.connect(server.endpoint)
        control.publish_membership(store, run, nodes=["a", "b", "victim"], min_nodes=2, max_nodes=3)
        # From here on the controller is down: nobody publishes again.
        victim = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(VICTIM), server.endpoint, run],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"},
            start_new_session=True,
        )
        victim_procs.append(victim)
        survivors = [
            kelastic_handler(
                server.endpoint,
                run,
                name,
                2,
                3,
                join_timeout=90,
                controller_timeout=CONTROLLER_TIMEOUT,
                keep_alive_interval=0.25,  # heartbeat verdict after 1.25 s (5 readings)
            )
            for name in ("a", "b")
        ]
        infos = rendezvous_concurrently(survivors, timeout=90)
        assert {i.world_size for i in infos} == {3}
        assert victim.stdout is not None and victim.stdout.readline().startswith("rank ")

        os.killpg(victim.pid, how)
        lost = time.monotonic()
        assert all(h.wait_membership_change(10.0) for h in survivors), "the lost node went unnoticed"
        noticed = time.monotonic() - lost
        again = time.monotonic()
        infos = rendezvous_concurrently(survivors, timeout=CONTROLLER_TIMEOUT + 30)
        reformed = time.monotonic() - again
        print(f"{how.name}: noticed after {noticed:.2f}s, re-formed {reformed:.2f}s later")
        assert {i.world_size for i in infos} == {2}
        assert sorted(i.rank for i in infos) == [0, 1]
        # The stale list still names the victim; the round did not wait for it.
        membership = read_membership(store, RunKeys(run))
        assert membership is not None and "victim" in membership.nodes
        assert reformed < 5.0, f"the round waited {reformed:.1f}s for a node known dead"
    finally:
        shutdown_handlers()
        server.stop()
