"""A replica group watches its own ranks (docs/design.md §4, "A rank that fails alone"): one rank hung or dead
while its siblings and its torchrun agent live used to stall every other replica for as long as it hung, since
rank 0's heartbeats vouched for the whole group.

Every rank bumps a counter of its own in the group's torchrun store every ``interval_s`` (``fthsdp/alive/<replica>/
<incarnation>/<rank>``, from a thread of its own, on a connection of its own). Rank 0 reads every other rank's
counter at the same pace; the other ranks read rank 0's. A counter that has not moved for ``limit_s`` names a
rank that is stopped, dead or wedged with the interpreter lock held: ``on_silent(rank, silent_s)`` then ends the
replica as a whole (``end_replica``: the replica leaves the job naming the rank, so the others' epoch forms at
once, then this rank exits; torchrun's agent ends the rest). A rank that closes adds ``CLOSED`` to its counter:
from then on its silence is expected. Costs: one ``add`` per rank per interval and one ``multi_get`` of S - 1
counters on rank 0.

torchrun's store is unauthenticated: whoever reaches it can make a silent rank look alive (an ``add``), which only
delays this check (the lighthouse's own rules remain), but cannot make a live one look silent while it stamps.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from ftar.devices import start_thread
from fthsdp.launch import procutil
from fthsdp.runtime import startup
from fthsdp.runtime.epoch_relay import group_store
from lighthouse.client import LighthouseClient

log = logging.getLogger("fthsdp.runtime")

CLOSED = 1 << 40
"""Added to a rank's counter when it closes: a counter at or above it is not watched."""
EXIT_RANK_LOST = 76
"""Exit status of a rank that ended its replica because a sibling fell silent (the launcher restarts the group)."""


class Silence:
    """Pure: which watched ranks' counters have not moved for ``limit_s`` (time and readings come in)."""

    def __init__(self, ranks: tuple[int, ...], limit_s: float, now: float) -> None:
        if limit_s <= 0:
            raise ValueError(f"a rank's silence limit must be positive, not {limit_s}")
        self.limit_s = limit_s
        self._last: dict[int, tuple[int | None, float]] = {r: (None, now) for r in ranks}
        """Per watched rank: its last reading, and when that reading first came (unseen: since the watch began)."""
        self._looked = now

    def observe(self, now: float, readings: Mapping[int, int]) -> list[tuple[int, float]]:
        """The watched ranks silent for ``limit_s`` or more at ``now``, as (rank, seconds), given their counters
        (a rank missing from ``readings`` has not moved). A closed rank is no longer watched. A watcher whose own
        previous look was more than half the limit ago was stopped itself (the whole group, or the host, paused):
        it cannot tell who else was, so every clock starts over."""
        paused, self._looked = now - self._looked > self.limit_s / 2, now
        late = []
        for r, (value, since) in list(self._last.items()):
            got = readings.get(r, value)
            if got is not None and got >= CLOSED:
                del self._last[r]
            elif got != value or paused:
                self._last[r] = (got, now)
            elif now - since >= self.limit_s:
                late.append((r, now - since))
        return late


def watch(client: LighthouseClient, rank: int, world_size: int, limit_s: float, log_line: Callable[..., None],
          device: torch.device) -> SiblingWatch:
    """This rank's watch, started: a sibling silent for ``limit_s`` ends the replica (``end_replica``). A collective
    over the replica's ranks (``processes``): every rank calls it, in the same order."""
    procs = processes(world_size, device)
    w = SiblingWatch(client.replica_id, client.incarnation, rank, world_size, limit_s=limit_s,
                     on_silent=functools.partial(end_replica, client, procs, log_line))
    w.start()
    return w


def processes(world_size: int, device: torch.device) -> list[tuple[str, int]]:
    """Every rank's (host name, pid), agreed over the replica's process group (a collective: every rank calls it)."""
    out = startup.gather_strings(f"{socket.gethostname()} {os.getpid()}", world_size, device)
    return [(host, int(pid)) for host, _, pid in (x.rpartition(" ") for x in out)]


def end_replica(client: LighthouseClient, processes: list[tuple[str, int]], log_line: Callable[..., None],
                rank: int, silent_s: float) -> None:
    """``rank`` of this replica fell silent: leave the job naming it (any rank may: it speaks for the replica's
    incarnation; the others' next epoch then forms at once), SIGKILL it if it is a process of this host under the
    same torchrun agent (a stopped one would hold its agent's teardown for 30 s), and exit ``EXIT_RANK_LOST``:
    torchrun's agent ends the other ranks and the launcher restarts the group as a new incarnation."""
    reason = f"rank {rank} silent for {silent_s:.1f} s (hung or dead): the replica restarts as a whole"
    log_line(logging.ERROR, "%s", reason)
    try:
        client.leave(reason)
    except Exception as e:  # noqa: BLE001 -- whatever it was, the replica must still end; the others then wait
        log_line(logging.WARNING, "could not leave the job: %s", e)  # for its silence or its closed session
    host, pid = processes[rank] if rank < len(processes) else ("", -1)
    if host == socket.gethostname() and pid > 0 and procutil.parent(pid) == os.getppid():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    logging.shutdown()
    os._exit(EXIT_RANK_LOST)


class SiblingWatch:
    """One rank's part: its own counter, and its watch over rank 0's (rank 0: over every other rank's)."""

    def __init__(self, replica_id: str, incarnation: str, rank: int, world_size: int, *, limit_s: float,
                 on_silent: Callable[[int, float], None],
                 store: Callable[[str], dist.Store] = group_store,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rank, self.limit_s, self.on_silent, self._clock = rank, limit_s, on_silent, clock
        self.interval_s = min(0.5, limit_s / 4)
        self.watched = tuple(range(1, world_size)) if rank == 0 else (0,)
        self.enabled = world_size > 1 and limit_s > 0
        self._connect = functools.partial(store, f"fthsdp/alive/{replica_id}/{incarnation}/")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: dist.Store | None = None

    def start(self) -> None:
        """Start stamping and watching (a no-op in a one-rank group, or with ``limit_s`` 0)."""
        if self.enabled and self._thread is None:
            self._store = self._connect()
            for r in self.watched:
                self._store.add(str(r), 0)  # exists from now on: the reads below never wait for a key
            self._store.add(str(self.rank), 1)
            self._thread = start_thread(self._run, name="fthsdp-sibling-watch", device=None)

    def close(self) -> None:
        """This rank is closing: its silence from now on is expected (``CLOSED``); stop watching."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._store is not None:
            try:
                self._store.add(str(self.rank), CLOSED)
            except (RuntimeError, OSError) as e:  # the store went first (its agent ends the group anyway)
                log.debug("rank=%d could not mark itself closed in the group's store: %s", self.rank, e)
            self._store = None

    def _run(self) -> None:
        store = self._store
        assert store is not None
        keys = [str(r) for r in self.watched]
        silence = Silence(self.watched, self.limit_s, self._clock())
        failing = False
        while not self._stop.wait(self.interval_s):
            try:
                store.add(str(self.rank), 1)
                readings = {r: int(v) for r, v in zip(self.watched, store.multi_get(keys), strict=True)}
            except (RuntimeError, OSError, ValueError) as e:  # not this rank's business to end the replica for
                if not failing:
                    log.warning("rank=%d the group's store does not answer the rank watch: %s", self.rank, e)
                failing = True
                continue
            failing = False
            late = silence.observe(self._clock(), readings)
            if late and not self._stop.is_set():
                rank, silent_s = max(late, key=lambda x: x[1])
                self.on_silent(rank, silent_s)
                return
