"""Which incarnation of a replica may call the lighthouse, and the refusals of those that may not; dropping members
(their incarnations are then over for good). Pure; part of the membership decision (``lighthouse.membership``
re-exports these)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from lighthouse.model import DEPARTED_IDS_LIMIT, DEPARTED_LIMIT, State


@dataclass(frozen=True)
class Rejection:
    """Why an event was refused; ``code`` names the gRPC status the edge answers with."""

    code: str  # INVALID_ARGUMENT | NOT_FOUND | FAILED_PRECONDITION | ABORTED (retry later)
    message: str


def departed_message(replica_id: str, incarnation: str) -> str:
    """The refusal of a call by an incarnation that is over (``State.departed``)."""
    return (f"incarnation {incarnation[:64]!r} of replica {replica_id!r} was declared dead or left: "
            "register as a new incarnation")


JOB_FINISHED_AT = "the job finished at step"
"""How the refusal of a call by an incarnation that is not a member of a job that finished begins: a client reads
the step after it (``finished_step_of``; ``lighthouse.errors.JobOver``)."""


def finished_message(replica_id: str, incarnation: str, step: int) -> str:
    """The refusal of a call by an incarnation that is not a member of a job that finished."""
    return (f"{JOB_FINISHED_AT} {step}: incarnation {incarnation[:64]!r} of replica {replica_id!r} is over "
            "(do not train; a registration is answered finished)")


def finished_step_of(text: str) -> int | None:
    """The step a ``finished_message`` in ``text`` names (the refusal itself, or a session's end that quotes it);
    None when there is none."""
    at = text.find(JOB_FINISHED_AT + " ")
    if at < 0:
        return None
    head = text[at + len(JOB_FINISHED_AT) + 1:].split(":", 1)[0]
    return int(head) if head.isdigit() else None


def check_incarnation(state: State, replica_id: str, incarnation: str) -> Rejection | None:
    """Whether ``incarnation`` of ``replica_id`` may call: None when it is the registered one; otherwise the
    refusal (FAILED_PRECONDITION: it is over, for good; NOT_FOUND: unknown here, it must register again). One
    dict lookup when it may: the server's heartbeat path calls this too."""
    member = state.members.get(replica_id)
    if member is None:
        if state.finished_step is not None:
            return Rejection("FAILED_PRECONDITION", finished_message(replica_id, incarnation, state.finished_step))
        if state.is_departed(replica_id, incarnation):
            return Rejection("FAILED_PRECONDITION", departed_message(replica_id, incarnation))
        return Rejection("NOT_FOUND", f"replica {replica_id!r} is not registered with this lighthouse "
                         "(it restarted?): register again")
    if member.incarnation != incarnation:
        return Rejection("FAILED_PRECONDITION",
                         f"incarnation {incarnation[:64]!r} of replica {replica_id!r} was replaced")
    return None


def drop(state: State, gone: Iterable[str]) -> State:
    """``state`` without the members ``gone``, whose incarnations are over for good (``State.departed``), and
    without their reports and the reports against them."""
    over = {rid: state.members[rid].incarnation for rid in gone if rid in state.members}
    if not over:
        return state
    # The most recently departed last: the oldest ids go first once there are too many.
    departed = {**{k: v for k, v in state.departed.items() if k not in over},
                **{rid: (*state.departed.get(rid, ()), i)[-DEPARTED_LIMIT:] for rid, i in over.items()}}
    if len(departed) > DEPARTED_IDS_LIMIT:
        departed = dict(list(departed.items())[-DEPARTED_IDS_LIMIT:])
    members = {k: v for k, v in state.members.items() if k not in over}
    # A gone reporter's blame goes with it (its collectives failed because of its own end), and so do the
    # suspicions against the gone: a suspect left with no reporter is no suspect.
    suspicions = {k: r - over.keys() for k, r in state.suspicions.items() if k not in over}
    suspicions = {k: r for k, r in suspicions.items() if r}
    suspected_at = {k: t for k, t in state.suspected_at.items() if k in suspicions}
    return dataclasses.replace(state, members=members, departed=departed, suspicions=suspicions,
                               suspected_at=suspected_at)
