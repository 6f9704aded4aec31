"""The one status view of a job: what the gRPC ``Status`` call answers, what ``GET /status`` serves as JSON and
what the page at ``/`` draws. Built from the job's state by a pure function, then encoded for either side."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from lighthouse.events import replica_kinds
from lighthouse.model import NO_SLOT, Policy, State
from lighthouse.proto_codec import ROLE_TO_PB
from lighthouse.slots import waiting_slots
from lighthouse.stragglers import Pace, SlowLink, Straggler, assess, assess_links, pack_lanes, training_paces
from lighthouse.v1 import lighthouse_pb2 as pb

STATUS_HISTORY = 32
"""Epochs a status answer lists (the newest): at 1,000 replicas all 256 kept would make it about 4 MB."""


@dataclass(frozen=True)
class MemberRow:
    replica_id: str
    incarnation: str
    role: str
    in_epoch: bool
    last_heartbeat_age_s: float
    step: int
    digest_step: int = 0
    digest: str = ""
    """The latest state digest its heartbeats carried (empty: none) and the step it was taken before."""
    pace: Pace | None = None
    """Its latest pace report (compute and exchange wait per step; ``lighthouse.stragglers``); None: none."""
    slot: int = NO_SLOT
    """The data slot it trains (``lighthouse.slots``); ``NO_SLOT``: none (a spare, or not in the data plane)."""
    catchup: str = ""
    """Its rank 0's catch-up address (joiners fetch there; ``fthsdp trace`` reads its ranks' timelines there)."""


@dataclass(frozen=True)
class HistoryRow:
    epoch: int
    time: float
    reason: str
    members: tuple[str, ...]
    events: tuple[tuple[str, str], ...]
    """``(replica_id, kind)`` of what happened to the members to form it (``lighthouse.events``)."""


@dataclass(frozen=True)
class StatusView:
    job: str
    leader: bool
    leader_address: str
    address: str
    epoch: int
    rendezvous: str
    min_replicas: int
    heartbeat_timeout_s: float
    members: tuple[MemberRow, ...]
    history: tuple[HistoryRow, ...]
    finished_step: int | None = None
    """The job completed at this step (``State.finished_step``); None: not finished."""
    agreement: Agreement | None = None
    """Whether the members' state digests agree (``agreement``); None: no step has two digests yet."""
    stragglers: tuple[Straggler, ...] = ()
    """The members the others wait on, slowest first (``lighthouse.stragglers.assess``)."""
    leader_reached: bool = False
    """This lighthouse follows and has reached the leader's port (``Leader.leader_reached``)."""
    slow_links: tuple[SlowLink, ...] = ()
    """The members' lanes the others wait for while their compute is on time (``stragglers.assess_links``)."""
    waiting_slots: tuple[int, ...] = ()
    """The data slots no active member of the epoch holds (``waiting_slots``): their batches wait, or with
    ``orphans_carried`` the others train them."""
    orphan_steps: tuple[tuple[int, int], ...] = ()
    """(slot, steps it had no active holder in) for each slot that had none for a step (``OrphanSteps``)."""
    orphans_carried: bool = False
    """The job's replicas carry orphan slots (the lighthouse runs ``Policy.orphan_planes``)."""


@dataclass(frozen=True)
class Agreement:
    """The members' state digests at the newest step at least two of them reported one for."""

    step: int
    digests: tuple[tuple[str, str], ...]
    """(replica id, digest) of the members that reported one for ``step``."""

    @property
    def agree(self) -> bool:
        return len({d for _, d in self.digests}) == 1

    @property
    def differ(self) -> tuple[str, ...]:
        """The members whose digest is not the most common one (all of them when none is held by a majority)."""
        counts = Counter(d for _, d in self.digests)
        value, n = counts.most_common(1)[0]
        if 2 * n > len(self.digests):
            return tuple(rid for rid, d in self.digests if d != value)
        return tuple(rid for rid, _ in self.digests)

    def text(self) -> str:
        if self.agree:
            return f"agree at step {self.step} ({len(self.digests)} replicas)"
        return f"differ at step {self.step}: " + ", ".join(f"{rid} {d}" for rid, d in self.digests)


