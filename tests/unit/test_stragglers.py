"""The fail-slow detector (``lighthouse.stragglers``) on step traces: each replica's steps go through the window
the runtime keeps (``fthsdp.runtime.pace``), its reports into the lighthouse's history, and ``assess`` runs after
every step, as the status does. No network."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable

import pytest

from fthsdp.runtime.commit import Tally
from fthsdp.runtime.pace import PaceWindow
from lighthouse import membership as m
from lighthouse.ejection import HELD_OUT, held_out
from lighthouse.events import DeathCause, Died
from lighthouse.server import status
from lighthouse.stragglers import KEEP, Pace, Straggler, assess, remember, valid
from lighthouse.v1 import lighthouse_pb2 as pb

FACTOR, CONFIRM = 1.5, 3

# (step, replica) -> that replica's compute time for the step, before noise.
Speed = Callable[[int, int], float]


def _run(speed: Speed, replicas: int = 3, steps: int = 300, jitter: float = 0.3, spikes: float = 0.02,
         seed: int = 0) -> list[tuple[int, tuple[Straggler, ...]]]:
    """Synchronous steps: each replica computes (its speed, +-jitter, and now and then a spike of 3x), the step
    ends when the slowest is done, so each waits the difference. Returns (step, stragglers) after every step."""
    rng = random.Random(seed)
    windows = [PaceWindow() for _ in range(replicas)]
    histories: dict[str, tuple[Pace, ...]] = {f"r{i}": () for i in range(replicas)}
    out = []
    for step in range(steps):
        compute = [speed(step, i) * (1 + rng.uniform(-jitter, jitter)) * (3 if rng.random() < spikes else 1)
                   for i in range(replicas)]
        slowest = max(compute)
        for i, c in enumerate(compute):
            pace = windows[i].add(step, c, slowest - c + 0.002)
            if pace is not None:
                histories[f"r{i}"] = remember(histories[f"r{i}"], pace)
        out.append((step, assess(histories, FACTOR, CONFIRM)))
    return out


def _flags(trace: list[tuple[int, tuple[Straggler, ...]]]) -> list[tuple[int, str]]:
    return [(step, s.replica_id) for step, found in trace for s in found]


@pytest.mark.parametrize("seed", range(10))
def test_a_healthy_run_that_only_jitters_raises_no_flag(seed: int) -> None:
    """+-30% jitter on every step and a 3x spike on one step in fifty: never a straggler."""
    assert _flags(_run(lambda step, i: 0.1, seed=seed)) == []


@pytest.mark.parametrize("replicas", [2, 3, 8])
def test_one_replica_twice_as_slow_is_named_within_ten_steps(replicas: int) -> None:
    start = 100
    trace = _run(lambda step, i: 0.2 if i == 1 and step >= start else 0.1, replicas=replicas)
    flags = _flags(trace)
    assert flags and {rid for _, rid in flags} == {"r1"}
    first = flags[0][0]
    assert start <= first < start + 10, first
    found = dict(trace)[start + 20][0]
    assert found.replica_id == "r1" and found.slowdown == pytest.approx(2.0, rel=0.25)
    assert found.others_wait_s == pytest.approx(0.1, abs=0.07)  # what it costs each of the others per step
    assert found.since_step >= start and found.reports >= CONFIRM
    assert "r1 is" in found.text() and "slower" in found.text()


def test_a_replica_slow_for_three_steps_in_seven_is_never_named() -> None:
    """Flapping: slow 3 steps, then healthy 4, over and over: each window's median is healthy."""
    assert _flags(_run(lambda step, i: 0.25 if i == 2 and step % 7 < 3 else 0.1, jitter=0.1, spikes=0.0)) == []


def test_a_straggler_that_recovers_is_no_longer_named() -> None:
    trace = _run(lambda step, i: 0.2 if i == 0 and 50 <= step < 120 else 0.1)
    assert any(s.replica_id == "r0" for s in dict(trace)[100])
    assert all(found == () for step, found in trace if step >= 130)


def test_everyone_slower_together_is_no_straggler() -> None:
    """A slowdown of the whole job (a shared filesystem, the network) names nobody."""
    assert _flags(_run(lambda step, i: 0.3 if step >= 100 else 0.1)) == []


def test_a_replica_that_computes_longer_while_nobody_waits_is_not_named() -> None:
    slow = tuple(Pace(s, 0.3, 0.0) for s in range(10, 14))
    others = tuple(Pace(s, 0.1, 0.0) for s in range(10, 14))
    assert assess({"a": slow, "b": others, "c": others}, FACTOR, CONFIRM) == ()
    waited = tuple(Pace(s, 0.1, 0.2) for s in range(10, 14))
    assert [s.replica_id for s in assess({"a": slow, "b": waited, "c": waited}, FACTOR, CONFIRM)] == ["a"]


