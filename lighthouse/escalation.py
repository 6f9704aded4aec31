"""Bounded escalation (docs/design.md §4): which live members to declare hung once the epoch has been re-formed
``max_reforms`` times because of the same suspects. Pure, like the decision that calls it (``lighthouse.membership``).

A reporter cannot tell a broken peer from one that merely noticed the same failure, and a broken reporter can
blame anyone, so blame convicts only what the evidence can attribute, and never more members than it has
witnesses:

- *Witnesses* are the reporters nobody blamed. Suspects every witness blamed are hung (a replica stuck while its
  heartbeat thread lives: the others blame it, it blames no one), if there are no more of them than witnesses.
- A lone witness that blamed every other member of the epoch (at least two) is itself the suspect: that it alone
  sees everyone else failing is one fault, its own, where the alternative is all the others at once. It is hung
  in their place (``blamer``). With two members the evidence is symmetric and the rule above applies.
- Without that, the most-blamed suspect is hung if it is the only one (a replica whose network broke blames
  everyone and everyone blames it; the others are blamed by it alone).
- Otherwise the fault is not attributable (they blame each other, e.g. a fault on the path between them): at most
  one of the tied suspects is evicted, a joiner first, then the newest registration. A persistent fault nobody can
  attribute thus costs at most one replica per ``max_reforms + 1`` epochs, never the whole job at once.

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


def _guarded(state: State, hung: tuple[str, ...], policy: Policy) -> bool:
    """Whether the members left after ``hung`` go satisfy the min-replicas guard (at least ``min_replicas`` in the
    data plane, one of them active; only the latter once the job finished)."""
    rest = [x for x in state.members.values() if x.in_epoch and x.replica_id not in hung]
    enough = len(rest) >= policy.min_replicas or state.finished_step is not None
    return enough and any(x.role == ACTIVE for x in rest)


def hung_verdict(state: State, alive: Sequence[str], policy: Policy) -> Verdict:
    """The verdict on ``alive``: suspects reported in the current epoch that kept heartbeating for
    ``confirm_age_s``. Only those reported through ``max_reforms`` consecutive re-forms (or their lone blamer)
    can be hung."""
    candidates = sorted(rid for rid in alive
                        if policy.max_reforms and state.reforms.get(rid, 0) >= policy.max_reforms)
    if not candidates:
        return Verdict()
    blame = {rid: state.suspicions.get(rid, frozenset()) for rid in candidates}
    reporters = frozenset().union(*state.suspicions.values())
    witnesses = reporters - state.suspicions.keys()
    plane = {rid for rid, x in state.members.items() if x.in_epoch}
    if len(witnesses) == 1 and len(plane) >= 3:
        (lone,) = witnesses
        if lone in plane and blamed_by(state, lone) >= plane - {lone}:
            verdict = (lone,)
            return Verdict(verdict, blamer=True) if _guarded(state, verdict, policy) else Verdict((), Kept(verdict))
    if witnesses:
        singled = tuple(rid for rid in candidates if witnesses <= blame[rid])
        if singled and len(singled) <= len(witnesses):
            return Verdict(singled) if _guarded(state, singled, policy) else Verdict((), Kept(singled))
    top = max(len(b) for b in blame.values())
    tied = tuple(rid for rid in candidates if len(blame[rid]) == top)
    if len(tied) == 1:
        return Verdict(tied) if _guarded(state, tied, policy) else Verdict((), Kept(tied))
    members = state.members
    pick = max(tied, key=lambda rid: (members[rid].role == JOINING, members[rid].registered_at, rid))
    if _guarded(state, (pick,), policy):
        return Verdict((pick,), Unattributed(tied, (pick,)))
    return Verdict((), Unattributed(tied))


def deaths(state: State, verdict: Verdict, alive: Sequence[str]) -> tuple[Died, ...]:
    """The ``Died`` events of ``verdict``'s hung members (``alive``: the suspects it was given)."""
    if verdict.blamer:
        epochs = max(state.reforms.get(rid, 0) for rid in alive) + 1
        return tuple(Died(rid, DeathCause.BLAMER, reported_epochs=epochs, blamed=tuple(sorted(blamed_by(state, rid))))
                     for rid in verdict.hung)
    return tuple(Died(rid, DeathCause.HUNG, reported_epochs=state.reforms[rid] + 1,
                      reporters=tuple(sorted(state.suspicions.get(rid, ())))) for rid in verdict.hung)
