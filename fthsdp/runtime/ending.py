"""The end of the job (docs/design.md §3): the barrier a replica runs after its last step, before it leaves
"finished". It completes once every member of the epoch has committed every step (a member one step behind is
served that step's results meanwhile, by FTAR's step reconciliation).

The barrier goes through the replica-local vote, like a step's exchange: when one rank's lane lost it (a partner
that finished left while it completed at some members) while another rank's lane completed it, every rank redoes
it above the epoch it went in, so that partners split the same way meet again. A lane redoing it alone would wait
for partner lanes that had completed it until its bound (found by the simulator, ``fthsdp chaos --sim``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ftar import FTARError, LaneEngine
from fthsdp.runtime.buckets import BucketExchange, LogFn, failure_of
from fthsdp.runtime.commit import Commit, CommitProtocol, Exchanged, Failed, Failure, Rejoin, Tally

END_ATTEMPTS = 5
"""Rounds of the barrier before a replica leaves anyway (each bounded by the exchange's own waits): a count, the
same on every rank, where a deadline would not be."""


def barrier(buckets: BucketExchange, engine: LaneEngine, step: int, vote: Callable[[CommitProtocol], Tally],
            wait_s: float, log: LogFn) -> bool:
    """Run the end-of-job barrier after ``step`` steps on this rank's lane, voting on every round with the
    replica's other ranks (``vote``: the replica-local MAX all-reduce of a protocol's ballot). Returns whether
    every member confirmed the last step (else the replica leaves anyway: its state is final either way)."""
    protocol = CommitProtocol(max_attempts=END_ATTEMPTS)
    protocol.begin()
    again = False
    while True:
        try:
            r = buckets.barrier(step, again).wait(wait_s)
            protocol.lane(Exchanged(r.epoch, step))
        except (FTARError, TimeoutError) as e:
            protocol.lane(Failed(failure_of(e) if isinstance(e, FTARError) else Failure.ERROR))
            log(logging.INFO, "end of job: barrier not exchanged here (%s)", e)
        tally = vote(protocol)  # every rank votes every round, whatever its lane did
        decision = protocol.vote(tally)
        if isinstance(decision, Commit):
            return True
        if isinstance(decision, Rejoin):
            log(logging.WARNING, "end of job: not every member confirmed the last step (%s); leaving anyway",
                decision.reason)
            return False
        engine.reset(after=tally.newest, reform=tally.reform)  # the vote put that epoch behind every lane
        again = True
