"""Typed errors of the lighthouse, its stores and its clients."""

from __future__ import annotations


class LighthouseError(Exception):
    """Base of every error the lighthouse client raises."""


class InvalidRequest(LighthouseError):
    """The lighthouse refused the request as malformed (INVALID_ARGUMENT, RESOURCE_EXHAUSTED)."""


class AtCapacity(InvalidRequest):
    """The request exceeds a limit of the lighthouse (RESOURCE_EXHAUSTED: a job at its members' limit, a message
    too large); unlike a malformed one, the same registration may be taken later (members that fall silent go)."""


class UnknownTarget(LighthouseError):
    """Unknown job, or a replica that is not (or no longer) registered (NOT_FOUND)."""


class FencedOut(LighthouseError):
    """The request was made under a stale epoch or incarnation (FAILED_PRECONDITION)."""


class JobOver(FencedOut):
    """The caller's incarnation is over because the job finished at ``step`` (FAILED_PRECONDITION whose message
    begins ``lighthouse.incarnations.JOB_FINISHED_AT``): it must not train; the job's final state is that step's."""

    def __init__(self, message: str, step: int) -> None:
        super().__init__(message)
        self.step = step


class Busy(LighthouseError):
    """The lighthouse cannot do this now; retry later (ABORTED), e.g. another replica is joining."""


class HeldOut(Busy):
    """A replica ejected as slow may not enter the data plane yet: its probe step was still as slow (ABORTED,
    ``lighthouse.ejection.held_out``). Probe again, then retry."""


class Unauthenticated(LighthouseError):
    """Wrong or missing credentials (UNAUTHENTICATED, PERMISSION_DENIED)."""


class LighthouseUnavailable(LighthouseError):
    """No lighthouse answered within the deadline (UNAVAILABLE, DEADLINE_EXCEEDED)."""


class SessionsUnsupported(LighthouseUnavailable):
    """The lighthouse has no ``Session`` method (UNIMPLEMENTED: an older one): heartbeat and watch apart."""


class EpochFenced(LighthouseError):
    """A store write was fenced: another writer advanced the job's epoch first."""


class StoreUnavailable(LighthouseError):
    """The durable store (etcd) did not answer within its deadline; nothing was written."""


class StoreAccessDenied(StoreUnavailable):
    """The store refused this lighthouse's connection (TLS handshake, client certificate): a configuration error
    that waiting will not fix; the message says what to give."""


class NotLeader(LighthouseUnavailable):
    """This lighthouse does not lead (HA on etcd); ``leader`` is where the leader is, when known."""

    def __init__(self, message: str, leader: str = "") -> None:
        super().__init__(message)
        self.leader = leader


class ValidationError(ValueError):
    """A field of a request is malformed; the message names the field (answered as INVALID_ARGUMENT)."""


class SecurityConfigError(ValueError):
    """A TLS or token option is unusable (missing file, empty token, cert without key...)."""
