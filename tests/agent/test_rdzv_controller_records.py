"""The controller's records (``ctl/...`` and its ``dropped`` fates) signed with the job's key.

A real ``kelastic-rendezvous``; the controller's side as ``control.publish_membership`` writes
it, and a stranger's client that writes what it likes. A node that runs ``controlled=1`` with
the job's secret takes only what carries the job's MAC; the others read signed and unsigned
records alike.
"""

from __future__ import annotations

import json
import secrets

from kelastic.agent.rendezvous import ServerProcess, control, protocol
from kelastic.agent.rendezvous.protocol import CONTROLLER_DROPPED, ControllerBounds, Fate, RunKeys
from kelastic.agent.rendezvous.records import RecordSigner


def keys_of(run_id: str, key: bytes | None, *, controlled: bool = True) -> RunKeys:
    return RunKeys(run_id, RecordSigner.for_job(key), controlled)


def test_the_controllers_records_carry_the_jobs_mac_and_a_controlled_node_takes_no_other(
    server: ServerProcess, run_id: str
) -> None:
    key = secrets.token_hex(32).encode()
    store = control.connect(server.endpoint)
    control.publish_membership(store, run_id, nodes=["a", "b"], min_nodes=2, max_nodes=4, job_key=key)
    node = keys_of(run_id, key)
    assert protocol.read_bounds(store, node) == ControllerBounds(2, 4, 2)
    assert protocol.read_membership(store, node) is not None
    assert protocol.listed(store, node, "a") and not protocol.listed(store, node, "c")
    # A node that does not check (no secret, or not controlled) reads the same text.
    for reader in (keys_of(run_id, None), keys_of(run_id, key, controlled=False)):
        assert protocol.read_bounds(store, reader) == ControllerBounds(2, 4, 2)

    # The stranger: bounds of 1, a membership without b, b listed under a wrong MAC, garbage.
    stranger = keys_of(run_id, secrets.token_hex(32).encode())
    store.set(node.bounds, ControllerBounds(1, 1, 1).to_json())
    store.set(node.membership, json.dumps({"nodes": ["a"], "min_nodes": 1, "max_nodes": 1}))
    store.set(node.listed("c"), stranger.sign(node.listed("c"), "1"))
    before = node.signer.refused
    assert protocol.read_bounds(store, node) is None  # as if absent: the node waits, never shrinks
    assert protocol.read_membership(store, node) is None
    assert not protocol.listed(store, node, "c")
    assert node.signer.refused == before + 3
    store.set(node.bounds, b"\x00\xff not json")
    assert protocol.read_bounds(store, keys_of(run_id, None)) is None  # garbage is no bounds, no crash

    # The controller's next publication puts its own bounds back (it reads back only signed ones).
    control.publish_membership(store, run_id, nodes=["a", "b"], min_nodes=2, max_nodes=4, job_key=key)
    assert protocol.read_bounds(store, node) == ControllerBounds(2, 4, 2)


def test_a_dropped_fate_counts_for_a_controlled_node_only_when_signed(
    server: ServerProcess, run_id: str
) -> None:
    key = secrets.token_hex(32).encode()
    store = control.connect(server.endpoint)
    control.publish_membership(store, run_id, nodes=["a", "b"], min_nodes=1, max_nodes=4, job_key=key)
    node, plain = keys_of(run_id, key), keys_of(run_id, None)
    # The stranger claims the controller's fate for b, unsigned, and for a under its own key.
    store.set(node.fate(1, "b"), CONTROLLER_DROPPED)
    foreign = keys_of(run_id, secrets.token_hex(32).encode())
    store.set(node.fate(1, "a"), foreign.sign(node.fate(1, "a"), "dropped|controller"))
    assert protocol.read_fate(store, node, 1, "b") is None
    assert protocol.read_fate(store, node, 1, "a") is None
    # A node without a secret (it checks nothing) takes the controller's unsigned fate, as before.
    assert protocol.read_fate(store, plain, 1, "b") is Fate.DROPPED
    # The controller's own claim (signed) takes the place of the stranger's.
    signed = keys_of(run_id, key)
    assert protocol.claim_fate(store, signed, 1, "b", Fate.DROPPED, control.CONTROLLER)
    assert protocol.read_fate(store, node, 1, "b") is Fate.DROPPED


def test_agents_hold_tells_whose_key_signed_the_latest_close(server: ServerProcess, run_id: str) -> None:
    key, other = secrets.token_hex(32).encode(), secrets.token_hex(32).encode()
    store = control.connect(server.endpoint)
    assert control.agents_hold(store, run_id, key) is None  # no round closed yet
    agents = keys_of(run_id, key)
    store.add(agents.open, 1)
    close = protocol.RoundClose(2, "a", "t").to_value()
    store.set(agents.size(1), agents.sign(agents.size(1), close))
    assert control.agents_hold(store, run_id, key) is True
    assert control.agents_hold(store, run_id, other) is False
    store.set(agents.size(1), close)  # agents without a secret, or before records were signed
    assert control.agents_hold(store, run_id, key) is False
    assert agents.signer.refused == 0  # asked, not refused: nothing counted
