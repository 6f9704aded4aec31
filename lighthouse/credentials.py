"""Who a caller is and what it may do: the job secret, per-replica credentials and read-only credentials.

The lighthouse holds the job secret (``--token-file``). Everything else is derived from it by HMAC, so the
lighthouse verifies a credential without a table of them, and a holder of one credential cannot make another:

- the **job secret** itself: may do everything (the lighthouse's operators, ``fthsdp emulate``, tools);
- a **replica credential** ``fthsdp1/replica/<job>/<replica>/<mac>``: speaks for that replica group of that job
  only (registers it, heartbeats, reports as it, leaves as it), reads the job's status and uses its data-plane
  rendezvous; every ``replica_id`` it names must be its own;
- a **reader credential** ``fthsdp1/reader/<job or *>/<mac>``: ``Status``, ``Watch``, ``/status``, ``/metrics``
  (for Prometheus and dashboards), nothing that changes anything.

Replicas also need a key they share to prove membership to each other's catch-up servers
(``fthsdp.catchup.auth``): ``catchup_key(secret, job)``, carried on the second line of a replica's credential
file (``credential_file``). Pure functions; reading files is ``lighthouse.security``'s.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from dataclasses import dataclass

from lighthouse.validate import ID_RE

VERSION = "fthsdp1"
"""The first field of every derived credential (a later format gets another)."""
ALL_JOBS = "*"
"""A reader credential's job for every job of the lighthouse."""
_CONTEXT = b"fthsdp-credential"
_CATCHUP_CONTEXT = b"fthsdp-catchup"


class Role(enum.Enum):
    JOB = "job"
    """The job secret: everything."""
    REPLICA = "replica"
    """One replica group of one job."""
    READER = "reader"
    """Read-only: status and metrics."""


@dataclass(frozen=True)
class Principal:
    """An authenticated caller: its role, and the job (``*``: every job) and replica it is bound to."""

    role: Role
    job: str = ALL_JOBS
    replica: str = ""

    def __str__(self) -> str:
        if self.role is Role.JOB:
            return "the job secret"
        if self.role is Role.READER:
            return f"a read-only credential for job {self.job!r}"
        return f"replica {self.replica!r}'s credential (job {self.job!r})"


JOB_PRINCIPAL = Principal(Role.JOB)

READ_METHODS = frozenset({"Status", "Watch"})
"""The lighthouse methods a reader credential may call (its HTTP port is read-only as a whole)."""
SPEAKS_AS = {"Register": "replica_id", "Heartbeat": "replica_id", "Session": "replica_id", "Ready": "replica_id",
             "Leave": "replica_id", "ReportFailure": "reporter_replica_id", "Watch": "replica_id"}
"""The methods that name the replica they act as, and the field that names it."""


def _mac(secret: str, *fields: str) -> str:
    return hmac.new(secret.encode(), b"\0".join([_CONTEXT, *(f.encode() for f in fields)]),
                    hashlib.sha256).hexdigest()


def _check(kind: str, value: str) -> None:
    if not ID_RE.fullmatch(value):
        raise ValueError(f"{kind} {value!r} is not a valid identifier (lighthouse.validate.ID_RE)")


def replica_credential(secret: str, job: str, replica: str) -> str:
    """The credential of replica group ``replica`` of ``job``."""
    _check("job", job)
    _check("replica", replica)
    return "/".join((VERSION, Role.REPLICA.value, job, replica, _mac(secret, Role.REPLICA.value, job, replica)))


def reader_credential(secret: str, job: str = ALL_JOBS) -> str:
    """A read-only credential for ``job`` (default: every job of the lighthouse)."""
    if job != ALL_JOBS:
        _check("job", job)
    return "/".join((VERSION, Role.READER.value, job, _mac(secret, Role.READER.value, job, "")))


def catchup_key(secret: str, job: str) -> str:
    """The key the replicas of ``job`` prove membership to each other's catch-up servers with."""
    return hmac.new(secret.encode(), b"\0".join([_CATCHUP_CONTEXT, job.encode()]), hashlib.sha256).hexdigest()


def credential_file(secret: str, job: str, replica: str) -> str:
    """What a replica group's credential file holds: its credential, then ``fthsdp1/catchup/<job>/<key>``."""
    return (f"{replica_credential(secret, job, replica)}\n"
            f"{VERSION}/catchup/{job}/{catchup_key(secret, job)}\n")


def is_derived(value: str) -> bool:
    """Whether ``value`` is a derived credential (not a job secret)."""
    return value.startswith(VERSION + "/")


def parse_catchup_line(line: str, job: str) -> str:
    """The catch-up key on a credential file's second line, which must be for ``job``."""
    parts = line.split("/")
    if len(parts) != 4 or parts[0] != VERSION or parts[1] != "catchup" or not parts[3]:
        raise ValueError("the second line is not a catch-up key (fthsdp1/catchup/<job>/<key>)")
    if parts[2] != job:
        raise ValueError(f"the catch-up key is for job {parts[2]!r}, not {job!r}")
    return parts[3]


def identify(secret: str, presented: str) -> Principal | None:
    """Who presents ``presented`` (the job secret or a credential derived from it); None: nobody we know. Every
    comparison is in constant time."""
    value = presented.removeprefix("Bearer ")
    if hmac.compare_digest(value.encode("ascii", "replace"), secret.encode("ascii", "replace")):
        return JOB_PRINCIPAL
    if not is_derived(value):
        return None
    parts = value.split("/")
    if len(parts) == 5 and parts[1] == Role.REPLICA.value:
        role, job, replica = Role.REPLICA, parts[2], parts[3]
        if not (ID_RE.fullmatch(job) and ID_RE.fullmatch(replica)):
            return None
    elif len(parts) == 4 and parts[1] == Role.READER.value:
        role, job, replica = Role.READER, parts[2], ""
        if job != ALL_JOBS and not ID_RE.fullmatch(job):
            return None
    else:
        return None
    if not hmac.compare_digest(parts[-1].encode("ascii", "replace"), _mac(secret, role.value, job, replica).encode()):
        return None
    return Principal(role, job, replica)


def refusal(who: Principal, method: str, job: str, replica: str = "") -> str | None:
    """Why ``who`` may not call ``method`` (a lighthouse or ``Rendezvous.*`` method) on ``job`` naming ``replica``
    as itself; None: it may."""
    if who.role is Role.JOB:
        return None
    if who.job != ALL_JOBS and job != who.job:
        return f"{who} is not valid for job {job[:64]!r}"
    if who.role is Role.READER:
        if method in READ_METHODS:
            return None
        return f"{who} may only read (Status, Watch, /status, /metrics), not call {method}"
    if method in SPEAKS_AS and replica and replica != who.replica:
        return f"{who} cannot speak for replica {replica[:64]!r}"
    if method in SPEAKS_AS and not replica and method != "Watch":
        return f"{who} must name its own replica in {method}"
    return None
