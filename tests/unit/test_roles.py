"""A replica's roles (``fthsdp.runtime.roles``): each takes a step on the step core and names the next role; only
``Active`` trains a batch. The steps themselves (catch-up, zero step, spare step) are stubbed: what is checked here
is who comes next, and that the role that trains none never runs as if it did."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from ftar.membership import EpochFeed
from fthsdp.runtime import catching_up, iteration, roles, spares
from fthsdp.runtime.errors import JobFinished
from fthsdp.runtime.result import StepResult
from fthsdp.runtime.standing import Standing
from fthsdp.runtime.startup import Role as Given
from fthsdp.runtime.timeline import Timeline
from lighthouse.epoch_view import EpochView
from lighthouse.model import ACTIVE, NO_SLOT, Endpoints, EpochMember


def result(step: int) -> StepResult:
    return StepResult(step, None, 1, 2, False, 1, 0.0, (), 1.0)


@dataclass
class FakeCore:
    """What the roles use of the step core: its slot, step, settings and joiner."""

    slot: int = 0
    step: int = 5
    standing: Standing = Standing.JOINING
    config: Any = field(default_factory=lambda: type("C", (), {"job_id": "j", "join_warmup": True,
                                                                "carry_orphans": False})())
    joiner: Any = field(default_factory=lambda: type("J", (), {"warmed": False, "announced": False})())


@pytest.mark.parametrize(("given", "slot", "role"), [
    (Given.ACTIVE, 0, roles.Active), (Given.ACTIVE, NO_SLOT, roles.Spare), (Given.RESUME, 1, roles.Active),
    (Given.JOINING, 1, roles.Joining), (Given.JOINING, NO_SLOT, roles.Joining), (Given.FINISHED, 0, roles.Finished)])
def test_the_role_a_registration_gives(given: Given, slot: int, role: type[roles.Role]) -> None:
    assert type(roles.given(given, slot)) is role


def test_a_spare_the_job_starts_with_does_not_warm_up_and_one_back_from_a_catch_up_does() -> None:
    """A spare registered with the job's first epoch is a member at once: every member's first exchange waits for
    it, and a warm-up iteration first made it late by more than the rendezvous timeout on a loaded host (CI: the
    others re-formed twice and the spare, alone blaming all three, was evicted). One made by a catch-up warmed up
    as a joiner; one made any other way warms up first."""
    core = FakeCore(slot=NO_SLOT)
    first = roles.given(Given.ACTIVE, NO_SLOT)
    assert isinstance(first, roles.Spare) and first.loop_warm_up(core) is None  # type: ignore[arg-type]
    assert roles.Spare().loop_warm_up(core) is False  # type: ignore[arg-type]


def test_what_each_role_is_to_the_step_core_and_only_active_trains() -> None:
    zeros: list[Any] = []
    table = {r.__class__.__name__: (r.standing, r.trains) for r in
             (roles.Standby(), roles.Joining(), roles.CaughtUp(zeros), roles.Spare(), roles.Active(), roles.Finished())}
    assert table == {"Standby": (Standing.STANDBY, False), "Joining": (Standing.JOINING, False),
                     "CaughtUp": (Standing.MEMBER, False), "Spare": (Standing.MEMBER, False),
                     "Active": (Standing.MEMBER, True), "Finished": (Standing.FINISHED, False)}


def test_a_joiner_is_caught_up_with_its_zeros_in_flight_then_active_or_spare(monkeypatch: pytest.MonkeyPatch) -> None:
    zeros: list[Any] = [None, None]

    monkeypatch.setattr(catching_up, "catch_up", lambda core, closure: (result(7), zeros))
    monkeypatch.setattr(catching_up, "zero_step", lambda core, z: result(8) if z is zeros else None)
    for slot, after in ((2, roles.Active), (NO_SLOT, roles.Spare)):
        core = FakeCore(slot=slot)
        turn = roles.Joining().turn(core, None)  # type: ignore[arg-type]
        assert turn.result == result(7) and isinstance(turn.next, roles.CaughtUp) and turn.next.zeros is zeros
        turn = turn.next.turn(core, None)  # type: ignore[arg-type]
        assert turn.result == result(8) and type(turn.next) is after


def test_carrying_orphans_a_joiner_tells_the_lighthouse_it_is_active_only_after_its_zero_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An epoch that lists a replica active deals it its slot, and the others stop carrying it: told before its
    zero step (which trains nothing), the slot's batch of that step went untrained (seen in ``fthsdp demo
    --deterministic --kill 1@10:exchange --kill 2@22``: slots 1 and 2 ended 59 of 60)."""
    calls: list[str] = []

    def zero_step(core: FakeCore, zeros: object) -> StepResult:
        calls.append("zero step")
        return result(8)

    monkeypatch.setattr(catching_up, "zero_step", zero_step)
    core = FakeCore(slot=1)
    core.config.carry_orphans = True
    core.joiner.turn_active = lambda: calls.append("active")
    turn = roles.CaughtUp([None]).turn(core, None)  # type: ignore[arg-type]
    assert calls == ["zero step", "active"] and type(turn.next) is roles.Active
    core.config.carry_orphans = False  # without carrying the catch-up said so already
    calls.clear()
    roles.CaughtUp([None]).turn(core, None)  # type: ignore[arg-type]
    assert calls == ["zero step"]


