"""FTAR's rules (docs/design.md §5), pure: which epoch an attempt runs in, when a collective in flight is given up, how
the members agree on the tag, whom to blame, how a failed exchange ends, how many attempts it gets.

No process group, no store, no thread, no clock: the engine (``ftar.engine``) feeds these the epochs it sees,
the time and what the data plane did, and acts on what they decide.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ftar.errors import AttemptsExhausted, Excluded, FTARError, Interrupted, Misaligned, NoEpoch
from lighthouse.epoch_view import EpochView

NO_TAG = -(2**62)
"""What a joiner (``tag=None``) sends in the alignment check: below every tag, so it counts in neither bound."""

DEADLINE_SLACK_S = 0.5
"""A collective is given up this long after the data plane's own timeout, which should have ended it first."""


# --- epochs ---------------------------------------------------------------------------------------------------


def newer(current: EpochView | None, epoch: EpochView) -> bool:
    """Whether the lighthouse has moved on past ``epoch``."""
    return current is not None and current.number > epoch.number


def pick_epoch(current: EpochView | None, after: int, replica_id: str) -> EpochView | int:
    """The epoch an attempt may run in: ``current`` if its number is above ``after`` (epochs only go up: a stale
    or reused number is refused) and it has this replica as a member. Otherwise the number to wait above (an
    epoch without this replica is skipped: wait for one that includes it). A replica alone in ``current`` may
    run in it again after it failed there: it has no partner whose next exchange a redo could pair with, and no
    peer to report, so no newer epoch would ever form (docs/gpu.md §3)."""
    if current is not None and current.number > after:
        return current if current.member(replica_id) is not None else current.number
    if current is not None and current.number == after and current.replica_ids == (replica_id,):
        return current
    return after


def no_epoch(current: EpochView | None, after: int, replica_id: str, waited_s: float) -> FTARError:
    """The error when no usable epoch came in time: ``Excluded`` if the lighthouse has an epoch without this
    replica, ``NoEpoch`` otherwise."""
    if current is not None and current.member(replica_id) is None and current.number > 0:
        return Excluded(f"replica {replica_id} is not in epoch {current.number}")
    return NoEpoch(f"no usable epoch after {after} within {waited_s}s")


