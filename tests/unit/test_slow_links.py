"""The slow-link detector (``lighthouse.stragglers.assess_links``) on simulated lanes: every replica's ranks compute,
each lane's collective starts when its last member arrives (a slow link's member arrives late by its delay), every
member's time inside it goes through the window the runtime keeps (``fthsdp.runtime.pace``) into the lighthouse's
history, and the detector runs after every step, as the status does. No network."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from fthsdp.runtime.commit import Ballot, CommitProtocol, Exchanged, Tally
from fthsdp.runtime.pace import PaceWindow, medians
from lighthouse.stragglers import (
    MAX_LANES,
    MIN_EXCESS_S,
    Pace,
    SlowLink,
    assess,
    assess_links,
    pack_lanes,
    remember,
    unpack_lanes,
)

CONFIRM, FACTOR = 3, 1.5
TRANSFER_S = 0.004

# (step, replica, rank) -> seconds: a rank's compute, or its lane's delay before each collective.
Timing = Callable[[int, int, int], float]


def _run(compute: Timing, delay: Timing, replicas: int = 3, ranks: int = 2, steps: int = 120, jitter: float = 0.3,
         seed: int = 0, every: int = 1) -> tuple[list[tuple[int, tuple[SlowLink, ...]]], list[tuple[int, list[str]]]]:
    """Synchronous steps: a replica's ranks wait for each other (FSDP2's collectives inside it), so each hands its
    buckets at its slowest rank's time; lane k's collective starts when its last member arrives (its compute plus
    its link's delay) and each member spends from its own arrival to the end inside it. Returns (step, slow links)
    and (step, stragglers) after every step. ``every``: the lighthouse hears replica i's report only at steps where
    ``(step + i) % every == 0``."""
    rng = random.Random(seed)
    windows = [PaceWindow() for _ in range(replicas)]
    histories: dict[str, tuple[Pace, ...]] = {f"r{i}": () for i in range(replicas)}
    links, slow = [], []
    for step in range(steps):
        done = [max(compute(step, i, k) * (1 + rng.uniform(-jitter, jitter)) for k in range(ranks))
                for i in range(replicas)]
        arrive = [[done[i] + delay(step, i, k) for k in range(ranks)] for i in range(replicas)]
        end = [max(arrive[i][k] for i in range(replicas)) + TRANSFER_S for k in range(ranks)]
        for i in range(replicas):
            inside = tuple(round((end[k] - arrive[i][k]) * 1e3) for k in range(ranks))
            wait = max(end) - done[i]
            pace = windows[i].add(step, done[i], wait, tuple(round(done[i] * 1e3) for _ in range(ranks)), inside)
            if pace is not None and (step + i) % every == 0:
                histories[f"r{i}"] = remember(histories[f"r{i}"], pace)
        links.append((step, assess_links(histories, CONFIRM)))
        slow.append((step, [s.replica_id for s in assess(histories, FACTOR, CONFIRM)]))
    return links, slow


def _named(trace: list[tuple[int, tuple[SlowLink, ...]]]) -> list[tuple[int, str, int]]:
    return [(step, x.replica_id, x.rank) for step, found in trace for x in found]


@pytest.mark.parametrize("seed", range(6))
def test_lanes_that_only_jitter_name_no_link(seed: int) -> None:
    """+-30% jitter in every rank's compute: the last to arrive changes step to step, no link is named."""
    links, _ = _run(lambda step, i, k: 0.1, lambda step, i, k: 0.0, seed=seed)
    assert _named(links) == []


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_slow_link_is_named_with_its_rank_within_ten_steps_and_nobody_before(ranks: int) -> None:
    """Rank ``ranks - 1`` of replica 1 sends 0.1 s late from step 50, its compute on time: that lane of that replica
    is named within ten steps (the pace window and the confirmations), no other, and nothing before; it is no
    straggler."""
    slow_rank = ranks - 1
    links, slow = _run(lambda step, i, k: 0.1,
                       lambda step, i, k: 0.1 if step >= 50 and (i, k) == (1, slow_rank) else 0.0, ranks=ranks)
    named = _named(links)
    assert named, "the slow link was never named"
    assert all((rid, rank) == ("r1", slow_rank) for _, rid, rank in named), named
    assert 50 <= named[0][0] < 60, f"named at step {named[0][0]}"
    found = next(found for _, found in links if found)[0]
    assert found.others_wait_s >= MIN_EXCESS_S and found.own_wait_s < found.others_wait_s and found.since_step >= 50
    assert "r1 rank" in found.text() and "link is slow" in found.text()
    assert all(names == [] for _, names in slow)


def test_one_rank_replicas_name_no_link() -> None:
    """With one lane a replica's late link and late compute look alike in lane times: nothing is named."""
    links, _ = _run(lambda step, i, k: 0.1, lambda step, i, k: 0.1 if step >= 50 and i == 1 else 0.0, ranks=1)
    assert _named(links) == []


@pytest.mark.parametrize("every", [1, 3])
def test_a_slow_replica_is_a_straggler_not_a_slow_link(every: int) -> None:
    """Replica 2 computes 3x as long from step 50: it arrives last on every lane alike, so no lane stands out: it is
    named a straggler, never a slow link. Also when the lighthouse hears each replica's report only every third
    step, at different steps (heartbeats): compared across replicas, such windows made the slowdown's first steps
    look like a slow link."""
    links, slow = _run(lambda step, i, k: 0.3 if step >= 50 and i == 2 else 0.1, lambda step, i, k: 0.0,
                       every=every)
    assert _named(links) == []
    assert any(names == ["r2"] for _, names in slow)


def test_a_slow_rank_inside_a_replica_is_no_slow_link() -> None:
    """Rank 1 of replica 0 computes 3x as long: its siblings wait for it inside the replica, so every lane of it
    arrives late by its compute, which explains it."""
    links, _ = _run(lambda step, i, k: 0.3 if step >= 50 and (i, k) == (0, 1) else 0.1, lambda step, i, k: 0.0)
    assert _named(links) == []


def test_too_little_evidence_names_nothing() -> None:
    late = Pace(5, 0.1, 0.0, lane_wait_s=(0.01, 0.001))  # its lane 1 arrives last
    waits = Pace(5, 0.1, 0.2, lane_wait_s=(0.01, 0.2))  # waits on lane 1
    assert [(x.replica_id, x.rank) for x in assess_links({"a": (late,) * 3, "b": (waits,) * 3}, CONFIRM)] == \
        [("a", 1)]
    assert assess_links({"a": (late,) * 3}, CONFIRM) == ()  # one member: nothing to compare with
    assert assess_links({"a": (late,) * 3, "b": (waits,) * 2}, CONFIRM) == ()  # fewer reports than confirm
    assert assess_links({"a": (late,) * 3, "b": (waits,) * 3, "c": (late,) * 3}, CONFIRM) == ()  # who is it?
    assert assess_links({"a": (Pace(5, 0.1, 0.2),) * 3, "b": (Pace(5, 0.1, 0.2),) * 3}, CONFIRM) == ()  # no lanes
    with pytest.raises(ValueError):
        assess_links({}, 0)


def test_the_vote_carries_every_rank_lane_time_and_the_window_its_medians() -> None:
    """A rank's ballot sums its buckets' time inside their collectives; the tally has every rank's column; the
    pace window reports their medians per rank."""
    protocol = CommitProtocol()
    protocol.begin()
    for seconds in (0.0125, 0.0301):
        protocol.lane(Exchanged(3, 7, seconds))
    ballot = protocol.ballot(busy_ms=9, rank=1, ranks=2)
    assert ballot.lane_ms == 43 and ballot.busy_ms == 9
    tally = Tally.of([ballot, Ballot(False, 3, 3, 7, False, busy_ms=11, rank=0, ranks=2, lane_ms=5)])
    assert tally.busy_ms == (11, 9) and tally.lane_ms == (5, 43) and tally.passed
    with pytest.raises(ValueError):
        Tally.decode([0, 3, -3, 7, -7, 0, 0, 0, 1, 2, 3])  # per-rank columns are two halves
    window = PaceWindow(size=3)
    for step, lanes in enumerate([(5, 40), (7, 43), (6, 90)]):
        pace = window.add(step, 0.1, 0.05, (10, 10), lanes)
    assert pace is not None and pace.lane_wait_s == (0.006, 0.043)
    assert medians([(1, 2), (3,)]) == () and medians([]) == ()


def test_lane_times_travel_as_two_bytes_a_rank() -> None:
    """The paper's replica of 8,192 ranks fits a heartbeat (64 KiB) with 16 KiB of lane times; a time is rounded to
    the millisecond and capped at 65.535 s; an odd length or too many ranks is malformed."""
    assert unpack_lanes(pack_lanes((0.0014, 0.25, 99.0, -1.0))) == (0.001, 0.25, 65.535, 0.0)
    assert len(pack_lanes([0.1] * 8192)) == 16 * 1024 and unpack_lanes(b"") == ()
    assert unpack_lanes(b"\x01") is None and unpack_lanes(b"\x00" * (2 * MAX_LANES + 2)) is None


def test_each_lanes_baseline_is_the_median_of_the_other_lanes() -> None:
    """The baselines come from one sort; they equal the plain median of the others, ties and even counts included."""
    import statistics

    from lighthouse.stragglers import _others_medians

    rng = random.Random(3)
    for n in range(2, 10):
        for _ in range(100):
            lanes = tuple(rng.choice((0.1, 0.2, rng.random())) for _ in range(n))
            want = tuple(statistics.median(w for j, w in enumerate(lanes) if j != k) for k in range(n))
            assert _others_medians(lanes) == want, lanes
