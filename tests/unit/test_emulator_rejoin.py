"""The emulator's restart of a killed replica (what ``fthsdp bench lighthouse`` measures as a rejoin), and its
registration-first start, against a real lighthouse on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from fthsdp.bench.emulate import Emulator
from fthsdp.bench.lighthouse import auto_interval
from lighthouse import membership as m
from tests.helpers.lighthouse import ServerThread


def test_a_killed_replica_comes_back_as_a_new_incarnation_and_turns_active(
        start_server: Callable[..., ServerThread]) -> None:
    policy = m.Policy(min_replicas=1, expected_replicas=4, heartbeat_interval_s=0.1, heartbeat_timeout_s=2.0,
                      confirm_age_s=0.3)
    s = start_server(policy)

    async def scenario() -> None:
        emu = Emulator(s.addr, 4, prefix="rj")
        try:
            await emu.start(sessions_after=True)
            assert await emu.wait_all_have(lambda e: len(e.members) == 4, timeout=10)
            victim, reporter = emu.replicas[-1], emu.replicas[0]
            old_incarnation = victim.client.incarnation
            before = reporter.epoch.number  # type: ignore[union-attr]
            await emu.kill(victim)
            await emu.report(reporter, victim)
            assert await emu.wait_all_have(
                lambda e: e.number > before and e.member(victim.replica_id) is None, timeout=5)
            back = await emu.restart(victim)
            assert back.replica_id == victim.replica_id and back.client.incarnation != old_incarnation
            assert back in emu.replicas and victim not in emu.replicas

            def active(e: object) -> bool:
                x = e.member(back.replica_id)  # type: ignore[attr-defined]
                return x is not None and x.incarnation == back.client.incarnation and x.role == m.ACTIVE

            assert await emu.wait_all_have(active, timeout=10)
            assert len(emu.alive()) == 4
        finally:
            await emu.close()

    asyncio.run(scenario())


def test_auto_interval_keeps_heartbeats_within_the_budget() -> None:
    assert auto_interval(100) == 1.0
    assert auto_interval(1000) == 1.0
    assert auto_interval(5000) == 5.0
    assert 5000 / auto_interval(5000) <= 1000


def test_a_replica_declared_dead_while_alive_comes_back_as_a_new_incarnation(
        start_server: Callable[..., ServerThread]) -> None:
    """The lighthouse never takes a finished incarnation back: an emulated replica whose incarnation is replaced
    behind its back (as when it was declared dead while hung) restarts as a new one, as a real group would."""
    policy = m.Policy(min_replicas=1, heartbeat_interval_s=0.1, heartbeat_timeout_s=2.0, confirm_age_s=0.3)
    s = start_server(policy)

    async def scenario() -> None:
        emu = Emulator(s.addr, 3, prefix="dd")
        try:
            await emu.start()
            assert await emu.wait_all_have(lambda e: len(e.members) == 3, timeout=10)
            victim = emu.replicas[0]
            first = victim.client.incarnation
            # Another incarnation registers under its id: the victim's incarnation is over (replaced).
            impostor = Emulator(s.addr, 1, prefix="dd")
            await impostor.replicas[0].client.register()
            taken = impostor.replicas[0].client.incarnation
            await impostor.replicas[0].client.close()

            def back(e: object) -> bool:
                x = e.member(victim.replica_id)  # type: ignore[attr-defined]
                return x is not None and x.incarnation not in (first, taken) and x.role == m.ACTIVE

            assert await emu.wait_all_have(back, timeout=15)
            assert len(emu.alive()) == 3
        finally:
            await emu.close()

    asyncio.run(scenario())
