"""Table tests of the checkpoint service's pure decisions (kelastic.agent.checkpoint.plan, settings)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kelastic.agent.checkpoint.plan import (
    HeldCheckpoint,
    Inventory,
    Source,
    choose_restore,
    memory_needed,
    next_id,
    replica_refusal,
    successors,
)
from kelastic.agent.checkpoint.settings import CheckpointSettings, auto_limit, format_bytes, parse_quantity

REQ = {"__0.mem": 100, "__1.mem": 50}


def held(cid: int, files: dict[str, int], *, replicas: set[str] = set(), meta: bool = True) -> HeldCheckpoint:  # noqa: B006
    return HeldCheckpoint(cid, files, frozenset(replicas), dict(REQ) if meta else None, step=cid * 10)


def inv(endpoint: str, *h: HeldCheckpoint, durable: tuple[tuple[int, str], ...] = ()) -> Inventory:
    return Inventory(node=endpoint, endpoint=endpoint, held=h, durable=durable)


def test_the_newest_checkpoint_whose_every_file_is_held_wins() -> None:
    a = inv("a", held(1, {"__0.mem": 100}), held(2, {"__0.mem": 100}))
    b = inv("b", held(1, {"__1.mem": 50}), held(2, {"__1.mem": 50}))
    choice = choose_restore([a, b])
    assert choice is not None and (choice.id, choice.source, choice.step) == (2, Source.MEMORY, 20)
    assert choice.holders == {"__0.mem": ("a",), "__1.mem": ("b",)}
    assert choice.metadata_from == ("a", "b")


def test_a_checkpoint_missing_a_file_falls_back_to_the_previous_one() -> None:
    a = inv("a", held(1, {"__0.mem": 100}), held(2, {"__0.mem": 100}))
    b = inv("b", held(1, {"__1.mem": 50}))  # b lost its part of 2 (or never wrote it)
    choice = choose_restore([a, b])
    assert choice is not None and choice.id == 1


def test_an_uncommitted_checkpoint_is_never_chosen() -> None:
    a = inv("a", held(1, {"__0.mem": 100}), held(2, {"__0.mem": 100}, meta=False))
    b = inv("b", held(1, {"__1.mem": 50}), held(2, {"__1.mem": 50}, meta=False))
    choice = choose_restore([a, b])
    assert choice is not None and choice.id == 1


def test_a_file_shorter_than_the_manifest_does_not_count() -> None:
    a = inv("a", held(1, {"__0.mem": 99, "__1.mem": 50}))
    assert choose_restore([a]) is None


def test_metadata_on_one_node_is_enough_and_a_replica_makes_the_source_replica() -> None:
    b = inv("b", held(3, {"__1.mem": 50, "__0.mem": 100}, replicas={"__0.mem"}))
    c = inv("c", held(3, {}, meta=False))
    choice = choose_restore([c, b])
    assert choice is not None and (choice.id, choice.source) == (3, Source.REPLICA)
    assert choice.holders["__0.mem"] == ("b",) and choice.metadata_from == ("b",)


def test_the_writers_own_copy_is_read_before_a_replica() -> None:
    a = inv("a", held(1, {"__0.mem": 100}))
    b = inv("b", held(1, {"__1.mem": 50, "__0.mem": 100}, replicas={"__0.mem"}))
    choice = choose_restore([b, a])
    assert choice is not None and choice.source is Source.MEMORY
    assert choice.holders["__0.mem"] == ("a", "b")


@pytest.mark.parametrize(
    ("durable", "expected"),
    [
        (((5, "/d/checkpoint-5"),), (5, Source.DURABLE)),  # newer than memory
        (((2, "/d/checkpoint-2"),), (2, Source.MEMORY)),  # a tie: memory is faster
        (((1, "/d/checkpoint-1"),), (2, Source.MEMORY)),
    ],
)
def test_the_durable_directory_wins_only_when_newer(
    durable: tuple[tuple[int, str], ...], expected: tuple[int, Source]
) -> None:
    a = inv("a", held(2, {"__0.mem": 100, "__1.mem": 50}), durable=durable)
    choice = choose_restore([a])
    assert choice is not None and (choice.id, choice.source) == expected


def test_nothing_to_restore() -> None:
    assert choose_restore([]) is None
    assert choose_restore([inv("a"), inv("b")]) is None


def test_inventory_round_trips_through_json() -> None:
    i = inv("a", held(2, {"__0.mem": 100}, replicas={"__0.mem"}), durable=((1, "/d/checkpoint-1"),))
    assert Inventory.from_json(i.to_json()) == i


@pytest.mark.parametrize(
    ("ring", "me", "replicas", "expected"),
    [
        (["a", "b", "c"], "a", 1, ["b"]),
        (["a", "b", "c"], "c", 1, ["a"]),
        (["a", "b", "c"], "b", 2, ["c", "a"]),
        (["a", "b", "c"], "b", 5, ["c", "a"]),  # never itself
        (["a"], "a", 1, []),
        (["a", "b"], "x", 1, []),  # joined after the save began
        (["a", "b"], "a", 0, []),
    ],
)
def test_successors(ring: list[str], me: str, replicas: int, expected: list[str]) -> None:
    assert successors(ring, me, replicas) == expected


def test_next_id_only_grows() -> None:
    assert next_id([]) == 1
    assert next_id([0, 0]) == 1
    assert next_id([3, 7, 0]) == 8  # a returning node with an old number does not pull it back


def test_memory_needed_counts_the_kept_checkpoint_and_incoming_replicas() -> None:
    assert memory_needed(kept=100, new_part=50, replicas=1) == 200
    assert memory_needed(kept=0, new_part=50, replicas=0) == 50


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("512Mi", 512 * 2**20),
        ("4Gi", 4 * 2**30),
        ("2G", 2 * 10**9),
        ("1000", 1000),
        ("1.5Gi", 3 * 2**29),
        ("0", 0),
    ],
)
def test_parse_quantity(text: str, value: int) -> None:
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "-1Gi", "4GB", "lots", "1Ei"])
def test_parse_quantity_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="not a memory quantity"):
        parse_quantity(text)


def test_auto_limit() -> None:
    limit, why = auto_limit(10 * 2**30, 64 * 2**30, None)
    assert limit == 4 * 2**30 and "container" in why
    limit, why = auto_limit(None, 64 * 2**30, None)
    assert limit == 16 * 2**30 and "no container memory limit" in why
    limit, why = auto_limit(None, 64 * 2**30, 2**30)
    assert limit == 2**30 and "tmpfs" in why


def settings(**kw: object) -> CheckpointSettings:
    return CheckpointSettings(root=Path("/x"), limit=2**30, node="n", **kw)  # type: ignore[arg-type]


def test_persist_due() -> None:
    assert not settings().persist_due(1, None)
    assert settings(persist_dir=Path("/d")).persist_due(7, 0.1)  # no rule: every checkpoint
    every3 = settings(persist_dir=Path("/d"), persist_every=3)
    assert [c for c in range(1, 10) if every3.persist_due(c, 0.0)] == [3, 6, 9]
    timed = settings(persist_dir=Path("/d"), persist_interval=60)
    assert timed.persist_due(1, None) and not timed.persist_due(2, 10.0) and timed.persist_due(3, 61.0)


def test_settings_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="replicas"):
        settings(replicas=-1)
    with pytest.raises(ValueError, match="positive"):
        CheckpointSettings(root=Path("/x"), limit=0, node="n")


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (100, 12 * 2**10, 512 * 2**20, 3 * 2**30)] == [
        "100 B",
        "12.0 KiB",
        "512 MiB",
        "3.0 GiB",
    ]


def test_a_replica_is_taken_only_from_the_node_the_ring_assigns_it_and_from_its_address() -> None:
    ring = ["10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1"]
    me = "10.0.0.2:1"
    assert replica_refusal(ring, me, "10.0.0.1:1", "10.0.0.1", "10.0.0.1", 1) is None
    assert "other nodes" in str(replica_refusal(ring, me, "10.0.0.3:1", "10.0.0.3", "10.0.0.3", 1))
    assert "another address" in str(replica_refusal(ring, me, "10.0.0.1:1", "10.0.0.1", "10.0.0.9", 1))
    assert "no node of this round" in str(replica_refusal(ring, me, "10.0.0.9:1", "10.0.0.9", "10.0.0.9", 1))
    assert "must name" in str(replica_refusal(ring, me, None, None, "10.0.0.1", 1))
    assert replica_refusal([], me, None, None, "10.0.0.9", 1) is None  # told no ring: takes every replica


def test_a_node_off_the_ring_it_knows_takes_every_members_part_in_its_own_name_only() -> None:
    # A hot standby (or a node that stepped aside: the ring it knows is an older round's)
    # gets every member's part, the new round's members included.
    ring = ["10.0.0.1:1", "10.0.0.2:1"]
    standby = "10.0.0.5:1"
    assert replica_refusal(ring, standby, "10.0.0.1:1", "10.0.0.1", "10.0.0.1", 1) is None
    assert replica_refusal(ring, standby, "10.0.0.7:1", "10.0.0.7", "10.0.0.7", 1) is None
    assert "another address" in str(replica_refusal(ring, standby, "10.0.0.1:1", "10.0.0.1", "10.0.0.7", 1))
    assert "must name" in str(replica_refusal(ring, standby, None, None, "10.0.0.1", 1))
