"""``fthsdp chaos --sim``: the control plane in a deterministic simulation (``fthsdp.chaos.sim``): the membership
protocol, FTAR's lanes and the commit protocol. A slice of seeds runs clean on both planes; each deliberately
broken variant is caught; a seed replays bit for bit; the checks fail on histories that break them; the bugs the
simulator found stay fixed (their seeds, docs/chaos.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from fthsdp.chaos.sim import checks
from fthsdp.chaos.sim.cluster import BLAME_ALL, FAULT_KINDS, PLANE_FAULT_KINDS, Exit, Fault, twice
from fthsdp.chaos.sim.lighthouse import Published
from fthsdp.chaos.sim.run import VARIANTS, Drawn, draw, run_drawn, run_one, simulate
from fthsdp.chaos.sim.trainer import grad

SLICE = {"lanes": 150, "membership": 400}
JOBS = min(2, os.cpu_count() or 1)
"""The slices run their seeds in this many processes (each run is a pure function of its seed: the same result,
``test_runs_shared_among_processes_give_the_same_result``), so that they cost the suite half the time on 2 cores."""


@pytest.mark.parametrize("plane", ["lanes", "membership"])
def test_a_slice_of_seeds_keeps_every_invariant_under_every_fault_kind(plane: str) -> None:
    out = simulate(0, SLICE[plane], plane=plane, jobs=JOBS)
    assert out["runs"] == SLICE[plane] and out["violations"] == 0, out["first_failing"]
    kinds = set(FAULT_KINDS) | (set(PLANE_FAULT_KINDS) if plane == "lanes" else set())
    assert set(out["faults_injected"]) == kinds  # every kind was drawn
    assert out["events"] > SLICE[plane] * 1000  # the runs did run


def test_with_a_spare_a_slice_of_seeds_keeps_every_invariant_and_dead_replicas_slots_are_handed_over() -> None:
    """``--sim-spares 1``: the lighthouse hands out the data slots (``lighthouse.slots``); the spare group takes a
    dead replica's slot and the replica, back, comes in as a spare. Exactly-once is checked on every commit (no
    slot contributes twice to a step) besides every other invariant. Seed 104: replica 1 is killed mid-exchange;
    the spare (r2) is handed its slot late and trains slot 1 from the step after, replica 1's next incarnation
    trains none. Seed 7: a hand-over early in a step, and the spare trains that very step."""
    out = simulate(0, 60, spares=1, jobs=JOBS)
    assert out["spares"] == 1 and out["violations"] == 0, out["first_failing"]
    r = run_one(104, trace=True, spares=1)
    assert r["violations"] == [] and r["spares"] == 1
    handed = [line for line in r["trace"] if "trains slot" in line]
    assert any("r2.1 trains slot 1" in line for line in handed), handed
    assert any("r1.2 trains slot -1" in line for line in handed), handed
    # Seed 7: the spare (r3) is handed slot 1 early in step 12 and trains that step's batch itself.
    r = run_one(7, trace=True, spares=1)
    assert r["violations"] == []
    assert [line.split(maxsplit=1)[1] for line in r["trace"] if "handed over early" in line] == \
        ["r3.1 step 12: slot 1 handed over early: training its batch"]
    with pytest.raises(ValueError, match="need the lanes"):
        simulate(0, 1, plane="membership", spares=1)
    assert twice(((3, 2, (0, 1)), (5, 2, (1, 1)))) == [(1, 1)] and twice(((3, 2, (0, 1)),)) == []


def test_with_orphan_slots_every_committed_step_trains_every_slots_batch_exactly_once() -> None:
    """``--sim-orphans`` (issue 38's constant global batch, ahead of the runtime): the slot holders train the
    micro-batches of the slots nobody holds (``fthsdp.runtime.orphans.deal``), and a contribution is exchanged only
    in a group whose epoch deals its member what it trained. Every committed step must train every part of every
    slot exactly once (``whole-batch``, ``exactly-once``) besides every other invariant, with or without a spare.
    Seed 0: replica 2 is killed mid-exchange of step 20; each of two survivors trains one of its slot's two
    micro-batches before the redo, the third carries nothing."""
    out = simulate(0, 30, jobs=JOBS, orphans=True)
    assert out["orphans"] and out["violations"] == 0, out["first_failing"]
    assert out["steps_carried"] > 30  # the runs did carry orphans
    out = simulate(0, 15, jobs=JOBS, orphans=True, spares=1)
    assert out["violations"] == 0, out["first_failing"]
    r = run_one(0, trace=True, orphans=True)
    assert r["violations"] == [] and r["steps_carried"] > 0
    redealt = [line.split(maxsplit=1)[1] for line in r["trace"] if "step 20: epoch" in line]
    assert redealt == ["r1.1 step 20: epoch 2 deals it parts [2, 3, 4] (it holds [2, 3]): training 1 part(s) first",
                       "r3.1 step 20: epoch 2 deals it parts [5, 6, 7] (it holds [6, 7]): training 1 part(s) first"]
    with pytest.raises(ValueError, match="need the lanes"):
        simulate(0, 1, plane="membership", orphans=True)


@pytest.mark.parametrize(("variant", "invariant", "runs", "plane"), [
    ("no-confirm", "only-failed-pays", 200, "membership"), ("reuse-epochs", "epochs", 200, "membership"),
    ("local-vote", "only-failed-pays", 120, "lanes"), ("unpinned-orphans", "exactly-once", 10, "lanes")])
def test_each_broken_variant_is_caught_and_its_seed_replays(variant: str, invariant: str, runs: int,
                                                            plane: str) -> None:
    out = simulate(0, runs, variant, plane=plane, jobs=JOBS)
    assert out["violations"] > 0 and invariant in out["by_invariant"], out
    seed = out["first_failing"][0]["seed"]
    again = run_one(seed, variant, trace=True, plane=plane)
    assert again["violations"][:5] == out["first_failing"][0]["violations"]
    assert run_one(seed, variant, trace=True, plane=plane)["trace"] == again["trace"]


def test_the_local_vote_variant_makes_a_survivor_rejoin_behind_its_partners() -> None:
    """Seed 84: a kill lands while a step's collectives complete at some lanes and not at others; the replica
    whose lanes split redoes the step while its partners committed it, and nobody serves it the step."""
    r = run_one(84, "local-vote", trace=True)
    assert any("this replica is behind the others" in v and "though no fault targeted it" in v
               for v in r["violations"]), r["violations"]
    assert run_one(84)["violations"] == []  # with step reconciliation the same schedule costs nobody anything
    assert any("served tags" in line for line in run_one(84, trace=True)["trace"])


def test_unknown_variant_or_plane_is_refused() -> None:
    with pytest.raises(ValueError, match="no-confirm"):
        run_one(0, "no-such-variant")
    with pytest.raises(ValueError, match="lanes"):
        run_one(0, plane="bytes")
    with pytest.raises(ValueError, match="needs the lanes"):
        run_one(0, "local-vote", plane="membership")
    with pytest.raises(ValueError, match="orphan slots need the lanes"):
        run_one(0, "unpinned-orphans", plane="membership")
    assert set(VARIANTS) == {"", "no-confirm", "reuse-epochs", "local-vote", "unpinned-orphans"}


def test_a_seed_replays_bit_for_bit_in_another_process_whatever_the_hash_seed() -> None:
    code = "import json; from fthsdp.chaos.sim.run import run_one; print(json.dumps(run_one(2244, trace=True)))"
    runs = [subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": h},
                           capture_output=True, text=True, timeout=60, check=True) for h in ("1", "2")]
    first, second = (json.loads(r.stdout) for r in runs)
    assert first == second and len(first["trace"]) > 20
    assert first == run_one(2244, trace=True)


@pytest.mark.parametrize("seed", [62, 159, 2244, 2490, 1695, 6017, 9358, 16820, 220115])
def test_the_seeds_that_found_bugs_in_the_membership_layer_run_clean(seed: int) -> None:
    """62, 159: a replica declared dead while hung or cut off came back after a lighthouse restart (departed not
    durable; the client claimed its role back after seeing itself dropped). 2244: a member dropped while the
    min-replicas guard held the epoch was restored from the stored epoch. 2490: a joiner's Ready(ACTIVE) before
    a restarted lighthouse's first epoch was refused for good. 6017, 9358, 16820: re-forms added up across
    unrelated incidents and a healthy replica was declared hung. 220115: under the min-replicas guard every tick
    counted as a re-form, on a dead reporter's blame. 1695: (the model) a registrant's watch stream."""
    r = run_one(seed, plane="membership")
    assert r["violations"] == [], r


@pytest.mark.parametrize("seed", [1463, 1550, 2218, 2482, 1429, 1007, 1002, 1003, 1011, 1030, 1608, 1076, 1386, 3365,
                                  6439])
def test_the_seeds_that_found_bugs_with_lanes_run_clean(seed: int) -> None:
    """1463, 1550, 2218, 2482: failure reports sent while the lighthouse restarted were lost and every member
    waited for an epoch nobody asked for (``ftar.rules.PendingReports``). 1429, 1007: the end-of-job barrier
    split across lanes (one lane completed it, another lost it), then a lane interrupted again after the vote had
    put its held epoch behind it waited for partner lanes that waited for it (the barrier through the vote;
    ``LaneState.place``). 1002, 1003, 1011, 1030: the min-replicas guard kept a member that had left the job
    finished in the epoch, holding the others' barrier (``lighthouse.membership``). 1608: a vote failed only because
    the lanes went in different epochs; nobody reported anything, and every lane waited for an epoch above the
    newest (``PendingReports.reform``). 1076, 1386, 3365, 6439: (the model and its checks) an answer for an older
    wait taken by a newer one; a restarted lighthouse's epoch 1 taken for the old one's; the steps a replica cut
    off from the lighthouse commits alone after it was dropped are not the job's; an in-memory store has no leader
    to lose."""
    r = run_one(seed)
    assert r["violations"] == [], r


def test_runs_shared_among_processes_give_the_same_result() -> None:
    alone, shared = simulate(80, 8), simulate(80, 8, jobs=2)
    assert shared["jobs"] == 2
    assert {k: v for k, v in alone.items() if k not in ("seconds", "jobs")} == \
        {k: v for k, v in shared.items() if k not in ("seconds", "jobs")}
    with pytest.raises(ValueError, match="at least 1"):
        simulate(0, 0)


def test_draw_is_a_pure_function_of_the_seed() -> None:
    assert draw(5) == draw(5) and draw(5) != draw(6)


# --- the checks fail on histories that break them --------------------------------------------------------------


def _ep(t: float, n: int, members: tuple[tuple[str, str, str], ...], life: int = 0) -> Published:
    return Published(t, n, members, life)


A, B = ("r0", "r0.1", "active"), ("r1", "r1.1", "active")


def test_epoch_checks() -> None:
    ok = [_ep(1, 1, (A, B)), _ep(2, 2, (A,))]
    assert checks.epochs_increase(ok, [True]) == []
    assert checks.epochs_increase([*ok, _ep(3, 2, (B,))], [True])  # reused for another membership, and not up
    # After an in-memory restart numbering starts a new chain; after a durable one it goes on.
    assert checks.epochs_increase([*ok, _ep(3, 1, (A,), life=1)], [True, False]) == []
    assert checks.epochs_increase([*ok, _ep(3, 1, (A,), life=1)], [True, True])
    assert checks.guard_holds(ok, 2) == ["epoch 2 at 2.000s has 1 member(s), below min_replicas 2, or no active one"]
    assert checks.guard_holds([_ep(1, 1, (("r0", "r0.1", "joining"),))], 1)


def test_state_checks() -> None:
    job = {0: "a", 1: "b"}
    at = {0: 1.0, 1: 2.0}

    def h(inc: str, steps: dict[int, str], died: bool = False, dropped: float | None = None) -> checks.History:
        return checks.History(inc, steps, at, died, dropped)
    assert checks.histories_agree([h("r0.1", job), h("r1.1", {0: "a"})], job) == []
    assert checks.histories_agree([h("r1.1", {0: "a", 1: "x"})], job)  # went on with another step 1
    assert checks.histories_agree([h("r1.1", {0: "a", 1: "x"}, died=True)], job) == []  # died right after it
    assert checks.histories_agree([h("r1.1", {0: "x", 1: "b"}, died=True)], job)  # not its last step
    assert checks.histories_agree([h("r1.1", {0: "a", 1: "x", 2: "y"}, died=True, dropped=1.5)], job) == []
    assert checks.histories_agree([h("r1.1", {0: "x", 1: "x", 2: "y"}, died=True, dropped=1.5)], job)
    assert checks.one_final_state({"r0.1": (2, 7), "r1.1": (2, 7)}, 2) == []
    assert checks.one_final_state({"r0.1": (2, 7), "r1.1": (2, 8)}, 2) == ["2 final states among ['r0.1', 'r1.1']"]
    assert checks.one_final_state({"r0.1": (1, 7)}, 2) == ["r0.1 finished at step 1, not 2"]
    assert checks.guard_holds([Published(1.0, 3, (A,), 0, finished=True)], 2) == []  # the job is over


def test_a_commit_that_sums_the_wrong_contributions_is_caught() -> None:
    from fthsdp.chaos.sim.cluster import SimCluster, SimConfig
    from fthsdp.chaos.sim.world import World
    cluster = SimCluster(World(0), SimConfig(replicas=2, lanes=1, buckets=1))
    trainer = cluster.trainers[0]
    cluster._record(trainer, 3, ((grad(0, 3, 0, 0) + grad(1, 3, 0, 0), 2, (0, 1)),))
    assert cluster.plane_violations == []
    cluster._record(trainer, 3, ((grad(0, 3, 0, 0) + grad(1, 2, 0, 0), 2, (0, 1)),))  # a step-2 gradient in it
    assert cluster.plane_violations and "the slots (0, 1) give" in cluster.plane_violations[0]


def test_over_for_good_and_only_failed_pays_and_no_hang_checks() -> None:
    later = [_ep(5, 3, (A, B))]
    assert checks.over_for_good(later, {("r1", "r1.1"): (4.0, 0)}, [True], {})
    assert checks.over_for_good([_ep(5, 3, (A, B), life=1)], {("r1", "r1.1"): (4.0, 0)}, [True, False], {}) == []
    assert checks.over_for_good([_ep(5, 3, (A, B), life=1)], {}, [True, False], {("r1", "r1.1"): 4.5})
    exits = [Exit(3.0, 1, "r1.1", "SIGKILL", False), Exit(60.0, 0, "r0.1", "finished", True)]
    assert checks.only_failed_pays(exits, 2, {1}, 50.0) == []
    assert checks.only_failed_pays(exits, 2, set(), 50.0)  # r1 exited with no fault on it
    end = {"lighthouse_up": True, "epoch": 4, "members": {"r0": ("r0.1", "active"), "r1": ("r1.2", "joining")},
           "processes": {0: {"inc": "r0.1", "known": 4}, 1: {"inc": "r1.2", "known": 4}}}
    assert checks.no_hang(end, 2) == ["r1 (r1.2) is not active in the lighthouse's epoch 4 at the end: "
                                      "('r1.2', 'joining')"]
    assert checks.no_hang({"lighthouse_up": False}, 2)
    assert checks.finished([True, False]) == ["r1 never finished"]


# --- one member that blames everyone (issue 41) --------------------------------------------------------------------


@pytest.mark.parametrize(("replicas", "min_replicas", "lanes"), [(3, 1, 1), (3, 2, 2), (4, 2, 1), (4, 1, 3)])
@pytest.mark.parametrize("seed", range(4))
def test_a_member_blaming_everyone_costs_nobody_else(seed: int, replicas: int, min_replicas: int, lanes: int) -> None:
    """The ``blame-all`` fault alone: one member reports every other one, every half second, for 3-8 s, while their
    steps go on. Nobody but the blamer may pay (invariant 7: the others run as one incarnation to the end), the
    job never goes below ``min_replicas`` (the guard), and every invariant holds."""
    blamer = seed % replicas
    fault = Fault(6.0 + seed, BLAME_ALL, (blamer,), 3.0 + seed)
    out = run_drawn(seed, Drawn(replicas, min_replicas, (fault,), lanes=lanes, buckets=2))
    assert out["violations"] == [], out["violations"]
    assert out["epochs"] >= 3, "the blame re-formed no epoch: the fault did nothing"


def test_a_blamer_on_top_of_a_real_fault_does_not_convict_the_wrong_member() -> None:
    """Seed 4: r2 blamed r0 and r1 through five re-forms while they trained on (so their re-forms kept starting
    over), then a real fault on r0's path made everyone blame everyone, and r2's reports tipped the unattributable
    verdict onto r1, whom no fault targeted. Now a lone blamer is evicted once it has blamed everyone through
    ``max_reforms`` re-forms, whatever the blamed members' steps do."""
    out = run_one(4, blame_all=True)
    assert out["violations"] == [], out["violations"]