def test_a_replica_slower_by_a_few_milliseconds_is_not_named() -> None:
    """Seen in chaos runs of the tiny model before its compute was padded: steps of 20-60 ms on a busy host, one
    replica 1.5-1.8x "slower" by 10-30 ms, and the others "waiting" on it: noise that costs little."""
    slow = tuple(Pace(s, 0.058, 0.01) for s in range(270, 281))
    fast = tuple(Pace(s, 0.0316, 0.017) for s in range(270, 281))
    slower = tuple(Pace(s, 0.0316 + 0.06, 0.01) for s in range(270, 281))
    assert [x.replica_id for x in assess({"a": slower, "b": fast, "c": fast}, FACTOR, CONFIRM)] == ["a"]
    assert assess({"a": slow, "b": fast, "c": fast}, FACTOR, CONFIRM) == ()


def test_too_few_reports_or_members_name_nobody() -> None:
    slow = tuple(Pace(s, 0.3, 0.0) for s in range(10, 10 + CONFIRM - 1))
    fast = tuple(Pace(s, 0.1, 0.2) for s in range(10, 14))
    assert assess({"a": slow, "b": fast}, FACTOR, CONFIRM) == ()  # not confirmed yet
    assert assess({"a": slow + (Pace(20, 0.3, 0.0),), "b": fast}, FACTOR, CONFIRM)  # now it is
    assert assess({"a": fast}, FACTOR, CONFIRM) == ()
    assert assess({}, FACTOR, CONFIRM) == ()
    with pytest.raises(ValueError):
        assess({"a": fast}, 1.0, CONFIRM)


def test_remember_keeps_distinct_newer_steps_only() -> None:
    h: tuple[Pace, ...] = ()
    for s in range(20):
        h = remember(remember(h, Pace(s, 0.1, 0.0)), Pace(s, 0.5, 0.0))  # a heartbeat repeats the latest
    assert [p.step for p in h] == list(range(20 - KEEP, 20)) and all(p.compute_s == 0.1 for p in h)
    assert remember(h, Pace(3, 0.1, 0.0)) == (Pace(3, 0.1, 0.0),)  # an older step: a new history


@pytest.mark.parametrize("bad", [Pace(1, math.nan, 0.0), Pace(1, 0.1, -1.0), Pace(1, math.inf, 0.0),
                                 Pace(1, 0.1, 1e9), Pace(-1, 0.1, 0.1), Pace(1, 0.1, 0.1, -1),
                                 Pace(1, 0.1, 0.1, 1 << 20), Pace(1, 0.1, 0.1, 0, math.nan),
                                 Pace(1, 0.1, 0.1, 0, 0.1, -0.1)])
def test_malformed_reports_are_refused(bad: Pace) -> None:
    assert not valid(bad)
    assert valid(Pace(1, 0.1, 0.0))


def test_the_window_reports_medians_once_full() -> None:
    w = PaceWindow(size=3)
    assert w.add(1, 0.1, 0.5) is None and w.add(2, 9.0, 0.5) is None  # one outlier...
    assert w.add(3, 0.2, 0.0) == Pace(3, 0.2, 0.5)  # ...counts for nothing
    w = PaceWindow(size=3)
    w.add(1, 0.3, 0.0, (10, 200, 30))
    w.add(2, 0.3, 0.0, (90, 50, 20))  # one step another rank was busiest...
    assert w.add(3, 0.3, 0.0, (20, 300, 40)) == Pace(3, 0.3, 0.0, 1, 0.2, 0.025)  # ...each rank's median counts
    w = PaceWindow(size=2)
    w.add(1, 0.3, 0.0, (10, 200))
    assert w.add(2, 0.3, 0.0, ()) == Pace(2, 0.3, 0.0)  # not known every step: no rank


