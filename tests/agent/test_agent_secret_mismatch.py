"""A secret that differs is an error: agents that do not share the job's secret never train
with their checkpoint replicas silently missing, nor end with 0 as if they had succeeded.

Real ``python -m kelastic.agent`` processes of one job, given different ``--job-secret-file``
contents; and the peer link, in process, that tells such a peer from a lost one.
"""

from __future__ import annotations

import runpy
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from kelastic.agent.rendezvous.liveness import PeerLink
from kelastic.agent.rendezvous.server import ServerProcess

harness = SimpleNamespace(**runpy.run_path(str(Path(__file__).with_name("agent_harness.py"))))


@pytest.mark.slow
def test_two_agents_with_different_secrets_fail_and_say_so(tmp_path: Path, store: ServerProcess) -> None:
    """Each cluster makes its own secret file: the two agents of one job hold different keys.
    Neither trains on as if nothing happened, nor exits 0: the first to prove its key to the
    other exits 1 saying that its secret is not the other's; the other, left alone, exits 1
    once its rendezvous times out (it waits, saying for what, for a peer that will not come)."""
    run_id = f"mismatch-{tmp_path.name}"
    clusters = [harness.Cluster(tmp_path / n, store.endpoint, run_id=run_id) for n in ("a", "b")]
    assert clusters[0].secret.read_text() != clusters[1].secret.read_text()
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-conf", "join_timeout=20"]
    try:
        agents = [
            c.start(n, args, ["--steps", "200", "--step-time", "0.05"])
            for c, n in zip(clusters, ("a", "b"), strict=True)
        ]
        codes = [a.wait(240) for a in agents]
        outputs = {a.name: a.output() for a in agents}
        everything = "\n".join(o[-3000:] for o in outputs.values())
        assert codes == [1, 1], everything
        # Whichever sees it first says so: the peer link (a proof the other refused), or the
        # join records of the round (signed with the other's key, which this node cannot check).
        by_link = [
            n
            for n, out in outputs.items()
            if f"node {n} does not hold the job secret of rendezvous {run_id}" in out
        ]
        by_records = [n for n, out in outputs.items() if "are not signed with this node's job secret" in out]
        assert by_link or by_records, everything
        for name in by_link:
            other = "b" if name == "a" else "a"
            assert f"peer link to {other}" in outputs[name] and "--job-secret-file" in outputs[name]
        for name in by_records:
            assert "--job-secret-file is not the one the other agents of the job hold" in outputs[name]
            # said at the first record, too, not only when its join timed out
            assert "an agent's given another --job-secret-file" in outputs[name], outputs[name]
        assert "watching its heartbeat only" not in everything, everything
    finally:
        for c in clusters:
            c.close()


def _wait_until(cond: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


def test_a_peer_with_another_secret_is_a_mismatch_not_a_loss() -> None:
    lost: list[tuple[int, str]] = []
    mine = PeerLink("127.0.0.1", lambda r, n: lost.append((r, n)), b"k" * 64)
    theirs = PeerLink("127.0.0.1", lambda r, n: None, b"o" * 64)
    same = PeerLink("127.0.0.1", lambda r, n: None, b"k" * 64)
    try:
        mine.watch((1, "same", "127.0.0.1", same.port))
        assert _wait_until(lambda: same.connections() == (0, 1), 10), same.connections()
        assert mine.mismatch is None
        mine.watch((2, "theirs", "127.0.0.1", theirs.port))
        assert _wait_until(lambda: mine.mismatch is not None, 10)
        assert f"peer link to theirs at 127.0.0.1:{theirs.port}" in str(mine.mismatch)
        assert "do not hold the same job secret" in str(mine.mismatch)
        assert lost == [], "a peer with another secret is alive: no verdict on its life"
    finally:
        for link in (mine, theirs, same):
            link.close()


@pytest.mark.slow
def test_with_torchs_c10d_backend_agents_with_different_secrets_fail_and_say_so(tmp_path: Path) -> None:
    """torch's ``c10d`` rendezvous has no peer link and no signed records: the checkpoint ring
    tells. Each node's replica is refused by the other's service, each asks the ring which of
    them holds another secret, and with two nodes both stop (either may be the wrong one),
    exit 1; the first to stop says to give every agent the same ``--job-secret-file`` (the
    other may first lose the store, which torch's ``c10d`` keeps in one of the agents)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    clusters = [harness.Cluster(tmp_path / n) for n in ("a", "b")]
    script = Path(harness.SCRIPT).with_name("ckpt_worker.py")
    try:
        agents = [
            c.start(
                n,
                [
                    "--rdzv-backend",
                    "c10d",
                    "--rdzv-endpoint",
                    f"127.0.0.1:{port}",
                    "--rdzv-id",
                    tmp_path.name,
                    "--nnodes",
                    "2",
                    "--nproc-per-node",
                    "1",
                    "--node-rank",
                    str(i),
                ],
                ["--steps", "400", "--step-time", "0.05", "--mib", "1"],
                rendezvous=False,
                script=script,
            )
            for i, (c, n) in enumerate(zip(clusters, ("a", "b"), strict=True))
        ]
        codes = [a.wait(240) for a in agents]
        everything = "\n".join(a.output()[-3000:] for a in agents)
        assert codes == [1, 1], everything
        said = [a.name for a in agents if "does not hold the job secret of its peers" in a.output()]
        assert said, everything
        for agent in agents:
            if agent.name in said:
                assert "give every agent of the job the same --job-secret-file" in agent.output()
    finally:
        for c in clusters:
            c.close()