def agreement(digests: dict[str, tuple[int, str]]) -> Agreement | None:
    """Compare the members' latest digests: at the newest step that at least two of them reported one for (a
    replica's heartbeat carries only its latest, so members a digest apart are not compared, and two that differ
    there with no third are both named: the replicas' own check, on every contributor's digest, tells which)."""
    by_step: dict[int, list[tuple[str, str]]] = {}
    for rid, (step, digest) in digests.items():
        by_step.setdefault(step, []).append((rid, digest))
    steps = [s for s, rows in by_step.items() if len(rows) >= 2]
    if not steps:
        return None
    step = max(steps)
    return Agreement(step, tuple(sorted(by_step[step])))


@dataclass(frozen=True)
class Leader:
    """Who leads, as this lighthouse knows it."""

    leading: bool
    leader_address: str
    address: str
    leader_reached: bool = False
    """A follower that has reached the leader's port (it takes over as soon as that port refuses connections)."""


def build(job_id: str, state: State, *, last_seen: dict[str, float], steps: dict[str, int], rendezvous: str,
          policy: Policy, leader: Leader, now: float,
          digests: dict[str, tuple[str, int, str]] | None = None,
          paces: dict[str, tuple[str, tuple[Pace, ...]]] | None = None,
          orphan_steps: dict[int, int] | None = None) -> StatusView:
    """The status of a job in ``state``, with its liveness as of ``now``. ``digests``: per replica, the
    (incarnation, step, digest) its heartbeats last carried; ``paces``: per replica, (incarnation, its last pace
    reports); only a current member incarnation's count, and stragglers are looked for among the active members of
    the epoch."""
    in_epoch = set(state.epoch.replica_ids() if state.epoch else ())
    digests_of = {rid: (step, d) for rid, (inc, step, d) in (digests or {}).items()
                  if rid in state.members and state.members[rid].incarnation == inc}
    paces_of = {rid: h for rid, (inc, h) in (paces or {}).items()
                if rid in state.members and state.members[rid].incarnation == inc and h}
    training = training_paces(state, paces or {})
    return StatusView(
        job=job_id, leader=leader.leading, leader_address=leader.leader_address, address=leader.address,
        epoch=state.epoch.number if state.epoch is not None else 0, rendezvous=rendezvous,
        min_replicas=policy.min_replicas, heartbeat_timeout_s=policy.heartbeat_timeout_s,
        members=tuple(
            MemberRow(x.replica_id, x.incarnation, x.role, x.replica_id in in_epoch,
                      max(0.0, now - last_seen.get(x.replica_id, x.registered_at)), steps.get(x.replica_id, 0),
                      *digests_of.get(x.replica_id, (0, "")),
                      paces_of[x.replica_id][-1] if x.replica_id in paces_of else None, x.slot,
                      x.endpoints.catchup)
            for x in sorted(state.members.values(), key=lambda x: x.replica_id)),
        history=tuple(HistoryRow(e.number, e.created_at, e.reason, e.replica_ids(), tuple(replica_kinds(e.events)))
                      for e in state.history[-STATUS_HISTORY:]),
        finished_step=state.finished_step,
        agreement=agreement(digests_of),
        stragglers=assess(training, policy.straggler_factor, policy.straggler_confirm),
        leader_reached=leader.leader_reached,
        slow_links=assess_links(training, policy.straggler_confirm),
        waiting_slots=waiting_slots(state),
        orphan_steps=tuple((orphan_steps or {}).items()),
        orphans_carried=policy.orphan_planes,
    )


