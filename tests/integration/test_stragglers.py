"""Fail-slow end to end: replica groups under torchrun (Gloo, CPU, the tiny model); one of them, or one rank of one,
is made slow from a step on (``FTHSDP_FAULT_SLOW``) and the lighthouse's status must name it, and only it (with
the rank), within ten steps, with no flag before. Each forward is padded to 0.1 s (``compute_s``): a steady
compute, as a real model's, where the tiny model's own tens of milliseconds on two shared cores jitter by more than
the straggler factor."""

from __future__ import annotations

import pathlib
import time
from typing import Any

import pytest

from fthsdp.launch.cluster import Cluster
from fthsdp.launch.config import ClusterConfig
from tests.helpers.cluster_checks import check_converged, check_survivor, progress

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _slowed_run(tmp: pathlib.Path, ranks: int, slow: dict[int, dict[str, str]], slow_from: int,
                what: str = "stragglers") -> tuple[list[tuple[int, list[dict[str, Any]]]], set[str]]:
    """60 steps of 3 replicas x ``ranks`` with ``slow``'s environment; returns the status's ``what`` (its
    ``stragglers`` or its ``slow_links``) sampled every 0.1 s with the job's step, once every replica is active,
    and the replicas the other list ever named. Every replica ends at the last step with one state, and nothing is
    named in ``what`` before ``slow_from`` (at least 10 samples before it)."""
    steps = 60
    samples: list[tuple[int, list[dict[str, Any]]]] = []
    other: set[str] = set()
    polled = [0.0]

    def poll(cluster: Cluster) -> None:
        if time.monotonic() - polled[0] < 0.1:
            return
        polled[0] = time.monotonic()
        doc = cluster.status()
        trained = [x["step"] for x in doc["members"] if x["role"] == "active"]
        if len(trained) == 3:  # the job's step as the status sees it: no member is past it
            samples.append((max(trained), doc[what]))
            other.update(x["replica_id"] for x in doc["slow_links" if what == "stragglers" else "stragglers"])

    config = ClusterConfig(replicas=3, ranks=ranks, model="tiny", steps=steps, min_step_s=0.15, compute_s=0.1,
                           timeout_s=240, env=slow)
    report = Cluster(config, tmp, on_tick=poll).run()
    check_converged(report, steps)
    for r in range(3):
        check_survivor(tmp, r, steps)
    healthy = [found for step, found in samples if step < slow_from]
    assert len(healthy) >= 10, "too few status samples before the slowdown: nothing was checked"
    assert all(found == [] for found in healthy), [s for s in samples if s[0] < slow_from and s[1]]
    return samples, other


def test_a_replica_three_times_slower_is_named_within_ten_steps_and_nobody_before(tmp_path: pathlib.Path) -> None:
    slow_from = 25
    samples, links = _slowed_run(tmp_path, 1, {2: {"FTHSDP_FAULT_SLOW": f"{slow_from}:3"}}, slow_from)
    assert links == set(), f"a slow replica named as a slow link: {links}"  # its compute explains its lane times
    flagged = [(step, found) for step, found in samples if found]
    assert flagged, "the slow replica was never named"
    first_step, first = flagged[0]
    assert first_step < slow_from + 10, f"named at step {first_step}, {first_step - slow_from} steps after it slowed"
    assert all([x["replica_id"] for x in found] == ["replica-2"] for _, found in flagged), flagged
    assert first[0]["slowdown"] >= 1.5 and first[0]["others_wait_s"] > 0 and first[0]["since_step"] >= slow_from


