"""Ejecting a straggler (fail-slow under the ``eject`` policy, docs/design.md §4 "Stragglers"): the membership rule,
pure, and the hold-out that keeps an ejected replica out of the data plane until a probe step shows it healthy.

A straggler (``lighthouse.stragglers``) is ejected only when that wins: with N active members and the straggler
at ``1/slowdown`` of the others' speed, N - 1 full-speed replicas train more per second than N at its pace when
``slowdown > N / (N - 1)``. It is never ejected below ``min_replicas``, and it must be active (a joiner exchanges
zeros and computes nothing). It leaves the epoch as a failure would (its incarnation is over; its data slot's
cursor stays; the epoch's reason names the evidence), and its next incarnation comes back as a joiner, which
``held_out`` turns away while its probe step is as slow as it was.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from lighthouse.events import DeathCause, Died, MembershipEvent
from lighthouse.incarnations import Rejection, check_incarnation, drop
from lighthouse.model import ACTIVE, Policy, State

Out = TypeVar("Out")

HELD_OUT = "held out"
"""How a refusal of ``Ready(JOINING)`` by ``held_out`` starts (ABORTED: the client probes again and retries)."""


@dataclass(frozen=True)
class Eject:
    """Take a straggler out of the job (the evidence comes from ``lighthouse.stragglers.Straggler``)."""

    replica_id: str
    incarnation: str
    now: float
    slowdown: float
    others_wait_s: float
    since_step: int


def wins(slowdown: float, active: int) -> bool:
    """Whether ``active`` - 1 replicas at full speed beat ``active`` at the pace of one ``slowdown`` times slower."""
    return active >= 2 and slowdown * (active - 1) > active


def eject(state: State, ev: Eject, policy: Policy,
          reconcile: Callable[[State, tuple[MembershipEvent, ...], float, Policy], Out]) -> Out | Rejection:
    """The outcome of ``ev`` (``reconcile`` is the membership's: form the epoch without it), or a ``Rejection``."""
    if (rej := check_incarnation(state, ev.replica_id, ev.incarnation)) is not None:
        return rej
    mine = state.epoch.member(ev.replica_id) if state.epoch is not None else None
    if mine is None or mine.role != ACTIVE or mine.incarnation != ev.incarnation:
        return Rejection("FAILED_PRECONDITION", f"replica {ev.replica_id} is not an active member of the epoch")
    active = sum(1 for x in state.epoch.members if x.role == ACTIVE) if state.epoch is not None else 0
    if active - 1 < policy.min_replicas:
        return Rejection("FAILED_PRECONDITION", f"ejecting {ev.replica_id} would leave {active - 1} active "
                         f"replica(s), fewer than min_replicas {policy.min_replicas}")
    if not wins(ev.slowdown, active):
        return Rejection("FAILED_PRECONDITION", f"ejecting {ev.replica_id} ({ev.slowdown:.2f}x slower) would not "
                         f"win: with {active} replicas it must be over {active / (active - 1):.2f}x slower")
    died = Died(ev.replica_id, DeathCause.SLOW, slowdown=ev.slowdown, waited_s=ev.others_wait_s,
                step=ev.since_step)
    return reconcile(drop(state, (ev.replica_id,)), (died,), ev.now, policy)


def held_out(probe_s: float, others_compute_s: Iterable[float], factor: float) -> str | None:
    """Why a replica ejected as slow may not enter the data plane yet (None: it may): it sent no probe step (a
    forward and backward, timed after its warm-up: only a replica asked for one runs it), or its probe took at
    least ``factor`` times the active members' median compute. With nothing to compare with, it may."""
    others = list(others_compute_s)
    if not others:
        return None
    base = statistics.median(others)
    if probe_s <= 0:
        return f"{HELD_OUT}: ejected as slow; send a probe step"
    if base > 0 and probe_s >= factor * base:
        return (f"{HELD_OUT}: ejected as slow, and its probe step took {probe_s:.3f}s, {probe_s / base:.2f}x the "
                f"others' {base:.3f}s; probe again later")
    return None