def _rank_run(slow_rank: int | None, ranks: int = 2, start: int = 100,
              seed: int = 5) -> list[tuple[int, tuple[Straggler, ...]]]:
    """Three replicas of ``ranks`` ranks, synchronous; from ``start`` replica r1 computes twice as long, because
    its rank ``slow_rank`` is busy twice as long (its siblings wait for it in their collectives, burning nothing),
    or, ``slow_rank`` None, every rank of it is (a slow host). Busy times jitter +-20% (ranks doing the same work);
    the replica's vote carries them all (``Tally``)."""
    rng = random.Random(seed)
    windows = [PaceWindow() for _ in range(3)]
    histories: dict[str, tuple[Pace, ...]] = {f"r{i}": () for i in range(3)}
    out = []
    for step in range(300):
        busy = [[0.1 * (1 + rng.uniform(-0.2, 0.2)) for _ in range(ranks)] for _ in range(3)]
        if step >= start:
            busy[1] = [b * 2 if slow_rank in (None, k) else b for k, b in enumerate(busy[1])]
        compute = [max(b) for b in busy]
        for i, c in enumerate(compute):
            tally = Tally(False, 1, 1, step, step, False, busy_ms=tuple(round(b * 1e3) for b in busy[i]))
            pace = windows[i].add(step, c, max(compute) - c + 0.002, tally.busy_ms)
            if pace is not None:
                histories[f"r{i}"] = remember(histories[f"r{i}"], pace)
        out.append((step, assess(histories, FACTOR, CONFIRM)))
    return out


@pytest.mark.parametrize("ranks", [2, 4, 8])
@pytest.mark.parametrize("seed", range(4))
def test_the_rank_a_straggler_slowness_comes_from_is_named_and_no_rank_of_a_slow_host(ranks: int, seed: int) -> None:
    trace = _rank_run(slow_rank=ranks - 1, ranks=ranks, seed=seed)
    assert all(not found for step, found in trace if step < 100)
    named = [(step, found[0]) for step, found in trace if found]
    assert named and all(x.replica_id == "r1" and x.rank in (None, ranks - 1) for _, x in named)
    with_rank = [(step, x) for step, x in named if x.rank is not None]
    assert with_rank and with_rank[0][0] <= 110 and all(x.rank_busy_ratio >= FACTOR for _, x in with_rank)
    assert f"r1 (rank {ranks - 1}: " in with_rank[0][1].text()
    host = [found[0] for step, found in _rank_run(slow_rank=None, ranks=ranks, seed=seed) if found]
    assert host and all(x.replica_id == "r1" and x.rank is None for x in host)
    assert "(rank" not in host[0].text()


def test_a_rank_busier_than_its_siblings_by_a_few_milliseconds_is_not_the_one() -> None:
    """Its busy time over its siblings' (the median of the others') must be ``factor`` and ``MIN_EXCESS_S``."""
    assert Pace(1, 0.03, 0.0, 1, 0.03, 0.01).slow_rank(FACTOR) is None  # 3x, but 20 ms: a busy host's jitter
    assert Pace(1, 0.3, 0.0, 1, 0.3, 0.1).slow_rank(FACTOR) == 1
    assert Pace(1, 0.3, 0.0, 1, 0.3, 0.25).slow_rank(FACTOR) is None


def _state(*ids: str, joining: str = "") -> m.State:
    members = {rid: m.Member(rid, f"i-{rid}", 1, m.Endpoints(), m.JOINING if rid == joining else m.ACTIVE, True,
                             registered_at=0.0) for rid in ids}
    epoch = m.Epoch(1, tuple(m.EpochMember(rid, f"i-{rid}", members[rid].role, 1, m.Endpoints()) for rid in ids),
                    0.0, "test")
    return m.State(members=members, epoch=epoch, last_number=1, history=(epoch,))


def test_the_status_names_stragglers_among_the_active_members_only() -> None:
    slow = tuple(Pace(s, 0.3, 0.0) for s in range(10, 14))
    fast = tuple(Pace(s, 0.1, 0.2) for s in range(10, 14))
    leader = status.Leader(True, "lh:1", "lh:1")

    def build(state: m.State, paces: dict[str, tuple[str, tuple[Pace, ...]]]) -> status.StatusView:
        return status.build("job", state, last_seen={}, steps={}, rendezvous="", policy=m.Policy(), leader=leader,
                            now=1.0, paces=paces)

    view = build(_state("a", "b", "c"), {"a": ("i-a", slow), "b": ("i-b", fast), "c": ("i-c", fast)})
    doc = status.to_json(view)
    assert [x["replica_id"] for x in doc["stragglers"]] == ["a"] and doc["stragglers"][0]["slowdown"] == 3.0
    assert doc["members"][0]["pace"] == {"step": 13, "compute_s": 0.3, "wait_s": 0.0, "busiest_rank": 0,
                                         "busiest_s": 0.0, "siblings_busy_s": 0.0, "lane_wait_s": []}
    assert doc["stragglers"][0]["rank"] is None
    answer = status.to_pb(view, pb.Epoch(job_id="job", number=1))
    assert [(s.replica_id, s.since_step) for s in answer.stragglers] == [("a", 10)]
    assert answer.members[0].pace_step == 13 and answer.members[0].compute_s == pytest.approx(0.3)
    # A joiner's (it exchanges zeros) and an earlier incarnation's reports count for nothing.
    assert build(_state("a", "b", "c", joining="a"),
                 {"a": ("i-a", slow), "b": ("i-b", fast), "c": ("i-c", fast)}).stragglers == ()
    assert build(_state("a", "b", "c"), {"a": ("old", slow), "b": ("i-b", fast), "c": ("i-c", fast)}).stragglers == ()


