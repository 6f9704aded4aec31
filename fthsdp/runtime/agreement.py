"""The replicas' periodic agreement on their state (docs/design.md §7), driven for one rank: every
``FTHSDP_DIGEST_EVERY`` steps, at the commit boundary before the step, the replica digests its whole state (every
byte of every rank's shards, the cursors, the trainer state: ``ShardState.digest``, one all-gather of 32 bytes
over the replica's ranks), sends 64 bits of it with the step's exchange, and after the commit compares what every
contributing replica sent (``fthsdp.runtime.digest``).

On a mismatch: a replica in the minority raises ``Diverged`` (it restarts and catches up from the others); the
majority logs an error naming it and goes on; with no majority (two replicas that differ), every one raises
``DigestMismatch``: nobody can tell which state is right, so the job stops rather than train on. A spare (no
slot, so no digest sent) digests its state too and holds it against the slots' majority (``check_own``): if it
differs it raises ``Diverged`` too, so a spare that took a slot later would not train on a corrupt state."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from ftar import ExchangeResult
from fthsdp.runtime.buckets import BucketExchange, LogFn
from fthsdp.runtime.digest import bits, decide, due, strays
from fthsdp.runtime.errors import DigestMismatch, Diverged
from fthsdp.runtime.state import ShardState, replica_hash


class DigestCheck:
    """One rank's side of the periodic digest check."""

    def __init__(self, every: int, slot: Callable[[], int], log: LogFn,
                 on_digest: Callable[[int, str], None] = lambda step, digest: None) -> None:
        self.every, self.log = every, log
        self._slot = slot
        self.on_digest = on_digest
        """Told each digest computed (the step, the 64 compared bits in hex): the lighthouse shows them."""
        self.last_cost_s = 0.0
        """How long the last digest took to compute (hash and all-gather)."""

    def digest(self, step: int, shards: ShardState, cursors: torch.Tensor, world_size: int,
               device: torch.device) -> bytes | None:
        """The replica's state digest before ``step`` if that step is checked (a collective over the replica's
        ranks then: every rank is at the same step), else None."""
        if not due(step, self.every):
            return None
        t0 = time.perf_counter()
        out = bytes.fromhex(replica_hash(shards.digest(cursors), world_size, device))
        self.last_cost_s = time.perf_counter() - t0
        self.on_digest(step, out[:8].hex())  # the 64 bits the replicas compare
        return out

    def check(self, step: int, results: Sequence[ExchangeResult]) -> tuple[int, ...]:
        """After committing ``step``: compare the digests it carried. Returns the replicas (indexes) that differ
        from the majority (this one goes on); raises when this replica is one of them, or with no majority."""
        if not due(step, self.every):
            return ()
        verdict = decide(BucketExchange.digests_of(results))
        if verdict.agree:
            return ()
        seen = ", ".join(f"{s}: {d:016x}" for s, d in sorted(verdict.digests.items()))
        if not verdict.majority:
            msg = (f"state digests differ at step {step} between replicas {list(verdict.differ)} and no majority "
                   f"agrees (digest per replica index: {seen}): stopping rather than training on diverged state")
            self.log(logging.ERROR, "%s", msg)
            raise DigestMismatch(msg, step, verdict.differ)
        if (slot := self._slot()) in verdict.differ:
            msg = (f"this replica (index {slot}) holds a state that differs from the majority's at step {step} "
                   f"(digest per replica index: {seen}): restarting to catch up from the others")
            self.log(logging.ERROR, "%s", msg)
            raise Diverged(msg, step, verdict.differ)
        self.log(logging.ERROR, "the state of replica(s) %s differs from the majority's at step %d (digest per "
                 "replica index: %s); they restart and catch up", list(verdict.differ), step, seen)
        return verdict.differ

    def check_own(self, step: int, own: tuple[int, bytes | None], results: Sequence[ExchangeResult]) -> None:
        """After committing ``step`` as a replica that sent no digest (a spare): raises ``Diverged`` when ``own``,
        (the step it digested the state before, the digest: None when not a checked step) is of ``step`` and
        differs from the slots' majority."""
        digested, digest = own
        if digest is None or digested != step:
            return
        verdict = decide(BucketExchange.digests_of(results))
        if strays(bits(digest), verdict):
            seen = ", ".join(f"{s}: {d:016x}" for s, d in sorted(verdict.digests.items()))
            msg = (f"this spare's state ({bits(digest):016x}) differs from the majority's at step {step} (digest per "
                   f"replica index: {seen}): restarting to catch up from the others")
            self.log(logging.ERROR, "%s", msg)
            raise Diverged(msg, step, ())
