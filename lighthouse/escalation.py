"""Bounded escalation (docs/design.md §4): which live suspects to declare hung once the epoch has been re-formed
``max_reforms`` times because of them. Pure, like the decision that calls it (``lighthouse.membership``).

A reporter cannot tell a broken peer from one that merely noticed the same failure, so blame alone convicts only
when it singles someone out:

- *Witnesses* are the reporters nobody blamed. A suspect every witness blamed is hung (a replica stuck while its
  heartbeat thread lives: the others blame it, it blames no one). Several such suspects are all hung.
- Without that, the most-blamed suspect is hung if it is the only one (a replica whose network broke blames
  everyone and everyone blames it; the others are blamed by it alone).
- Otherwise the fault is not attributable (they blame each other, e.g. a fault on the path between them): at most
  one of the tied suspects is evicted, a joiner first, then the newest registration, and none when that would
  leave fewer than ``min_replicas`` data-plane members or no active one. A persistent fault nobody can attribute
  thus costs at most one replica per ``max_reforms + 1`` epochs, never the whole job at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lighthouse.events import Unattributed
from lighthouse.model import ACTIVE, JOINING, Policy, State


@dataclass(frozen=True)
class Verdict:
    """Whom to declare hung (empty: re-form once more), and what to say when the blame was not attributable."""

    hung: tuple[str, ...] = ()
    unattributed: Unattributed | None = None


def hung_verdict(state: State, alive: Sequence[str], policy: Policy) -> Verdict:
    """The verdict on ``alive``: suspects reported in the current epoch that kept heartbeating for
    ``confirm_age_s``. Only those reported through ``max_reforms`` consecutive re-forms can be hung."""
    candidates = sorted(rid for rid in alive
                        if policy.max_reforms and state.reforms.get(rid, 0) >= policy.max_reforms)
    if not candidates:
        return Verdict()
    blame = {rid: state.suspicions.get(rid, frozenset()) for rid in candidates}
    reporters = frozenset().union(*state.suspicions.values())
    witnesses = reporters - state.suspicions.keys()
    if witnesses:
        singled = tuple(rid for rid in candidates if witnesses <= blame[rid])
        if singled:
            return Verdict(singled)
    top = max(len(b) for b in blame.values())
    tied = tuple(rid for rid in candidates if len(blame[rid]) == top)
    if len(tied) == 1:
        return Verdict(tied)
    members = state.members
    pick = max(tied, key=lambda rid: (members[rid].role == JOINING, members[rid].registered_at, rid))
    rest = [x for x in members.values() if x.in_epoch and x.replica_id != pick]
    if len(rest) >= policy.min_replicas and any(x.role == ACTIVE for x in rest):
        return Verdict((pick,), Unattributed(tied, (pick,)))
    return Verdict((), Unattributed(tied))
