"""Bounded escalation (docs/design.md §4): which live members to declare hung once the epoch has been re-formed
``max_reforms`` times because of the same suspects. Pure, like the decision that calls it (``lighthouse.membership``).

A reporter cannot tell a broken peer from one that merely noticed the same failure, and a broken reporter can
blame anyone, so blame convicts only what the evidence can attribute, and never more members than it has
witnesses:

- *Witnesses* are the reporters nobody blamed. Suspects every witness blamed are hung (a replica stuck while its
  heartbeat thread lives: the others blame it, it blames no one), if there are no more of them than witnesses.
- A lone witness that blamed every other member of the epoch (at least two) is itself the suspect: that it alone
  sees everyone else failing is one fault, its own, where the alternative is all the others at once. It is hung
  in their place (``blamer``). With two members the evidence is symmetric and the rule above applies. It is hung
  too once it has done so through ``max_reforms`` consecutive re-forms (``State.lone_blames``) even while the
  members it blames train on (their steps advance, so their own re-forms start over): otherwise its reports stay
  on the books and tip the verdict onto a member it blamed when a real fault comes on top (seen in the
  simulator: a real fault between two other members, three-way blame, and the wrong one evicted). The count
  outlives an epoch that changes the members: of two left, one that blamed everyone all along is the suspect.
  Its word alone never confirms a death either, not beside a dropped connection nor a short silence
  (``credible``): the heartbeat timeout does.
- Without that, the most-blamed suspect is hung if it is the only one (a replica whose network broke blames
  everyone and everyone blames it; the others are blamed by it alone).
- Otherwise the fault is not attributable (they blame each other, e.g. a fault on the path between them): at most
  one of the tied suspects is evicted: one that has been blaming everyone first (``State.lone_blames``), then a
  joiner, then the newest registration. A persistent fault nobody can attribute thus costs at most one replica
  per ``max_reforms + 1`` epochs, never the whole job at once.

``min_replicas`` binds every verdict: none leaves fewer than ``min_replicas`` data-plane members or no active one
(in a finished job, only the latter). A suspect whose own steps advance between reports is never here: its
re-forms start over (``lighthouse.membership``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lighthouse.events import DeathCause, Died, Kept, Unattributed
from lighthouse.model import ACTIVE, JOINING, Policy, State


@dataclass(frozen=True)
class Verdict:
    """Whom to declare hung (empty: re-form once more), and what to say when the blame was not attributable or
    the min-replicas guard kept them."""

    hung: tuple[str, ...] = ()
    note: Unattributed | Kept | None = None
    blamer: bool = False
    """``hung`` is the lone witness that blamed every other member (not the suspects it blamed)."""


def blamed_by(state: State, reporter: str) -> frozenset[str]:
    """The members ``reporter`` blamed in the current epoch."""
    return frozenset(s for s, reporters in state.suspicions.items() if reporter in reporters)


def _blames_everyone(state: State, rid: str) -> bool:
    """Whether data-plane member ``rid`` blamed every other one (at least one), in the current epoch. Counted, not
    listed: O(suspicions) per call."""
    me = state.members.get(rid)
    if me is None or not me.in_epoch:
        return False
    blamed = [s for s in blamed_by(state, rid) if (x := state.members.get(s)) is not None and x.in_epoch]
    return len(blamed) == state.in_epoch_count - 1 > 0


def lone_blamer(state: State) -> str | None:
    """The lone witness (a reporter nobody blamed) that blamed every other data-plane member in the current epoch:
    at least two, or the one left if it did so before too (``State.lone_blames``: with two members the evidence
    is symmetric, unless one of them has been blaming everyone all along); ``None`` if there is none."""
    reporters: frozenset[str] = frozenset().union(*state.suspicions.values())
    witnesses = reporters - state.suspicions.keys()
    if len(witnesses) != 1:
        return None
    (lone,) = witnesses
    if not _blames_everyone(state, lone):
        return None
    return lone if state.in_epoch_count >= 3 or state.lone_blames.get(lone, 0) > 0 else None


def credible(state: State, suspect: str) -> bool:
    """Whether anyone but a lone blamer reported ``suspect``: a lone blamer's word alone never confirms a death, not
    beside the suspect's dropped connection nor beside a second of its silence (a network blip would otherwise turn
    its false report into one); only the heartbeat timeout does then."""
    return bool(state.suspicions.get(suspect, frozenset()) - {lone_blamer(state)})


def lone_blames(state: State) -> dict[str, int]:
    """``State.lone_blames`` once the current epoch is re-formed: the lone blamer's count goes up; a counted member
    that blamed everyone again, though blamed itself now (a real fault came on top), keeps its count; every other
    count ends (the re-forms it counts are consecutive; an epoch that changes the members keeps them)."""
    lone = lone_blamer(state)
    out = {rid: n for rid, n in state.lone_blames.items() if rid != lone and _blames_everyone(state, rid)}
    if lone is not None:
        out[lone] = state.lone_blames.get(lone, 0) + 1
    return out


def _guarded(state: State, hung: tuple[str, ...], policy: Policy) -> bool:
    """Whether the members left after ``hung`` go satisfy the min-replicas guard (at least ``min_replicas`` in the
    data plane, one of them active; only the latter once the job finished)."""
    rest = [x for x in state.members.values() if x.in_epoch and x.replica_id not in hung]
    enough = len(rest) >= policy.min_replicas or state.finished_step is not None
    return enough and any(x.role == ACTIVE for x in rest)


def hung_verdict(state: State, alive: Sequence[str], policy: Policy) -> Verdict:
    """The verdict on ``alive``: suspects reported in the current epoch that kept heartbeating for
    ``confirm_age_s``. Only those reported through ``max_reforms`` consecutive re-forms, or a lone blamer (of
    such candidates, or through as many re-forms of its own), can be hung."""
    candidates = sorted(rid for rid in alive
                        if policy.max_reforms and state.reforms.get(rid, 0) >= policy.max_reforms)
    lone = lone_blamer(state)
    if lone is not None and (candidates or (policy.max_reforms
                                            and state.lone_blames.get(lone, 0) >= policy.max_reforms)):
        verdict = (lone,)
        return Verdict(verdict, blamer=True) if _guarded(state, verdict, policy) else Verdict((), Kept(verdict))
    if not candidates:
        return Verdict()
    blame = {rid: state.suspicions.get(rid, frozenset()) for rid in candidates}
    witnesses = frozenset().union(*state.suspicions.values()) - state.suspicions.keys()
    if witnesses:
        singled = tuple(rid for rid in candidates if witnesses <= blame[rid])
        if singled and len(singled) <= len(witnesses):
            return Verdict(singled) if _guarded(state, singled, policy) else Verdict((), Kept(singled))
    top = max(len(b) for b in blame.values())
    tied = tuple(rid for rid in candidates if len(blame[rid]) == top)
    if len(tied) == 1:
        return Verdict(tied) if _guarded(state, tied, policy) else Verdict((), Kept(tied))
    members = state.members
    pick = max(tied, key=lambda rid: (state.lone_blames.get(rid, 0), members[rid].role == JOINING,
                                      members[rid].registered_at, rid))
    if _guarded(state, (pick,), policy):
        return Verdict((pick,), Unattributed(tied, (pick,)))
    return Verdict((), Unattributed(tied))


def deaths(state: State, verdict: Verdict, alive: Sequence[str]) -> tuple[Died, ...]:
    """The ``Died`` events of ``verdict``'s hung members (``alive``: the suspects it was given)."""
    if verdict.blamer:
        epochs = max(*(state.reforms.get(rid, 0) for rid in alive), *state.lone_blames.values(), 0) + 1
        return tuple(Died(rid, DeathCause.BLAMER, reported_epochs=epochs, blamed=tuple(sorted(blamed_by(state, rid))))
                     for rid in verdict.hung)
    return tuple(Died(rid, DeathCause.HUNG, reported_epochs=state.reforms[rid] + 1,
                      reporters=tuple(sorted(state.suspicions.get(rid, ())))) for rid in verdict.hung)