class LaneState:
    """What a lane remembers across attempts and exchanges: the epoch it last failed in (it never runs in that
    one or an older one again), whether a ``redo=False`` sequence was interrupted, whether it was excluded."""

    def __init__(self, replica_id: str, lane: int) -> None:
        self.replica_id = replica_id
        self.lane = lane
        self.failed_epoch = 0
        self.interrupted: int | None = None
        """The epoch an exchange was interrupted in; every exchange fails until ``reset``."""
        self.excluded = ""
        """Why the lighthouse dropped this replica; every exchange fails with ``Excluded`` from then on."""

    def admit(self) -> None:
        """Start an exchange: refused (``Interrupted``) while an earlier one is interrupted."""
        if self.interrupted is not None:
            raise Interrupted(f"lane {self.lane}: an earlier exchange was interrupted in epoch {self.interrupted}; "
                              f"call reset() before exchanging again", self.interrupted)

    def reset(self) -> None:
        self.interrupted = None

    def exclude(self, reason: str) -> None:
        self.excluded = reason

    def check_excluded(self) -> None:
        if self.excluded:
            raise Excluded(f"replica {self.replica_id}: {self.excluded}")

    def pick(self, current: EpochView | None, after: int | None = None) -> EpochView | int:
        """``pick_epoch`` above the failed epoch (or ``after``); ``Excluded`` once excluded."""
        self.check_excluded()
        return pick_epoch(current, self.failed_epoch if after is None else after, self.replica_id)

    def place(self, epoch: EpochView, group: EpochView | None, new_epoch_ok: bool, redo: bool = True) -> EpochView:
        """The epoch whose group the attempt runs in, given the usable ``epoch`` and the epoch of the group this
        lane holds (``None`` if none).

        A newer epoch with the same data plane (only roles changed, e.g. a joiner turned active) keeps the group:
        every member decides this from the epoch alone, so they all stay together. Mid-sequence
        (``new_epoch_ok=False``) an exchange stays in the group the sequence began in while it is whole (every
        member may be continuing in it); a group that lost a member ends the sequence (``Interrupted``), to be
        redone from its start. A sequence whose caller redoes it after a vote of its own lanes (``redo=False``) does
        not start in a newer epoch that dropped a member of the held group either: another lane of the same
        replica may be failing the same step in the held group, and had this lane paired there with a partner's
        redo, the two replicas would no longer agree on the epoch to redo in (each waiting for the other). It is
        interrupted in the held epoch, like the other lanes, and redone after the vote. Once that vote put the
        held epoch behind it (``reset(after=...)``: the failed epoch is at or above it), the redo leaves the held
        group for the newer epoch with the other lanes: interrupting it again would part this lane from them, and
        a partner split the other way round would wait for it in the newer epoch's rendezvous while it waited
        for the partner's, round after round (found by the simulator, ``fthsdp chaos --sim``)."""
        if group is not None and epoch.number != group.number and epoch.data_plane == group.data_plane:
            epoch = group
        if new_epoch_ok and not redo and group is not None and group.number > self.failed_epoch \
                and group.number != epoch.number and set(group.replica_ids) - set(epoch.replica_ids):
            self.interrupted = group.number
            raise Interrupted(f"lane {self.lane}: epoch {epoch.number} dropped a member of epoch {group.number} "
                              "as the sequence began", group.number)
        if not new_epoch_ok and (group is None or group.number != epoch.number):
            if group is None or set(group.replica_ids) - set(epoch.replica_ids):
                self.interrupted = epoch.number
                raise Interrupted(f"lane {self.lane}: epoch {epoch.number} began mid-sequence", epoch.number)
            epoch = group
        return epoch

    def misfit(self, epoch: EpochView, held: EpochView | None) -> Interrupted:
        """The exchange's contribution does not fit ``epoch``'s group (the caller computed it for another
        membership, e.g. orphan slots dealt under another epoch: ``Request.fits``): it is interrupted before any data
        moves, and so is every exchange queued after it, until ``reset``. Where this lane already exchanged in that
        group (``held`` is it), its partners are past the sequence's start there, so the lane never runs in that
        epoch again (``failed``: its redo waits for a newer one); where it did not, it may come back to it once its
        contribution fits (its partners wait for it there)."""
        self.interrupted = epoch.number
        if held is not None and held.number == epoch.number:
            self.failed(epoch.number)
        return Interrupted(f"lane {self.lane}: the contribution does not fit epoch {epoch.number}'s group (computed "
                           "for another membership)", epoch.number)

    def failed(self, epoch: int) -> None:
        """An attempt in ``epoch`` failed: the next one runs in a newer epoch."""
        self.failed_epoch = epoch

    def misaligned(self, epoch: int, error: Misaligned) -> None:
        """The members disagreed on the tag in ``epoch``. This replica behind: raise, its caller must catch up.
        Ahead: wait for the next epoch (the ones behind leave it)."""
        if error.tag < error.highest:
            raise error
        self.failed(epoch)

    def interrupt(self, epoch: int) -> Interrupted:
        """End a ``redo=False`` exchange that failed in ``epoch``; later ones fail until ``reset``."""
        self.interrupted = epoch
        return Interrupted(f"lane {self.lane}: exchange interrupted in epoch {epoch}", epoch)


# --- after a failure --------------------------------------------------------------------------------------------


class Recovery(enum.Enum):
    """How an exchange goes on after an attempt failed."""

    REDO = "redo"
    """Redo from the intact inputs in the next epoch."""
    RECOMPUTE = "recompute"
    """The inputs were reduced in place: end with ``InputsConsumed`` once the next epoch is known."""
    INTERRUPT = "interrupt"
    """End with ``Interrupted`` (``redo=False``)."""


def recovery(*, redo: bool, keep_inputs: bool, direct: bool) -> Recovery:
    """How an exchange goes on after a failed attempt. ``direct``: the lane's last packing reduced the caller's
    tensors in place."""
    if not keep_inputs and direct:
        return Recovery.RECOMPUTE
    return Recovery.REDO if redo else Recovery.INTERRUPT


class Attempts:
    """Numbers the attempts of one exchange, 1 to ``max_attempts`` (each in its own epoch); asking for one more
    raises ``AttemptsExhausted``."""

    def __init__(self, lane: int, max_attempts: int) -> None:
        self.lane = lane
        self.max_attempts = max_attempts
        self.count = 0

    def next(self) -> int:
        if self.count >= self.max_attempts:
            raise AttemptsExhausted(f"lane {self.lane}: exchange failed in {self.max_attempts} epochs")
        self.count += 1
        return self.count


# --- a collective in flight -------------------------------------------------------------------------------------