def test_a_spare_stays_one_until_handed_a_slot_and_keeps_its_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    clocks: list[spares.Shadow] = []

    def spare_step(core: FakeCore, closure: object, shadow: spares.Shadow, warm_first: bool) -> StepResult | None:
        assert warm_first  # a spare made after the job's first epoch warms up first
        clocks.append(shadow)
        if len(clocks) == 3:  # handed over before the step's exchange: the loop trains this very step
            core.slot = 1
            return None
        return result(len(clocks))

    monkeypatch.setattr(spares, "spare_step", spare_step)
    spare = roles.Spare()
    core = FakeCore(slot=NO_SLOT)
    assert spare.turn(core, None) == roles.Turn(result(1), spare)  # type: ignore[arg-type]
    assert spare.turn(core, None) == roles.Turn(result(2), spare)  # type: ignore[arg-type]
    turn = spare.turn(core, None)  # type: ignore[arg-type]
    assert turn.result is None and isinstance(turn.next, roles.Active)
    assert clocks[0] is clocks[1] is clocks[2] is spare.shadow


def test_a_spares_step_holds_where_a_trainers_does() -> None:
    """``FTHSDP_FAULT_HOLD_UNTIL``: a spare's zero step waits before its digest and exchange, as a trainer's step
    does before its forward, so that a spare never waits inside an exchange for trainers held between steps."""
    seen: list[tuple[Any, ...]] = []

    class Reached(Exception):
        pass

    def digest(*_: object) -> None:
        seen.append(("digest",))
        raise Reached

    feed = EpochFeed()
    rep = SimpleNamespace(step=7, feed=feed, log=lambda *_: None, parts=lambda: (None, None),
                          faults=SimpleNamespace(hold=lambda step, f, log: seen.append(("hold", step, f))),
                          check=SimpleNamespace(digest=digest), cursors=(), world_size=1, device="cpu")
    with pytest.raises(Reached):
        spares.spare_step(rep, None, spares.Shadow(), warm_first=False)  # type: ignore[arg-type]
    assert seen == [("hold", 7, feed), ("digest",)]


def test_warm_ups_in_the_trainers_loop() -> None:
    """A standby and a spare warm up without an optimizer step; a joiner with one (its snapshot overwrites it),
    and not once it told the lighthouse it is ready; a warmed process and an active replica never."""
    core = FakeCore()
    assert roles.Standby().loop_warm_up(core) is False  # type: ignore[arg-type]
    assert roles.Spare().loop_warm_up(core) is False  # type: ignore[arg-type]
    assert roles.Joining().loop_warm_up(core) is True  # type: ignore[arg-type]
    assert roles.Active().loop_warm_up(core) is None  # type: ignore[arg-type]
    core.joiner.announced = True
    assert roles.Joining().loop_warm_up(core) is None  # type: ignore[arg-type]
    core.joiner.warmed = True
    assert {r.loop_warm_up(core) for r in (roles.Standby(), roles.Spare())} == {None}  # type: ignore[arg-type]


def test_finished_and_active_take_no_turn() -> None:
    core = FakeCore()
    with pytest.raises(JobFinished, match="finished at step 5"):
        roles.Finished().turn(core, None)  # type: ignore[arg-type]
    with pytest.raises(AssertionError, match="trains a batch"):
        roles.Active().turn(core, None)  # type: ignore[arg-type]


def test_the_feed_keeps_the_newest_epoch_published() -> None:
    """The replica's one place to read its epoch (``StepCore.feed``): an older epoch published late (a follower's
    relay racing rank 0's session) never replaces a newer one."""
    feed = EpochFeed()
    seen: list[int] = []
    feed.add_listener(lambda e: seen.append(e.number))
    assert feed.current() is None

    def epoch(number: int) -> EpochView:
        return EpochView("job", number, (EpochMember("r1", "inc", ACTIVE, 1, Endpoints(), 0),), "", 0.0, "")

    feed.publish(epoch(3))
    feed.publish(epoch(2))
    current = feed.current()
    assert current is not None and current.number == 3 and seen == [3, 2]


class Driver(iteration.Steps):
    """The drivers' ``become`` alone (nothing else of a replica)."""

    def __init__(self) -> None:  # noqa: D107 - no context: only the role bookkeeping runs
        self.standing, self.role = Standing.STANDBY, roles.Standby()
        self.calls: list[str] = []
        self.metrics = type("M", (), {"on_joining": lambda _, joining: self.calls.append(f"joining={joining}")})()
        self.timeline, self.step = Timeline(), 0

    def registered(self) -> None:
        self.calls.append("registered")


def test_a_standby_takes_its_place_once_when_it_leaves_its_role() -> None:
    """Released, a standby becomes what the lighthouse gave (its state's standing with it), and only then does the
    step core take its place and run what waited for the registration; later role changes do not again."""
    d = Driver()
    d.become(roles.Joining())
    assert d.standing is Standing.JOINING and d.joining and d.calls == ["joining=True", "registered"]
    d.become(roles.CaughtUp([]))
    d.become(roles.Active())
    assert d.standing is Standing.MEMBER and not d.joining and d.calls[2:] == ["joining=False", "joining=False"]
    # Every role taken is a mark on the rank's timeline (fthsdp trace).
    assert [e[2] for e in d.timeline.read()["events"]] == ["role joining", "role caughtup", "role active"]
