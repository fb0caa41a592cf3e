"""Which standbys hold which node's part (``plan.standby_holders``, ``plan.ReplicaPlan``): pure."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kelastic.agent.checkpoint.plan import ReplicaPlan, StandbyHolder, standby_holders

MIB = 2**20
RING = ["a:1", "b:1", "c:1"]


def sb(endpoint: str, parts: int, part: int = MIB) -> StandbyHolder:
    return StandbyHolder(endpoint, parts * part)


def test_a_standby_with_room_for_all_holds_every_part() -> None:
    assert standby_holders(RING, [sb("s:1", 3)], MIB) == {"a:1": ("s:1",), "b:1": ("s:1",), "c:1": ("s:1",)}


def test_an_unknown_part_size_gives_every_standby_every_part() -> None:
    got = standby_holders(RING, [sb("s:1", 0), sb("t:1", 0)], 0)
    assert got == {m: ("s:1", "t:1") for m in RING}


def test_with_less_room_the_likeliest_nodes_come_first() -> None:
    got = standby_holders(RING, [sb("s:1", 1)], MIB, likeliest=["c:1"])
    assert got == {"a:1": (), "b:1": (), "c:1": ("s:1",)}
    got = standby_holders(RING, [sb("s:1", 2)], MIB)  # no ranking: ring order
    assert got == {"a:1": ("s:1",), "b:1": ("s:1",), "c:1": ()}


def test_standbys_share_the_nodes_out_before_any_holds_a_second_copy() -> None:
    got = standby_holders(RING, [sb("s:1", 2), sb("t:1", 2)], MIB)
    covered = [m for m, holders in got.items() if holders]
    assert covered == RING  # 4 places cover all 3 nodes
    assert sum(len(h) for h in got.values()) == 4


def test_a_standby_on_the_ring_holds_nothing_and_duplicates_count_once() -> None:
    got = standby_holders(RING, [sb("b:1", 9), sb("s:1", 9), sb("s:1", 1)], MIB)
    assert got == {m: ("s:1",) for m in RING}


def test_no_standby_or_no_ring() -> None:
    assert standby_holders(RING, [], MIB) == {m: () for m in RING}
    assert standby_holders([], [sb("s:1", 3)], MIB) == {}


def test_the_plan_names_the_ring_successors_and_the_standbys() -> None:
    plan = ReplicaPlan(tuple(RING), 1, (sb("s:1", 3),), MIB)
    assert plan.peers("a:1") == ["b:1"]
    assert plan.standbys_of("a:1") == ["s:1"]
    assert plan.holders("a:1") == {"b:1", "s:1"}
    assert plan.holders("c:1") == {"a:1", "s:1"}
    assert plan.holders("x:1") == frozenset()  # not on the ring: it is assigned no holder


endpoints = st.lists(st.sampled_from([f"n{i}:1" for i in range(6)]), max_size=6, unique=True)


@given(
    ring=endpoints,
    standbys=st.lists(
        st.tuples(st.sampled_from([f"s{i}:1" for i in range(3)] + ["n0:1"]), st.integers(0, 8)), max_size=4
    ),
    part=st.sampled_from([0, 1, MIB]),
    likeliest=endpoints,
)
def test_properties(
    ring: list[str], standbys: list[tuple[str, int]], part: int, likeliest: list[str]
) -> None:
    holders = [StandbyHolder(e, n * max(part, 1)) for e, n in standbys]
    got = standby_holders(ring, holders, part, likeliest)
    again = standby_holders(ring, holders, part, likeliest)
    assert got == again  # deterministic
    assert set(got) == set(ring)
    spare: dict[str, int] = {}
    for h in holders:
        if h.endpoint not in ring and h.endpoint not in spare:
            spare[h.endpoint] = h.limit // part if part else len(ring)
    for hs in got.values():
        assert len(set(hs)) == len(hs) and set(hs) <= set(spare)  # spare standbys, each once
    for s, room in spare.items():
        assert sum(s in hs for hs in got.values()) == min(room, len(ring))  # room used, never exceeded
    covered = sum(1 for hs in got.values() if hs)
    assert covered == min(len(ring), sum(min(r, len(ring)) for r in spare.values()))  # widest coverage