class Verdict(enum.Enum):
    """What to do with a collective in flight."""

    WAIT = "wait"
    ABANDON = "abandon"
    """Give it up without blame (newer epoch, closing, excluded)."""
    DEADLINE = "deadline"
    """It missed its deadline: a peer is to blame."""


class CollectiveWatch:
    """When to give up a collective of ``epoch`` started at ``started`` (seconds, any monotonic clock): at its
    deadline; at once when the engine stops (closed or excluded) or a newer epoch dropped one of its members; after
    ``grace_s`` when a newer epoch with a new data plane keeps all its members (a join, a re-formed epoch): every
    member may be in it and it may finish for some, so abandoning it at once could split them (some with the
    result, some without); a member that moved on without it makes it fail anyway."""

    def __init__(self, epoch: EpochView, started: float, timeout_s: float, grace_s: float) -> None:
        self.epoch = epoch
        self.deadline = started + timeout_s + DEADLINE_SLACK_S
        self.grace_s = grace_s
        self.give_up_at: float | None = None

    @property
    def watching(self) -> bool:
        """Whether a pushed epoch can still change the verdict (no give-up time is set yet)."""
        return self.give_up_at is None

    def notice(self, current: EpochView | None, now: float) -> bool:
        """A newer epoch may have been pushed: returns whether ``current`` is one that ends this collective (a
        newer epoch with another data plane); if not, the signal can be cleared."""
        if not newer(current, self.epoch) or current is None or current.data_plane == self.epoch.data_plane:
            return False
        gone = set(self.epoch.replica_ids) - set(current.replica_ids)
        self.give_up_at = now if gone else now + self.grace_s
        return True

    def verdict(self, now: float, *, stopping: bool) -> Verdict:
        if now >= self.deadline:
            return Verdict.DEADLINE
        if stopping:
            return Verdict.ABANDON
        if self.give_up_at is not None and now >= self.give_up_at:
            return Verdict.ABANDON
        return Verdict.WAIT

    def left(self, now: float) -> float:
        """Seconds until the verdict can change by time alone: the deadline, or the give-up time once set."""
        until = self.deadline if self.give_up_at is None else min(self.deadline, self.give_up_at)
        return max(0.0, until - now)


# --- the tag check ----------------------------------------------------------------------------------------------


def alignment_probe(tag: int | None) -> list[int]:
    """What a member contributes to the alignment all-reduce (MAX): ``[tag, -tag]``, so the result holds the
    highest and minus the lowest tag; a joiner sends ``NO_TAG`` twice and counts in neither."""
    return [tag, -tag] if tag is not None else [NO_TAG, NO_TAG]


def agreed_tag(tag: int | None, reduced: Sequence[int], epoch: int, lane: int) -> int:
    """The tag the members agree on, from the reduced probe. ``Misaligned`` if members that know the tag
    disagree; an error if every member is a joiner (nobody knows the step)."""
    highest, lowest = reduced[0], -reduced[1]
    if highest == NO_TAG:
        raise FTARError(f"epoch {epoch}: every member of lane {lane} is a joiner; nobody knows the step")
    if tag is not None and highest != lowest:
        raise Misaligned(tag, lowest, highest)
    return highest


PROOF_DIGIT_BITS = 4
PROOF_DIGITS = 64 // PROOF_DIGIT_BITS
PROOF_MAX = ((1 << PROOF_DIGIT_BITS) - 1) ** 2
"""The largest value in a tag proof: its sums over ``world`` members are exact integers in a float32 buffer while
``world * PROOF_MAX < 2**24`` (74,565 members)."""


def tag_proof(tag: int) -> list[int]:
    """What a member adds to every exchange (SUM), beside the data: for each base-16 digit ``d`` of the tag (64
    bits, two's complement), ``[d, d*d]``. The tag check at a group's start aligns its members; this proves every
    later exchange pairs the same tag on every member. Small integers, so the proof rides in the data's own
    float buffer (``ftar.packing``) instead of a collective of its own."""
    word = tag % (1 << 64)
    out = []
    for i in range(PROOF_DIGITS):
        d = (word >> (PROOF_DIGIT_BITS * i)) & ((1 << PROOF_DIGIT_BITS) - 1)
        out += [d, d * d]
    return out


def proof_holds(tag: int, summed: Sequence[float], world: int) -> bool:
    """Whether every one of the ``world`` members exchanged ``tag``, from the summed ``tag_proof``s: per digit the
    sums are ``world * d`` and ``world * d**2`` exactly when every member sent ``d`` (equality in
    Cauchy-Schwarz), so the digits, hence the tags, all agree."""
    if not all(math.isfinite(x) and float(x).is_integer() for x in summed):
        return False  # not even integers: members summed other data into it (out of step)
    return [int(x) for x in summed] == [world * v for v in tag_proof(tag)]


