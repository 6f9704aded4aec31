"""One epoch's data plane of a lane (docs/design.md §5): the rendezvous on the store of the lane's host (``ftar.
lane_hosting``) or the lighthouse's (``ftar.store``: authenticated, over the lighthouse's gRPC port), the torchft
process group (Gloo or NCCL) built for the epoch in the same process, its collectives, the check-in keys blame is
read from, and the release of a group that is given up.

A Gloo group has no shutdown: its abort blocks until a pending collective reaches its own timeout
(pytorch#130345, docs/design.md §10), so groups are released on reaper threads, never on the caller's. An NCCL
group's abort (``ncclCommAbort``) ends its collectives at once; it runs on a reaper thread too. Every thread here
sets the lane's device first (``ftar.devices.start_thread``): torchft's ``_create_pg`` connects the communicator
to the connect thread's current device.

On NCCL a lane's group is built with c10d's watchdog told to record errors and do nothing else
(``ftar.nccl_env.lane_settings``), so a peer's death ends the collective, never the survivor; every error at issue
becomes a ``PeerFailure``; and the group's error state is read by the lane (``EpochGroup.error``) without keeping a
reference to the backend, so that the group's last reference, and its destructor, go with the reaper thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

from ftar import devices, nccl_env
from ftar.completion import FutureWatcher, StreamWatcher, Watcher
from ftar.errors import Abandoned, PeerFailure
from ftar.lane_hosting import LaneHosting, member_hosted
from ftar.packing import Staging
from ftar.rules import missing
from ftar.spread_store import ARRIVED, SpreadStore
from ftar.store import StoreRefused, StoreTarget, open_store
from lighthouse.epoch_view import EpochView

log = logging.getLogger("fthsdp.ftar")

FAILED = "failed"
"""Store key prefix a member sets (``failed/<seq>/<rank>``) when exchange ``seq`` failed for it."""
POLL_S = 0.02
"""How often the rendezvous checks whether it was superseded."""


def device_for(backend: str) -> torch.device:
    """Where a backend's tensors live: the CPU for Gloo, the calling thread's current CUDA device for NCCL (the
    lane's worker has set it: ``ftar.devices.start_thread``)."""
    return torch.device("cpu") if backend == "gloo" else torch.device("cuda", torch.cuda.current_device())


def _abort(pg: Any) -> None:
    try:
        pg.abort(errored=False)
    except Exception:  # abort of a broken group: nothing more to release
        log.debug("abort failed", exc_info=True)


def backend_error(pg: Any) -> str | None:
    """The NCCL backend's recorded error (c10d's ``get_error``: a timeout, a communicator error, a remote peer's
    error), ``None`` when there is none or the backend cannot say (a torch without ``get_error``; not built yet).
    The backend object is not kept: a lane that held it would run the group's destructor on its own thread."""
    base = getattr(pg, "_pg", None)
    if base is None:
        return None
    try:
        error = base._get_backend(torch.device("cuda")).get_error()
    except Exception:  # no such backend or binding on this torch: the watcher's deadline decides
        return None
    name = getattr(error, "name", str(error))
    return None if name in ("SUCCESS", "ErrorType.SUCCESS") else f"NCCL error recorded by the group: {name}"


class Reaper:
    """Releases process groups on threads of their own (on the lane's ``device``), and lets the owner wait for them
    when it closes (an abandoned Gloo group ends by its own collective timeout)."""

    def __init__(self, lane: int, device: torch.device | None = None) -> None:
        self.lane = lane
        self.device = device
        """The lane's device: every thread the lane's groups use (connect, release) sets it first."""
        self._threads: list[threading.Thread] = []

    def reap(self, pg: Any, after: threading.Thread | None = None) -> None:
        """Abort ``pg`` (once ``after`` has finished, if given) without waiting for it."""

        held = [pg]  # the reaper's is the last reference: the group's destructor runs here, not on the lane

        def run() -> None:
            if after is not None:
                after.join()
            _abort(held[0])
            held.clear()

        self._threads = [t for t in self._threads if t.is_alive()]
        self._threads.append(devices.start_thread(run, name=f"ftar-reap-lane{self.lane}", device=self.device))

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` for each pending release."""
        for thread in self._threads:
            thread.join(timeout)


class EpochGroup:
    """A lane's process group for one epoch: rank ``rank`` of ``world`` (the epoch's members, in order), with
    the epoch-lane store and the staging buffers of its exchanges."""

    def __init__(self, epoch: EpochView, rank: int, store: Any, pg: Any, staging: Staging,
                 backend: str = "gloo", met_on: str = "the lighthouse") -> None:
        self.epoch = epoch
        self.met_on = met_on
        """Where the members met: ``<replica>'s lane store`` (``and N more``: a large lane's spread, the host
        first) or the lighthouse (for the logs)."""
        self.rank = rank
        self.world = len(epoch.replica_ids)
        self.store = store
        self.pg: Any = pg
        """torchft's group; ``None`` once given up (the reaper holds it then)."""
        self.staging = staging
        self.backend = backend
        self.seq = 0
        """Exchanges started in this group; names the failure check-in key."""
        self.aborted = False
        """Given up (``abort``): its buffers are never read again."""
        self.hosting: LaneHosting | None = None
        self.lane = 0
        self.learned = False
        """The lane's candidate hosts' addresses were read (``learn``)."""

    @classmethod
    def open(cls, epoch: EpochView, replica_id: str, lane: int, backend: str, connect_timeout_s: float,
             reaper: Reaper, superseded: Callable[[], bool],
             store_target: StoreTarget | Callable[[], StoreTarget] | None = None,
             hosting: LaneHosting | None = None) -> EpochGroup:
        """Rendezvous under ``<epoch's rendezvous>/lane<lane>`` and build the group from that store object: the
        lane host's store when the epoch's members host it (``hosting``: ``ftar.lane_hosting``), else the
        lighthouse's authenticated store, reached through ``store_target``, or the opt-in TCPStore. Raises
        ``Abandoned`` as soon as ``superseded()`` (a member that never arrives would otherwise hold everyone for
        the whole connect timeout), ``PeerFailure`` (naming the members that did not arrive, or the host that could
        not be reached) if the rendezvous fails."""
        ids = epoch.replica_ids
        rank = ids.index(replica_id)
        timeout = timedelta(seconds=connect_timeout_s)
        met: list[Any] = []
        try:
            base, store, host = meet(epoch, replica_id, lane, timeout, superseded, store_target, hosting, met)
            pg_cls = ProcessGroupGloo if backend == "gloo" else ProcessGroupNCCL
            # The group's own timeout bounds its rendezvous; each collective gets its timeout through its options.
            pg = pg_cls(timeout=timeout)
            # The C++ group holds the store but not its Python object (a Python store): the group keeps it alive.
            pg.fthsdp_rendezvous_store = base
            _configure(pg, dist.PrefixStore("pg", store), replica_id, rank, len(ids), lane, reaper, superseded)
        except Abandoned:
            raise
        except Exception as e:
            absent = missing(ids, replica_id, _present(met[0], ARRIVED, rank, len(ids)) if met else None)
            on = f" on {met[1]}'s store" if met and met[1] else ""
            raise PeerFailure(f"rendezvous of epoch {epoch.number}{on} failed ({e}); not arrived: {absent}") from e
        spread = f" and {len(base.stores) - 1} more" if isinstance(base, SpreadStore) else ""
        group = cls(epoch, rank, store, pg, Staging(device_for(backend)), backend,
                    f"{host}'s lane store{spread}" if host else "the lighthouse")
        group.hosting, group.lane = hosting, lane
        return group

    def learn(self) -> None:
        """Keep the lane's candidate hosts' addresses (``LaneHosting.learn``), once every member is known to have
        arrived: after the group's first collective (building a group does not wait for every member everywhere:
        NCCL's rank 0 returns once it set the unique id)."""
        if self.hosting is not None and not self.learned:
            self.learned = True
            try:
                self.hosting.learn(self.epoch, self.lane, self.store)
            except Exception:  # the next rendezvous falls back to the lighthouse for what it did not learn
                log.debug("lane %d: could not learn the lane's hosts", self.lane, exc_info=True)

    def allreduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType, timeout_s: float) -> Any:
        """Start an all-reduce of ``tensor`` with a deadline (Gloo's; torchft's NCCL option hook clears it, so there
        the lane's watcher is what bounds it); returns its work. Raises ``PeerFailure`` if it cannot be issued."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(op)
        opts.timeout = timedelta(seconds=timeout_s)
        return self._issue("all-reduce", lambda pg: pg.allreduce([tensor], opts))

    def broadcast(self, tensor: torch.Tensor, root: int, timeout_s: float) -> Any:
        """Start a broadcast of ``tensor`` from rank ``root`` with a deadline; returns its work (``PeerFailure`` if
        it cannot be issued)."""
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        opts.timeout = timedelta(seconds=timeout_s)
        return self._issue("broadcast", lambda pg: pg.broadcast([tensor], opts))

    def _issue(self, what: str, call: Callable[[Any], Any]) -> Any:
        """``call(pg)``; an error raised at issue (NCCL: an aborted communicator, a nonblocking init that timed out
        because a member died) is the peers' failure, like one at completion."""
        pg = self.pg
        if pg is None:
            raise PeerFailure(f"{what} on a group already given up")
        try:
            return call(pg)
        except Exception as e:
            raise PeerFailure(f"{what} could not be issued: {str(e).splitlines()[0][:300] if str(e) else e!r}") \
                from e

    def error(self) -> str | None:
        """The group's recorded error, if any: torchft's (set before it aborts the communicator), then NCCL's
        (``backend_error``); ``aborted`` once this lane gave the group up."""
        pg = self.pg
        if pg is None:
            return "aborted by this lane"
        group_error = getattr(pg, "_errored", None)
        if group_error is not None:
            return f"group error: {group_error}"
        return backend_error(pg) if self.backend == "nccl" else None

    def start_exchange(self, buffers: list[torch.Tensor], timeout_s: float) -> list[Any]:
        """Start the SUM all-reduces of one exchange; returns their works."""
        self.seq += 1
        return [self.allreduce(b, dist.ReduceOp.SUM, timeout_s) for b in buffers]

    def failure_key(self) -> str:
        """The key the members check in under after the current exchange failed."""
        return f"{FAILED}/{self.seq}"

    def check_in(self, key: str) -> None:
        """Set ``key/<rank>``; an unreachable store is logged, not raised."""
        try:
            self.store.set(f"{key}/{self.rank}", b"1")
        except Exception:
            log.debug("cannot check in on the store", exc_info=True)

    def present(self, key: str) -> set[int] | None:
        """The other ranks that have set ``key/<rank>``; ``None`` if the store cannot be read."""
        return _present(self.store, key, self.rank, self.world)

    def watch(self, work: Any, wake: threading.Event) -> Watcher:
        """The watcher of ``work`` (``ftar.completion``): its future on Gloo; on NCCL an event recorded on the
        calling thread's current stream once that stream waits for the collective, and the group's ``error``. Its
        ``pause`` returns early once ``wake`` is set."""
        if self.backend != "nccl":
            return FutureWatcher(work, wake)
        return StreamWatcher(work, self.error, lambda: devices.record(self.staging.device), wake)

    def abort(self, reaper: Reaper) -> None:
        """Give the group up now, without waiting for it: on NCCL the communicator is aborted, which ends a
        collective stuck on a dead peer (the lane's stream waits for it). The reaper takes the group over."""
        if not self.aborted:
            self.aborted = True
            pg, self.pg = self.pg, None
            reaper.reap(pg)

    def release(self, reaper: Reaper) -> None:
        """Give the group up without waiting for it (once: an aborted group is already on its way)."""
        self.abort(reaper)


def meet(epoch: EpochView, replica_id: str, lane: int, timeout: timedelta, superseded: Callable[[], bool],
         store_target: StoreTarget | Callable[[], StoreTarget] | None, hosting: LaneHosting | None,
         met: list[Any] | None = None) -> tuple[Any, Any, str]:
    """The first half of a lane's rendezvous, before the backend's own: the store ``lane`` meets on in ``epoch``
    (see ``EpochGroup.open``), on which this member announced its lane store (if it is one of the lane's candidates,
    ``ftar.lane_hosting``) and arrived. Returns (the base store, the lane's store on it, the host: '' for the
    lighthouse); ``met`` gets (the lane's store, the host) as soon as there is one, for the blame of a failure."""
    host = ""
    if member_hosted(epoch):
        if hosting is None:
            raise StoreRefused(f"epoch {epoch.number} meets on its members' stores, and this member serves none")
        base, host = hosting.open(epoch, lane, store_target, timeout, superseded)
    else:
        base = open_store(epoch.rendezvous, store_target, timeout)
    store = dist.PrefixStore(f"lane{lane}", base)
    if met is not None:
        met[:] = [store, host]
    if hosting is not None:
        hosting.announce(epoch, lane, store)
    store.set(f"{ARRIVED}/{epoch.replica_ids.index(replica_id)}", "1")
    return base, store, host


def _present(store: Any, key: str, rank: int, world: int) -> set[int] | None:
    present: set[int] = set()
    for r in range(world):
        if r == rank:
            continue
        try:
            if store.check([f"{key}/{r}"]):
                present.add(r)
        except Exception:  # the store itself is unreachable: nobody can be blamed from here
            return None
    return present


def configure_with_store(pg: Any, store: Any, replica_id: str, rank: int, world: int) -> None:
    """torchft's ``ProcessGroupWrapper.configure``, from a store object instead of a TCPStore address: the same
    bookkeeping, then the backend group built on ``store`` (``_create_pg``)."""
    pg._replica_id, pg._rank = replica_id, rank
    pg._quorum_id = pg._group_rank = pg._group_world_size = pg._global_ranks = None
    pg.abort(errored=False)
    # An NCCL lane's settings are in force while c10d builds the backend (it reads them then). A Gloo lane connects
    # every pair as it is built (c10d's full mesh): with its pairs connecting lazily (TORCH_GLOO_LAZY_INIT), a
    # collective's worker thread reads this Python store, and a store error there aborts the process (SIGABRT:
    # pybind11's "restore() called a second time"), seen when a joiner's peer died mid-connect.
    with nccl_env.lane_settings() if isinstance(pg, ProcessGroupNCCL) else contextlib.nullcontext():
        pg._pg = pg._create_pg(store, rank, world)


def _configure(pg: Any, store: Any, replica_id: str, rank: int, world: int, lane: int, reaper: Reaper,
               superseded: Callable[[], bool]) -> None:
    """``configure_with_store`` on a thread of its own, abandoned (``Abandoned``) as soon as ``superseded()``:
    the group is then left to finish (or time out) on its own and released by ``reaper``."""
    error: list[BaseException] = []

    def run() -> None:
        try:
            configure_with_store(pg, store, replica_id, rank, world)
        except BaseException as e:  # handed to the waiting thread
            error.append(e)

    t = devices.start_thread(run, name=f"ftar-connect-lane{lane}", device=reaper.device)
    while t.is_alive():
        t.join(POLL_S)
        if t.is_alive() and superseded():
            reaper.reap(pg, after=t)
            raise Abandoned()
    if error:
        raise error[0]
