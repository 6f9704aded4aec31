"""Failure injection for tests and demos: ``FTHSDP_FAULT=STEP:PHASE`` makes rank 0 SIGKILL its whole replica
group (the torchrun agent, hence every worker) when it reaches PHASE of STEP or of the first step after it (a
replica that joins late starts past STEP). Phases (``Phase``): the step's forward, backward, exchange (its buckets
in flight, none collected), exchange-late (half of them collected), vote, optimizer (``STEP_PHASES``); and
catch-up's (``CATCHUP_PHASES``) ``serve`` (while this replica streams a catch-up snapshot to a joiner, STEP
being the snapshot's step) and ``fetch`` (while this joining replica fetches one). ``STEP:selfcheck`` kills
nothing: the incarnation fails its start-up self-check (``fthsdp.runtime.selfcheck``).

``FTHSDP_FAULT_FILE=PATH`` (the chaos runner's switch) arms a fault while the replica runs: rank 0 reads
``STEP:PHASE`` from PATH whenever the file changes (one ``stat`` per phase) and fires as above; an absent or empty
file disarms it.

Every rank's catch-up server also takes two test hooks: ``FTHSDP_FAULT_SLOW_SERVE_S`` (a slow link: sleep that
long after every chunk sent) and ``FTHSDP_FAULT_CORRUPT_CHUNKS=N`` (flip a byte in the first N chunks sent; the
joiner must detect them and fetch them again).

``FTHSDP_FAULT_SLOW=STEP:FACTOR[:RANK]`` (set for one replica group) makes every rank of it, or only rank RANK,
compute FACTOR times as long from STEP on (fail-slow): as its backward begins it computes (spins on its CPU, as a
slow device's rank is busy) FACTOR - 1 times its previous step's own compute time, so its buckets reach FTAR that
much later and the others wait for them (its siblings in their collectives with it).

``FTHSDP_FAULT_SLOW_LINK=STEP:SECONDS[:RANK]`` (set for one replica group) makes the lane of every rank of it, or
of rank RANK only, a slow link from STEP on: its FTAR thread sleeps SECONDS before each collective it starts, so
that lane's members wait for it inside the collective while its compute is as fast as ever.

``FTHSDP_FAULT_CORRUPT=STEP`` (set for one replica group) makes its rank 0 flip the lowest bit of one byte of its
first parameter shard right after committing STEP (not while replaying it as a joiner): silent corruption, which
the replicas' periodic state-digest check (``FTHSDP_DIGEST_EVERY``) must find within K steps.

``FTHSDP_FAULT_HOLD_READY=PATH`` (tests only) makes a joining replica's rank 0 wait until PATH exists before it
asks to enter the data plane (``Ready(JOINING)``): a test holds a registered joiner there while the job ends.

``FTHSDP_FAULT_HOLD_UNTIL=STEP:MEMBERS[:SECONDS]`` (tests only; every rank of every replica given it) makes a
training rank wait, before step STEP's forward and each one after, while the newest epoch it knows has fewer than
MEMBERS members (any role: a joiner is one once it entered the data plane) and none of them is joining (its
catch-up needs the others' steps), at most SECONDS in all (default 120), then go on either way. Between steps no
collective's deadline runs, so the wait costs nothing but time: a test holds the others there so that the replicas
it killed are back in the job before it ends, however slow the machine, instead of counting on its pace. A spare's
zero steps hold at the same place (else it would wait for the held ones inside its next exchange); a joiner's
catch-up never holds (while one is joining nobody does).

The runtime's settings builder (``fthsdp.runtime.config``) reads these variables into ``FaultSettings``."""

from __future__ import annotations

import enum
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fthsdp.runtime import filewait
from lighthouse.epoch_view import EpochView
from lighthouse.model import JOINING

if TYPE_CHECKING:
    from ftar.membership import EpochFeed

HOLD_S = 120.0
"""``FTHSDP_FAULT_HOLD_UNTIL``'s wait, at most, when it names none."""


class Phase(enum.StrEnum):
    """Where a fault can fire."""

    FORWARD = "forward"
    BACKWARD = "backward"
    EXCHANGE = "exchange"
    EXCHANGE_LATE = "exchange-late"
    """Half way through collecting the step's buckets: some lanes of some replicas have completed the step."""
    VOTE = "vote"
    OPTIMIZER = "optimizer"
    SERVE = "serve"
    FETCH = "fetch"
    SELFCHECK = "selfcheck"
    """Not a kill: the incarnation's start-up self-check fails (``fthsdp.runtime.selfcheck``)."""


