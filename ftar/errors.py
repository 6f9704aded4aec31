"""Typed errors of FTAR."""

from __future__ import annotations


class FTARError(RuntimeError):
    """Base of every error an exchange can end with."""


class NoEpoch(FTARError):
    """No usable epoch arrived from the lighthouse within the deadline."""


class Excluded(FTARError):
    """This replica is not a member of the current epoch (declared dead, or not ready yet)."""


class Misaligned(FTARError):
    """The members of the lane called with different tags (steps) after an epoch change: this replica is
    behind the others and must catch up (its state is stale); the ones ahead wait for the next epoch."""

    def __init__(self, tag: int, lowest: int, highest: int) -> None:
        super().__init__(f"lane members disagree on the tag: mine {tag}, lowest {lowest}, highest {highest}")
        self.tag, self.lowest, self.highest = tag, lowest, highest


class InputsConsumed(FTARError):
    """An exchange with ``keep_inputs=False`` failed after reducing the inputs in place: recompute them and call
    again (under ``next_epoch`` or later)."""

    def __init__(self, message: str, next_epoch: int) -> None:
        super().__init__(message)
        self.next_epoch = next_epoch


class Interrupted(FTARError):
    """An exchange with ``redo=False`` failed (inputs intact); the engine refuses exchanges until ``reset()``."""

    def __init__(self, message: str, epoch: int) -> None:
        super().__init__(message)
        self.epoch = epoch


class AttemptsExhausted(FTARError):
    """The exchange failed in every epoch it was tried in, up to the configured number of attempts."""


class EngineClosed(FTARError):
    """The engine was closed while the exchange was pending."""


# --- inside the engine: how an attempt ends, never delivered to a caller ---------------------------------------


class Abandoned(Exception):
    """The attempt was given up without a peer at fault: a newer epoch was pushed, the engine closed, or the
    replica was excluded."""


class PeerFailure(Exception):
    """The attempt's collective (or rendezvous) failed or missed its deadline: a peer is to blame."""
