"""The trainer-facing runtime: FSDP2 inside the replica, FTAR across replicas, and the commit protocol."""

from fthsdp.runtime.replica import (EXIT_REJOIN, NoStateToResume, RejoinRequired, Replica, SlotConflict,
                                    StateMismatch, StepResult, Terminated)

__all__ = ["EXIT_REJOIN", "NoStateToResume", "RejoinRequired", "Replica", "SlotConflict", "StateMismatch",
           "StepResult", "Terminated"]
