"""After a failed collective, who is to blame (docs/design.md §5): check in on the epoch's store as failed, give
the other members ``blame_grace_s`` to do the same, and report to the lighthouse those that did not.

A member that died does not check in, so the grace would always run to its end after a death. It does not have
to: ``EARLY_REPORT_S`` into it, the members still missing are reported *early*, and the lighthouse confirms at once
those whose own connection to it closed (their process died: the kernel closed it). The new epoch it pushes ends
the grace. A live member that was only slower to check in has no such evidence, and an early report about it
changes nothing (``lighthouse.membership``): it is reported, as before, only if it is still missing when the grace
ends. The decision of whom to report is ``ftar.rules.blame``; this module is its I/O.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from ftar.group import EpochGroup
from ftar.membership import Membership
from ftar.rules import Blame, blame, missing, newer
from lighthouse.epoch_view import EpochView

BLAME_POLL_S = 0.01
"""How often the store is read for check-ins during the blame grace."""
EARLY_REPORT_S = 0.02
"""How long into the grace the members still missing are reported early (the live ones check in within
milliseconds of the same failure)."""
EARLY_REPORT_MAX = 8
"""At most this many members are reported early: more missing than that is not a few deaths but a slow or
partitioned data plane, which the grace is for."""
REPORT_LIMIT = 1000
"""Characters of a failure report's reason."""

Log = Callable[..., None]
"""``log(level, epoch, tag, msg, *args)``: the engine's structured log."""


def blame_failure(group: EpochGroup | None, epoch: EpochView, membership: Membership, lane: int, grace_s: float,
                  reason: str, log: Log) -> Blame:
    """Check in as failed in ``group`` (the failed exchange's), wait up to ``grace_s`` for the others to do the
    same (reporting the missing early, once), then report those still missing, unless the lighthouse moved on.
    Returns what was reported (the engine sends it again while no newer epoch comes: ``rules.PendingReports``)."""
    me = membership.replica_id

    def text(why: str) -> str:
        return f"lane {lane}: {why}"[:REPORT_LIMIT]

    suspects: list[str] = []
    if group is not None:
        key = group.failure_key()
        group.check_in(key)
        start = time.monotonic()
        early_sent = False
        while True:
            suspects = missing(epoch.replica_ids, me, group.present(key))
            now = time.monotonic()
            if not suspects or now - start >= grace_s or newer(membership.current(), epoch):
                break
            if not early_sent and now - start >= EARLY_REPORT_S:
                early_sent = True
                if len(suspects) <= EARLY_REPORT_MAX:
                    for suspect in suspects:
                        membership.report(suspect, epoch.number, text(reason), early=True)
                    continue  # the reports took time: look again before sleeping
            time.sleep(BLAME_POLL_S)  # polling the store with a deadline
    verdict = blame(epoch, membership.current(), me, suspects, reason)
    if verdict.everyone:
        log(logging.WARNING, epoch.number, None, "failure with every member checked in; asking for a re-formed "
            "epoch")
    send_reports(membership, epoch.number, lane, verdict)
    return verdict


def send_reports(membership: Membership, epoch: int, lane: int, verdict: Blame) -> None:
    """Report ``verdict``'s suspects as failed in ``epoch``."""
    for suspect in verdict.suspects:
        membership.report(suspect, epoch, f"lane {lane}: {verdict.reason}"[:REPORT_LIMIT], early=verdict.early)