# --- the eject policy (lighthouse.ejection) -------------------------------------------------------------------

P = m.Policy(min_replicas=1, heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0, confirm_age_s=1.0)


def _booted(ids: list[str], policy: m.Policy = P) -> m.State:
    boot = dataclasses.replace(policy, expected_replicas=len(ids))
    state = m.State()
    for rid in ids:
        out = m.decide(state, m.Register(rid, f"{rid}-inc1", 1, m.Endpoints(), 0.0), boot)
        assert out.rejection is None
        state = out.state
    assert state.epoch is not None and len(state.epoch.members) == len(ids)
    return state


def _eject(state: m.State, rid: str, slowdown: float = 2.0, policy: m.Policy = P, inc: str = "") -> m.Outcome:
    return m.decide(state, m.Eject(rid, inc or f"{rid}-inc1", 10.0, slowdown, 0.12, 40), policy)


def test_an_ejected_straggler_leaves_the_epoch_as_a_failure_with_its_evidence() -> None:
    state = _booted(["a", "b", "c"])
    out = _eject(state, "b")
    assert out.rejection is None and out.state.epoch is not None
    assert out.state.epoch.replica_ids() == ("a", "c") and out.state.epoch.number == state.epoch.number + 1
    died = out.state.epoch.events[0]
    assert isinstance(died, Died) and died.cause == DeathCause.SLOW and died.kind == "failure"
    assert "replica b ejected (slow: 2.00x the others' compute since step 40; they waited 0.120s" in \
        out.state.epoch.reason
    # Its incarnation is over: every call of it is refused from now on; the next incarnation comes back.
    assert m.check_incarnation(out.state, "b", "b-inc1") is not None
    assert m.decide(out.state, m.Register("b", "b-inc2", 1, m.Endpoints(), 11.0), P).rejection is None


@pytest.mark.parametrize("slowdown,replicas,wins", [(1.4, 3, False), (1.6, 3, True), (1.9, 2, False),
                                                    (2.1, 2, True), (1.2, 8, True), (1.1, 8, False)])
def test_ejecting_happens_only_when_it_wins(slowdown: float, replicas: int, wins: bool) -> None:
    """N - 1 replicas at full speed beat N at the straggler's pace when slowdown > N / (N - 1)."""
    ids = [f"r{i}" for i in range(replicas)]
    out = _eject(_booted(ids), "r1", slowdown)
    assert (out.rejection is None) is wins
    if not wins:
        assert out.rejection is not None and "would not win" in out.rejection.message


def test_never_below_min_replicas_and_never_a_stale_incarnation_or_a_joiner() -> None:
    guarded = dataclasses.replace(P, min_replicas=3)
    state = _booted(["a", "b", "c"], guarded)
    out = _eject(state, "b", 3.0, guarded)
    assert out.rejection is not None and "min_replicas" in out.rejection.message and out.state is state
    state = _booted(["a", "b", "c"])
    assert _eject(state, "b", inc="b-old").rejection is not None
    assert _eject(state, "ghost").rejection is not None
    joined = m.decide(state, m.Register("d", "d-inc1", 1, m.Endpoints(), 1.0), P).state  # joining, not in the plane
    out = _eject(joined, "d", 5.0)
    assert out.rejection is not None and "not an active member" in out.rejection.message


def test_a_replica_ejected_as_slow_is_held_out_until_its_probe_is_healthy() -> None:
    others = [0.1, 0.12, 0.11]
    assert held_out(0.0, others, 1.5) is not None and "send a probe" in str(held_out(0.0, others, 1.5))
    assert str(held_out(0.3, others, 1.5)).startswith(HELD_OUT)  # still 2.7x slower
    assert held_out(0.13, others, 1.5) is None  # healthy again
    assert held_out(0.0, [], 1.5) is None  # nobody to compare with: it may come back
