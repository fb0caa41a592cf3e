"""When a node starts its spare workers (pure), and what the agent's environment turns on."""

from __future__ import annotations

from kelastic.agent.spare import ENV_SPARE_WORKERS, SPARE_AFTER, Spares, due, spares_enabled


def test_spares_start_once_the_group_has_trained_a_while_and_none_is_held() -> None:
    assert due(True, False, 100.0, 100.0 + SPARE_AFTER)
    assert not due(True, False, 100.0, 100.0 + SPARE_AFTER - 0.1), "they would compete with the restore"
    assert not due(True, True, 100.0, 200.0), "one set of spares at a time"
    assert not due(True, False, None, 200.0), "no spares while no workers run"
    assert not due(False, False, 100.0, 200.0)


def test_spares_are_off_unless_asked_for() -> None:
    assert not spares_enabled({})
    assert not spares_enabled({ENV_SPARE_WORKERS: "0"})
    assert spares_enabled({ENV_SPARE_WORKERS: "1"}) and spares_enabled({ENV_SPARE_WORKERS: " True "})


def test_nothing_to_take_or_close_without_spares() -> None:
    spares = Spares(enabled=True)
    spares.running()
    spares.stopped()
    assert spares.take({0: {"RANK": "0"}}) is None
    assert spares.pids() == []
    spares.close()