# --- blame ------------------------------------------------------------------------------------------------------


def missing(ids: Sequence[str], me: str, present: Collection[int] | None) -> list[str]:
    """Members (by rank order ``ids``), other than ``me``, whose rank is not in ``present`` (the ranks that set a
    key). ``present=None`` (the store cannot be read) blames nobody."""
    if present is None:
        return []
    return [rid for rank, rid in enumerate(ids) if rid != me and rank not in present]


@dataclass(frozen=True)
class Blame:
    """The failure reports to send."""

    suspects: tuple[str, ...]
    reason: str
    everyone: bool
    """Nobody was missing: every other member is reported (alive, so not confirmed) to get a re-formed epoch."""
    early: bool = False
    """Send as early reports: acted on only with the suspect's own evidence (``lighthouse.membership``)."""


REPORT_AGAIN_S = 1.0
"""While a lane waits for the epoch its failure reports should bring, it sends them again this often."""


class PendingReports:
    """The last failure's reports, until an epoch newer than the failed one arrives. A report lost on the way (the
    lighthouse restarting, or out of this member's reach, at that moment) would otherwise leave every member
    waiting for an epoch that nobody asked for, then rejoining (found by the simulator, ``fthsdp chaos --sim``).
    A report that did arrive and is sent again is harmless: the lighthouse moved on, so it is stale and refused,
    or it has not yet, so it is the same request."""

    def __init__(self) -> None:
        self.verdict: Blame | None = None
        self.epoch = 0
        self.due_at = 0.0

    def sent(self, verdict: Blame, epoch: int, now: float) -> None:
        """``verdict``'s reports about ``epoch`` went out at ``now`` (early ones are not repeated: they were sent
        because the lighthouse had moved on already)."""
        if verdict.suspects and not verdict.early:
            self.verdict, self.epoch, self.due_at = verdict, epoch, now + REPORT_AGAIN_S
        else:
            self.verdict = None

    @property
    def asking(self) -> int:
        """The epoch these reports ask the lighthouse to move past (0: none pending). A replica whose lanes ask
        for nothing above the newest epoch they used must ask for a re-formed one (``reform``)."""
        return self.epoch if self.verdict is not None else 0

    def reform(self, epoch: EpochView, me: str, now: float) -> None:
        """The replica's vote put ``epoch`` behind its lanes although none of them failed there (they exchanged
        the step in different epochs): nobody will report anything, so unless a newer epoch comes within
        ``REPORT_AGAIN_S``, ask for a re-formed one by reporting every other member, as a failure with nobody to
        blame does (found by the simulator: the lanes waited for an epoch nobody asked for, then rejoined)."""
        others = tuple(rid for rid in epoch.replica_ids if rid != me)
        if others and (self.verdict is None or self.epoch < epoch.number):
            self.verdict = Blame(others, "this replica's lanes exchanged the step in different epochs", True)
            self.epoch, self.due_at = epoch.number, now + REPORT_AGAIN_S

    def due(self, current: EpochView | None, now: float) -> Blame | None:
        """The reports to send again at ``now``, if due; an epoch newer than the failed one ends them."""
        if self.verdict is None:
            return None
        if current is not None and current.number > self.epoch:
            self.verdict = None
            return None
        if now < self.due_at:
            return None
        self.due_at = now + REPORT_AGAIN_S
        return self.verdict


def blame(epoch: EpochView, current: EpochView | None, me: str, suspects: Sequence[str], reason: str) -> Blame:
    """Whom to report after a failure in ``epoch``. If the lighthouse already moved on (another member's death
    formed the epoch), only the suspects still in its epoch, as early reports: two members that died at once are
    both confirmed by their evidence, a live one is left alone. Else the members that did not check in
    (``suspects``); if everyone checked in, the data plane is broken all the same, so every other member, which
    makes the lighthouse re-form the epoch and everyone rebuild."""
    if newer(current, epoch):
        assert current is not None
        return Blame(tuple(s for s in suspects if current.member(s) is not None), reason, False, early=True)
    if suspects:
        return Blame(tuple(suspects), reason, False)
    return Blame(tuple(rid for rid in epoch.replica_ids if rid != me), f"nobody to blame: {reason}", True)