def test_one_slow_rank_of_a_replica_is_named_with_its_rank_within_ten_steps(tmp_path: pathlib.Path) -> None:
    """3 x 2: rank 1 of replica 1 computes 3x as long from step 25 (its sibling waits for it in their collectives,
    burning nothing); the status names replica-1 and its rank 1 within ten steps, and nobody before."""
    slow_from = 25
    samples, links = _slowed_run(tmp_path, 2, {1: {"FTHSDP_FAULT_SLOW": f"{slow_from}:3:1"}}, slow_from)
    assert links == set(), f"a slow rank named as a slow link: {links}"
    flagged = [(step, x) for step, found in samples for x in found]
    assert flagged and all(x["replica_id"] == "replica-1" and x["rank"] in (None, 1) for _, x in flagged), flagged
    ranked = [(step, x) for step, x in flagged if x["rank"] == 1]
    assert ranked, f"the slow rank was never named: {flagged[-1:]}"
    assert ranked[0][0] < slow_from + 10, f"rank named at step {ranked[0][0]}, {ranked[0][0] - slow_from} steps late"
    assert ranked[0][1]["rank_busy_ratio"] >= 1.5 and "replica-1 (rank 1: " in ranked[0][1]["text"]


def test_a_slow_link_is_named_as_a_link_with_its_rank_within_ten_steps(tmp_path: pathlib.Path) -> None:
    """3 x 2: from step 25 the lane of rank 1 of replica 1 starts each collective 0.1 s late
    (``FTHSDP_FAULT_SLOW_LINK``), its compute on time: the other replicas' rank 1 wait for it inside the exchange.
    The status names replica-1 rank 1's link within ten steps, no other link, nothing before, and no straggler."""
    slow_from = 25
    samples, stragglers = _slowed_run(tmp_path, 2, {1: {"FTHSDP_FAULT_SLOW_LINK": f"{slow_from}:0.1:1"}}, slow_from,
                                      what="slow_links")
    assert stragglers == set(), f"a slow link named as a straggler: {stragglers}"
    named = [(step, x) for step, found in samples for x in found]
    assert named, "the slow link was never named"
    assert all((x["replica_id"], x["rank"]) == ("replica-1", 1) for _, x in named), named
    assert named[0][0] < slow_from + 10, f"named at step {named[0][0]}, {named[0][0] - slow_from} steps late"
    first = named[0][1]
    assert first["others_wait_s"] - first["own_wait_s"] >= 0.05 and first["since_step"] >= slow_from
    assert "replica-1 rank 1's link is slow" in first["text"]


def test_under_eject_the_straggler_leaves_is_held_out_while_slow_and_the_others_go_on(tmp_path: pathlib.Path) -> None:
    """Replica 2 computes 3x as long from step 20, under --straggler-policy eject: it is ejected (a failure with
    its evidence in the epoch's reason), its next incarnation is held out while its probe step is as slow, and
    the other two train every step without a restart; at the end it takes the final state."""
    # 150 steps: the ejected replica's restart (about 10 s on 2 busy cores) and probe must fit before the end; with
    # 90 the job once finished 0.5 s after the new incarnation registered, before it could be held out.
    steps, slow_from = 150, 20
    config = ClusterConfig(replicas=3, ranks=1, model="tiny", steps=steps, min_step_s=0.15, compute_s=0.1,
                           timeout_s=240, straggler_policy="eject",
                           env={2: {"FTHSDP_FAULT_SLOW": f"{slow_from}:3"}})
    report = Cluster(config, tmp_path).run()
    check_converged(report, steps)
    for r in (0, 1):
        check_survivor(tmp_path, r, steps)
    reasons = [e["reason"] for e in report["events"] if e["event"] == "epoch"]
    ejected = [r for r in reasons if "replica replica-2 ejected (slow:" in r]
    assert len(ejected) == 1, reasons
    rows = [x for x in progress(tmp_path, 2) if x.event == "step" and x.step is not None]
    first = rows[0].incarnation
    assert all(x.incarnation == first for x in rows), "a held-out incarnation trained"
    last = max(x.step for x in rows)
    assert slow_from <= last < slow_from + 20, f"replica 2 trained until step {last}"
    survivors = [x for x in progress(tmp_path, 0) if x.event == "step" and x.step is not None and x.step > last + 2]
    assert survivors and all(x.contributors == 2 for x in survivors)
    assert "held out" in (tmp_path / "replica2.log").read_text()