STEP_PHASES: tuple[Phase, ...] = (Phase.FORWARD, Phase.BACKWARD, Phase.EXCHANGE, Phase.EXCHANGE_LATE, Phase.VOTE,
                                   Phase.OPTIMIZER)
"""The phases of a training step, in order."""
CATCHUP_PHASES: tuple[Phase, ...] = (Phase.SERVE, Phase.FETCH)
"""The phases of a catch-up: a source serving a snapshot, a joiner fetching it."""
PHASES: tuple[Phase, ...] = STEP_PHASES + CATCHUP_PHASES
"""Where a kill can fire (what the chaos runner draws from)."""


@dataclass(frozen=True)
class FaultSettings:
    """The fault hooks' settings (tests and demos only; all off by default)."""

    spec: str = ""
    """``FTHSDP_FAULT``: ``STEP[:PHASE]``, parsed by rank 0 only."""
    path: str = ""
    """``FTHSDP_FAULT_FILE``: a file to read a fault from while running."""
    slow_serve_s: float = 0.0
    """``FTHSDP_FAULT_SLOW_SERVE_S``: sleep after every catch-up chunk sent."""
    corrupt_chunks: int = 0
    """``FTHSDP_FAULT_CORRUPT_CHUNKS``: flip a byte in the first N catch-up chunks sent."""
    corrupt_step: int = -1
    """``FTHSDP_FAULT_CORRUPT``: rank 0 corrupts a parameter after committing this step (-1: never)."""
    kill_agent: bool = False
    """Under torchrun (``TORCHELASTIC_RUN_ID`` set): a fault kills the agent too (its workers follow)."""
    slow: str = ""
    """``FTHSDP_FAULT_SLOW``: ``STEP:FACTOR[:RANK]``, every rank (or rank RANK) computes FACTOR times as long from
    STEP on."""
    slow_link: str = ""
    """``FTHSDP_FAULT_SLOW_LINK``: ``STEP:SECONDS[:RANK]``, every rank's lane (or rank RANK's) waits SECONDS before
    each collective from STEP on."""
    hold_ready: str = ""
    """``FTHSDP_FAULT_HOLD_READY``: a joiner's rank 0 waits for this file before its Ready(JOINING)."""
    hold_until: str = ""
    """``FTHSDP_FAULT_HOLD_UNTIL``: ``STEP:MEMBERS[:SECONDS]``, ranks wait from STEP on for an epoch of MEMBERS."""