def to_json(view: StatusView) -> dict[str, Any]:
    """The JSON of ``GET /status`` (and what the page embeds)."""
    return {
        "job": view.job,
        "leader": view.leader,
        "leader_address": view.leader_address,
        "leader_reached": view.leader_reached,
        "address": view.address,
        "epoch": view.epoch,
        "rendezvous": view.rendezvous,
        "min_replicas": view.min_replicas,
        "heartbeat_timeout_s": view.heartbeat_timeout_s,
        "members": [
            {"replica_id": x.replica_id, "incarnation": x.incarnation, "role": x.role, "in_epoch": x.in_epoch,
             "slot": None if x.slot == NO_SLOT else x.slot, "catchup": x.catchup,
             "last_heartbeat_age_s": round(x.last_heartbeat_age_s, 3), "step": x.step,
             "digest_step": x.digest_step, "digest": x.digest,
             "pace": None if x.pace is None else {"step": x.pace.step, "compute_s": round(x.pace.compute_s, 4),
                                                  "wait_s": round(x.pace.wait_s, 4),
                                                  "busiest_rank": x.pace.busiest_rank,
                                                  "busiest_s": round(x.pace.busiest_s, 4),
                                                  "siblings_busy_s": round(x.pace.siblings_busy_s, 4),
                                                  "lane_wait_s": [round(w, 4) for w in x.pace.lane_wait_s]}}
            for x in view.members
        ],
        "history": [
            {"epoch": e.epoch, "time": e.time, "reason": e.reason, "members": list(e.members),
             "events": [{"replica_id": rid, "kind": kind} for rid, kind in e.events]}
            for e in view.history
        ],
        "finished_step": view.finished_step,
        "agreement": None if view.agreement is None else {
            "step": view.agreement.step, "agree": view.agreement.agree, "differ": list(view.agreement.differ),
            "digests": dict(view.agreement.digests), "text": view.agreement.text()},
        "stragglers": [{"replica_id": x.replica_id, "slowdown": x.slowdown, "others_wait_s": x.others_wait_s,
                        "since_step": x.since_step, "reports": x.reports, "rank": x.rank,
                        "rank_busy_ratio": x.rank_busy_ratio, "text": x.text()}
                       for x in view.stragglers],
        "slow_links": [{"replica_id": x.replica_id, "rank": x.rank, "own_wait_s": x.own_wait_s,
                        "others_wait_s": x.others_wait_s, "since_step": x.since_step, "reports": x.reports,
                        "text": x.text()} for x in view.slow_links],
        "waiting_slots": list(view.waiting_slots),
        "orphan_steps": {str(slot): n for slot, n in view.orphan_steps},
        "orphans_carried": view.orphans_carried,
    }


def to_pb(view: StatusView, epoch: pb.Epoch) -> pb.StatusResponse:
    """The answer of the gRPC ``Status`` call; ``epoch`` is the current epoch as pushed."""
    return pb.StatusResponse(
        epoch=epoch,
        members=[pb.MemberStatus(replica_id=x.replica_id, incarnation=x.incarnation, role=ROLE_TO_PB[x.role],
                                 in_epoch=x.in_epoch, last_heartbeat_age_s=x.last_heartbeat_age_s, step=x.step,
                                 digest_step=x.digest_step, digest=x.digest,
                                 pace_step=x.pace.step if x.pace else 0, compute_s=x.pace.compute_s if x.pace else 0.0,
                                 wait_s=x.pace.wait_s if x.pace else 0.0,
                                 busiest_rank=x.pace.busiest_rank if x.pace else 0,
                                 busiest_s=x.pace.busiest_s if x.pace else 0.0,
                                 siblings_busy_s=x.pace.siblings_busy_s if x.pace else 0.0,
                                 lane_wait_ms=pack_lanes(x.pace.lane_wait_s) if x.pace else b"")
                 for x in view.members],
        history=[pb.HistoryEntry(epoch=e.epoch, created_unix=e.time, reason=e.reason, members=list(e.members),
                                 events=[pb.ReplicaEvent(replica_id=rid, kind=kind) for rid, kind in e.events])
                 for e in view.history],
        leader=view.leader,
        finished=view.finished_step is not None,
        finished_step=view.finished_step or 0,
        agreement="" if view.agreement is None else view.agreement.text(),
        stragglers=[pb.Straggler(replica_id=x.replica_id, slowdown=x.slowdown, others_wait_s=x.others_wait_s,
                                 since_step=x.since_step, reports=x.reports, rank=x.rank,
                                 rank_busy_ratio=x.rank_busy_ratio) for x in view.stragglers],
        slow_links=[pb.SlowLink(replica_id=x.replica_id, rank=x.rank, own_wait_s=x.own_wait_s,
                                others_wait_s=x.others_wait_s, since_step=x.since_step, reports=x.reports)
                    for x in view.slow_links],
        waiting_slots=list(view.waiting_slots),
        orphan_steps=dict(view.orphan_steps),
        orphans_carried=view.orphans_carried,
    )