@dataclass(frozen=True)
class FaultInjector:
    step: int = -1
    phase: str = ""
    armed: bool = False
    path: str = ""
    """``FTHSDP_FAULT_FILE``: a fault armed from outside while running."""
    kill_agent: bool = False
    slow_serve_s: float = 0.0
    corrupt_chunks: int = 0
    corrupt_step: int = -1
    """Rank 0: the step after whose commit the state is corrupted (``FTHSDP_FAULT_CORRUPT``; -1: never)."""
    slow_from: int = -1
    slow_factor: float = 1.0
    """``FTHSDP_FAULT_SLOW``: from step ``slow_from`` on (-1: never), compute ``slow_factor`` times as long."""
    link_from: int = -1
    link_delay_s: float = 0.0
    """``FTHSDP_FAULT_SLOW_LINK``: from step ``link_from`` on (-1: never), each collective of this rank's lane
    starts ``link_delay_s`` late."""
    hold_ready: str = ""
    """``FTHSDP_FAULT_HOLD_READY``: rank 0 waits for this file before a Ready(JOINING) ('': never)."""
    hold_step: int = -1
    hold_members: int = 0
    hold_s: float = 0.0
    """``FTHSDP_FAULT_HOLD_UNTIL``: from step ``hold_step`` on (-1: never) wait, up to ``hold_s`` in all, for an
    epoch of ``hold_members`` members (``hold``)."""
    _file: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """What ``path`` held when last read: its inode, mtime and size, and the fault parsed from it (or None)."""
    _held: dict[str, float] = field(default_factory=dict, compare=False, repr=False)
    """``hold``'s seconds held so far (``s``)."""
    _seen: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    """The step the training thread last reached a phase of (``at``): the lane's thread reads it."""

    @classmethod
    def for_rank(cls, settings: FaultSettings, rank: int) -> FaultInjector:
        """Rank 0 fires faults (``spec``, ``path``); every rank's catch-up server takes the serve hooks."""
        armed = bool(settings.spec) and rank == 0
        step, phase = _parse(settings.spec) if armed else (-1, "")
        slow_from, slow_factor, slow_rank = parse_slow(settings.slow) if settings.slow else (-1, 1.0, None)
        if slow_rank is not None and slow_rank != rank:
            slow_from = -1
        link_from, link_delay_s, link_rank = parse_slow(settings.slow_link, link=True) if settings.slow_link \
            else (-1, 0.0, None)
        if link_rank is not None and link_rank != rank:
            link_from = -1
        hold_step, hold_members, hold_s = parse_hold(settings.hold_until) if settings.hold_until else (-1, 0, 0.0)
        return cls(step, phase, armed, settings.path if rank == 0 else "", kill_agent=settings.kill_agent,
                   slow_serve_s=settings.slow_serve_s, corrupt_chunks=settings.corrupt_chunks,
                   corrupt_step=settings.corrupt_step if rank == 0 else -1, slow_from=slow_from,
                   slow_factor=slow_factor, link_from=link_from, link_delay_s=link_delay_s,
                   hold_ready=settings.hold_ready if rank == 0 else "", hold_step=hold_step,
                   hold_members=hold_members, hold_s=hold_s)

    def before_ready(self) -> None:
        """``FTHSDP_FAULT_HOLD_READY``: rank 0 of a joiner, before its Ready(JOINING), waits for the file (no
        deadline: a test's process, which ends with its job)."""
        if self.hold_ready:
            filewait.wait_until_exists(self.hold_ready)

    def hold(self, step: int, feed: EpochFeed, log: Callable[..., None]) -> None:
        """``FTHSDP_FAULT_HOLD_UNTIL``: before the forward of ``step``, from the hold's step on, wait for ``feed``'s
        epochs while the newest has fewer than ``hold_members`` members and none of them is joining: a joiner in
        the data plane needs the others' steps to catch up, and the lighthouse lets one in at a time, so with two
        groups down the others step while the first catches up and hold again until the second is in. The rule
        reads the epoch alone, so every rank of every replica holds at the same steps (a rank that went on would
        wait in a collective for one still held). At most ``hold_s`` in all. Said (a warning: a test hook that
        changes the job's timing) at the hold's step and whenever it waited."""
        held = self._held.get("s", 0.0)
        if self.hold_step < 0 or step < self.hold_step or held >= self.hold_s:
            return

        def go(epoch: EpochView | None) -> bool:
            return epoch is not None and (len(epoch.members) >= self.hold_members
                                          or any(m.role == JOINING for m in epoch.members))

        if step > self.hold_step and go(feed.current()):
            return
        t0 = time.monotonic()
        epoch = feed.wait_until(go, self.hold_s - held)
        waited = time.monotonic() - t0
        self._held["s"] = held = held + waited
        n = len(epoch.members) if epoch is not None else 0
        log(logging.WARNING, "held before step %d for %.1fs (FTHSDP_FAULT_HOLD_UNTIL, %.1fs in all): %s", step,
            waited, held, f"an epoch of {n} members" if n >= self.hold_members else "a member is joining"
            if go(epoch) else f"no epoch of {self.hold_members} members within {self.hold_s:g}s in all, going on")

    def slow_down(self, step: int, compute_s: float) -> float:
        """``FTHSDP_FAULT_SLOW``: as the backward of ``step`` begins, compute (spin) ``slow_factor - 1`` times
        ``compute_s`` (the previous step's own compute time) once ``step`` is past ``slow_from``. Returns the
        seconds spent."""
        if self.slow_from < 0 or step < self.slow_from or compute_s <= 0:
            return 0.0
        extra = (self.slow_factor - 1.0) * compute_s
        end = time.perf_counter() + extra
        while time.perf_counter() < end:  # emulated slow compute: busy, as a slow device's rank is
            pass
        return extra

    @property
    def link_hook(self) -> Callable[[int], None] | None:
        """The lane engine's ``before_collective`` hook for ``FTHSDP_FAULT_SLOW_LINK`` (None: no slow link here)."""
        return self._slow_link if self.link_from >= 0 else None

    def _slow_link(self, tag: int) -> None:
        if self._seen.get("step", -1) >= self.link_from:
            time.sleep(self.link_delay_s)  # a simulated slow link, not synchronisation

    @property
    def fails_selfcheck(self) -> bool:
        """``FTHSDP_FAULT=STEP:selfcheck``: this incarnation's self-check fails (rank 0's; the ranks agree)."""
        return self.armed and self.phase == Phase.SELFCHECK

    def corrupts(self, step: int) -> bool:
        """Whether to corrupt the state right after committing ``step`` (``FTHSDP_FAULT_CORRUPT``)."""
        return step == self.corrupt_step >= 0

    def _from_file(self) -> tuple[int, str] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            self._file.clear()
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)  # the runner replaces it atomically: a new inode
        if self._file.get("key") != key:
            try:
                with open(self.path) as f:
                    spec = f.read().strip()
            except OSError:
                return None
            try:
                fault = _parse(spec) if spec else None
            except ValueError:  # written by the runner atomically; a bad one arms nothing
                fault = None
            self._file.update(key=key, fault=fault)
        return self._file.get("fault")

    def at(self, step: int, phase: Phase) -> None:
        self._seen["step"] = step
        fault = self._from_file() if self.path else None
        if fault is not None and step >= fault[0] and phase == fault[1]:
            self._kill()
        if self.armed and step >= self.step and phase == self.phase:
            self._kill()

    def _kill(self) -> None:
        if self.kill_agent:
            os.kill(os.getppid(), signal.SIGKILL)  # the agent; workers follow (PDEATHSIG)
        os.kill(os.getpid(), signal.SIGKILL)

    def on_chunk_sent(self, step: int, nbytes: int) -> None:
        """After each chunk a catch-up server sends: the ``serve`` fault, and the slow link."""
        self.at(step, Phase.SERVE)
        if self.slow_serve_s > 0:
            time.sleep(self.slow_serve_s)  # a simulated slow link, not synchronisation

    def corrupter(self) -> Callable[[int, int, bytearray], bool] | None:
        """The catch-up server's ``corrupt`` hook: flips a byte in the first ``corrupt_chunks`` chunks."""
        if self.corrupt_chunks <= 0:
            return None
        left = [self.corrupt_chunks]

        def corrupt(entry: int, offset: int, data: bytearray) -> bool:
            if left[0] <= 0 or not data:
                return False
            left[0] -= 1
            data[len(data) // 2] ^= 0xFF
            return True

        return corrupt


def parse_slow(spec: str, link: bool = False) -> tuple[int, float, int | None]:
    """``STEP:FACTOR[:RANK]`` of ``FTHSDP_FAULT_SLOW`` (1 <= FACTOR <= 100), or with ``link`` ``STEP:SECONDS[:RANK]``
    of ``FTHSDP_FAULT_SLOW_LINK`` (0 < SECONDS <= 10); RANK: only that rank, else every rank. ``ValueError``
    otherwise."""
    parts = spec.split(":")
    try:
        step, value = int(parts[0]), float(parts[1])
        rank = int(parts[2]) if len(parts) == 3 else None
    except (ValueError, IndexError):
        step, value, rank = -1, 0.0, None
    ok = 0.0 < value <= 10.0 if link else 1.0 <= value <= 100.0
    if not 2 <= len(parts) <= 3 or step < 0 or not ok or (rank is not None and rank < 0):
        name, unit, bound = ("FTHSDP_FAULT_SLOW_LINK", "SECONDS", "0 < SECONDS <= 10") if link else \
            ("FTHSDP_FAULT_SLOW", "FACTOR", "1 <= FACTOR <= 100")
        raise ValueError(f"{name}={spec!r}: expected STEP:{unit}[:RANK], a step >= 0, {bound} and a rank >= 0")
    return step, value, rank


def parse_hold(spec: str) -> tuple[int, int, float]:
    """``STEP:MEMBERS[:SECONDS]`` of ``FTHSDP_FAULT_HOLD_UNTIL`` (a step >= 0, members >= 1, 0 < SECONDS <= 600,
    by default 120). ``ValueError`` otherwise."""
    parts = spec.split(":")
    try:
        step, members = int(parts[0]), int(parts[1])
        seconds = float(parts[2]) if len(parts) == 3 else HOLD_S
    except (ValueError, IndexError):
        step, members, seconds = -1, 0, 0.0
    if not 2 <= len(parts) <= 3 or step < 0 or members < 1 or not 0.0 < seconds <= 600.0:
        raise ValueError(f"FTHSDP_FAULT_HOLD_UNTIL={spec!r}: expected STEP:MEMBERS[:SECONDS], a step >= 0, "
                         "members >= 1 and 0 < SECONDS <= 600")
    return step, members, seconds


def _parse(spec: str) -> tuple[int, str]:
    step, _, phase = spec.partition(":")
    phase = phase or "forward"
    if phase not in (*PHASES, Phase.SELFCHECK):
        raise ValueError(f"FTHSDP_FAULT phase {phase!r} is not one of "
                         f"{tuple(str(p) for p in (*PHASES, Phase.SELFCHECK))}")
    return int(step), phase
