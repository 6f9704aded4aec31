"""The FTAR lane engine: a fault-tolerant all-reduce of one lane (shard rank s of every member replica).

Control on the CPU, data through a torch.distributed process group (torchft's reconfigurable Gloo or NCCL
group), rebuilt in the same process for every epoch. One worker thread per lane runs the exchanges in call
order; ``allreduce`` returns a handle at once, so the caller can overlap.

An exchange, under epoch E:
1. (first exchange of E) rendezvous on the lighthouse-hosted store under ``<E's rendezvous>/lane<s>`` and
   check that every member calls with the same tag (step); a member behind raises ``Misaligned``. A joiner
   calls with ``tag=None`` and learns the step (it fetches the state itself, outside the data plane).
2. copy the local tensors into one flat buffer (plus a contributor-count element), all-reduce it, divide.
3. on a peer error, a deadline, or a newer epoch pushed while in flight: abandon the collective (its buffer is
   private; the originals are untouched), blame the members that did not check in on the epoch's store, report
   them, wait for the next epoch, rebuild, and redo from the originals.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL, create_store_client

from ftar.errors import (AttemptsExhausted, EngineClosed, Excluded, FTARError, InputsConsumed, Interrupted,
                         Misaligned, NoEpoch)
from ftar.membership import Membership
from lighthouse.wire import EpochView

log = logging.getLogger("fthsdp.ftar")


@dataclass(frozen=True)
class FTARConfig:
    """Deadlines and limits of a lane engine."""

    backend: str = "gloo"
    """``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors)."""
    timeout_s: float = 5.0
    """Deadline of one collective (and of the data plane's own timeout): a hung peer is given up after this."""
    connect_timeout_s: float = 10.0
    """Deadline of the rendezvous of a new epoch's group."""
    epoch_wait_s: float = 30.0
    """How long to wait for the next epoch after a failure."""
    blame_grace_s: float = 0.2
    """After a failure, how long to wait for the other members to check in before blaming those that did not."""
    max_attempts: int = 10
    """Epochs an exchange is tried in before it gives up."""
    abandon_grace_s: float = 1.0
    """A collective in flight when a newer epoch that keeps all of its members arrives gets this long to finish
    before it is abandoned (one that lost a member is abandoned at once)."""


@dataclass(frozen=True)
class ExchangeResult:
    tensors: list[torch.Tensor]
    """The averaged (or summed) tensors: new tensors, the inputs are not modified."""
    epoch: int
    """The epoch the result was computed in."""
    contributors: int
    """How many replicas contributed (zero-gradient joiners are not counted): the divisor of ``avg``."""
    attempts: int
    tag: int
    """The tag (step) the members agreed on: a joiner that called with ``tag=None`` learns it here."""


class Handle:
    """A pending exchange."""

    def __init__(self, future: "Future[ExchangeResult]") -> None:
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> ExchangeResult:
        """The result; raises the exchange's ``FTARError``, or ``TimeoutError`` at the deadline."""
        return self._future.result(timeout)


@dataclass
class _Request:
    tensors: list[torch.Tensor]
    contribute: bool
    op: str
    tag: int | None
    inplace: bool
    keep_inputs: bool
    redo: bool
    new_epoch_ok: bool
    future: "Future[ExchangeResult]"


class _Abandoned(Exception):
    """The collective was abandoned because a newer epoch arrived."""


class _PeerFailure(Exception):
    """The collective failed or missed its deadline."""


_STOP = object()
_NO_TAG = -(2**62)


def _reap(pg: Any) -> None:
    try:
        pg.abort(errored=False)
    except Exception:  # abort of a broken group: nothing more to release
        log.debug("abort failed", exc_info=True)


class LaneEngine:
    """Fault-tolerant all-reduce for one lane. Thread-safe ``allreduce``; ``close`` when done."""

    def __init__(self, membership: Membership, lane: int = 0, config: FTARConfig | None = None) -> None:
        self.membership = membership
        self.replica_id = membership.replica_id
        self.lane = lane
        self.config = config or FTARConfig()
        if self.config.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.config.backend!r}")
        self._queue: "queue.Queue[_Request | object]" = queue.Queue()
        self._epoch_changed = threading.Event()
        self._pg: Any = None
        self._pg_epoch = 0
        self._pg_view: EpochView | None = None
        self._store: Any = None
        self._rank = -1
        self._world = 0
        self._seq = 0
        self._staging: dict[torch.dtype, torch.Tensor] = {}
        self._reapers: list[threading.Thread] = []
        self._direct = False
        self._tag = 0
        self._failed_epoch = 0
        """No exchange runs in this epoch or an older one again (it failed there)."""
        self._interrupted: int | None = None
        self._excluded = ""
        self._closed = False
        self.rebuilds = 0
        self.last_rebuild_s = 0.0
        self.failures = 0
        self._remove_listener = membership.add_listener(self._on_epoch)
        self._thread = threading.Thread(target=self._worker, name=f"ftar-lane{lane}-{self.replica_id}", daemon=True)
        self._thread.start()

    # --- public -----------------------------------------------------------------------------------------------

    def allreduce(self, tensors: Sequence[torch.Tensor], *, contribute: bool = True, op: str = "avg",
                  tag: int | None = 0, inplace: bool = False, keep_inputs: bool = True,
                  redo: bool = True, new_epoch_ok: bool = True) -> Handle:
        """Start an exchange of ``tensors``; don't change them until it is done.

        ``contribute=False`` joins with zeros and is not counted in the divisor. ``op`` is ``avg`` (sum divided
        by the number of contributors) or ``sum``. ``tag`` (the step) must be the same on every member that
        knows it; a joiner passes ``None`` and learns it (``ExchangeResult.tag``).
        With ``inplace`` the result is written into ``tensors`` once it is complete (never half way: the
        collective runs on a private buffer, so a failed attempt leaves them intact); otherwise the result is
        in new tensors.

        ``keep_inputs=False`` (with ``inplace``) skips the private copy: a single contiguous tensor per dtype is
        reduced where it lies, which saves two memory passes. The price: a failed attempt leaves the tensors
        half-reduced, so instead of redoing, the exchange ends with ``InputsConsumed`` once the next epoch is
        known, and the caller recomputes them.

        ``redo=False`` ends a failed exchange with ``Interrupted`` instead of redoing it, and fails every exchange
        queued after it the same way until ``reset()``: a caller that exchanges several buckets per step redoes
        them all, in order, under one epoch. With ``new_epoch_ok=False`` (its later buckets) an exchange stays in
        the group its sequence began in while that group is whole, even if a newer epoch is known, and is
        ``Interrupted`` before any data moves if the group lost a member.
        """
        if not keep_inputs and not inplace:
            raise ValueError("keep_inputs=False needs inplace=True")
        if op not in ("avg", "sum"):
            raise ValueError(f"op must be 'avg' or 'sum', got {op!r}")
        if not tensors:
            raise ValueError("nothing to exchange")
        future: "Future[ExchangeResult]" = Future()
        if self._closed:
            future.set_exception(EngineClosed("engine closed"))
        else:
            self._queue.put(_Request(list(tensors), contribute, op, tag, inplace, keep_inputs, redo, new_epoch_ok,
                                     future))
        return Handle(future)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the worker; pending exchanges end with ``EngineClosed``."""
        if self._closed:
            return
        self._closed = True
        self._remove_listener()
        self._queue.put(_STOP)
        self._epoch_changed.set()
        self._thread.join(timeout)
        self._drop_pg()
        # Abandoned groups end by their own collective timeout: wait for that, so no thread outlives us.
        for reaper in self._reapers:
            reaper.join(max(self.config.timeout_s, self.config.connect_timeout_s) + 1.0)

    # --- worker -----------------------------------------------------------------------------------------------

    def _on_epoch(self, epoch: EpochView) -> None:
        if epoch.number > self._pg_epoch:
            self._epoch_changed.set()

    def _worker(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            assert isinstance(item, _Request)
            if self._closed:
                item.future.set_exception(EngineClosed("engine closed"))
                continue
            try:
                item.future.set_result(self._exchange(item))
            except BaseException as e:  # delivered to the caller through the handle
                item.future.set_exception(e)
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, _Request):
                item.future.set_exception(EngineClosed("engine closed"))

    def _log(self, level: int, epoch: int, tag: int | None, msg: str, *args: Any) -> None:
        log.log(level, "ftar replica=%s lane=%d epoch=%d step=%s " + msg, self.replica_id, self.lane, epoch,
                "?" if tag is None else tag, *args)

    def _exchange(self, req: _Request) -> ExchangeResult:
        if self._interrupted is not None:
            raise Interrupted(f"lane {self.lane}: an earlier exchange was interrupted in epoch "
                              f"{self._interrupted}; call reset() before exchanging again", self._interrupted)
        for attempt in range(1, self.config.max_attempts + 1):
            if self._closed:
                raise EngineClosed("engine closed")
            epoch = self._usable_epoch(after=self._failed_epoch)
            if self._pg is not None and self._pg_view is not None and epoch.number != self._pg_epoch \
                    and epoch.data_plane == self._pg_view.data_plane:
                # Only roles changed (a joiner turned active): the group is the same, keep it. Every member
                # decides this from the epoch alone, so they all stay together.
                epoch = self._pg_view
            if not req.new_epoch_ok and (self._pg is None or self._pg_epoch != epoch.number):
                # Mid-sequence: stay in the group the sequence began in while it is whole (every member may be
                # continuing in it); a group that lost a member ends the sequence, to be redone from its start.
                if self._pg is None or set(self._pg_view.replica_ids) - set(epoch.replica_ids):
                    self._interrupted = epoch.number
                    raise Interrupted(f"lane {self.lane}: epoch {epoch.number} began mid-sequence", epoch.number)
                epoch = self._pg_view
            try:
                self._ensure_group(epoch, req.tag)
                return self._run_collective(req, epoch, attempt)
            except Misaligned as e:
                if e.tag < e.highest:
                    raise  # this replica is behind: its caller must catch up
                self._log(logging.WARNING, epoch.number, req.tag, "members behind (%s); waiting for next epoch", e)
                self._drop_pg()
                self._failed_epoch = epoch.number
            except _Abandoned:
                self._log(logging.INFO, epoch.number, req.tag, "newer epoch pushed mid-exchange")
                self._drop_pg()
                self._failed_epoch = epoch.number
                self._after_failure(req, epoch)
            except _PeerFailure as e:
                self.failures += 1
                self._log(logging.WARNING, epoch.number, req.tag, "exchange failed: %s", e)
                self._blame(epoch, str(e))
                self._drop_pg()
                self._failed_epoch = epoch.number
                self._after_failure(req, epoch)
        raise AttemptsExhausted(f"lane {self.lane}: exchange failed in {self.config.max_attempts} epochs")

    def reset(self) -> None:
        """Accept exchanges again after an ``Interrupted`` one (call once every pending handle is done)."""
        self._interrupted = None

    def exclude(self, reason: str) -> None:
        """The lighthouse no longer knows this replica (declared dead while alive, e.g. after a hang): end the
        exchange in flight and every later one with ``Excluded`` at once, instead of waiting for an epoch
        that will never include it."""
        self._excluded = reason
        self._epoch_changed.set()

    def _after_failure(self, req: _Request, epoch: EpochView) -> None:
        """Redo (return), or end the exchange with ``InputsConsumed`` / ``Interrupted`` as the caller asked."""
        self._inputs_lost(req, epoch)
        if not req.redo:
            self._interrupted = epoch.number
            raise Interrupted(f"lane {self.lane}: exchange interrupted in epoch {epoch.number}", epoch.number)

    def _inputs_lost(self, req: _Request, epoch: EpochView) -> None:
        if req.keep_inputs or not self._direct:
            return
        nxt = self._usable_epoch(after=epoch.number)
        raise InputsConsumed(f"lane {self.lane}: exchange failed in epoch {epoch.number}; the inputs were "
                             f"reduced in place and must be recomputed (next epoch {nxt.number})", nxt.number)

    def _usable_epoch(self, after: int) -> EpochView:
        """The newest epoch above ``after`` that has this replica as a member (waiting up to epoch_wait_s)."""
        deadline = time.monotonic() + self.config.epoch_wait_s
        current = self.membership.current()
        while True:
            if self._excluded:
                raise Excluded(f"replica {self.replica_id}: {self._excluded}")
            if current is not None and current.number > after and current.member(self.replica_id) is not None:
                return current
            if current is not None and current.number > after:
                after = current.number  # an epoch without us: wait for one that includes us
            left = deadline - time.monotonic()
            if left <= 0 or self._closed:
                if current is not None and current.member(self.replica_id) is None and current.number > 0:
                    raise Excluded(f"replica {self.replica_id} is not in epoch {current.number}")
                raise NoEpoch(f"no usable epoch after {after} within {self.config.epoch_wait_s}s")
            self._epoch_changed.clear()
            nxt = self.membership.wait_epoch(after, min(left, 0.5))
            current = nxt if nxt is not None else self.membership.current()

    # --- data plane ---------------------------------------------------------------------------------------------

    def _drop_pg(self) -> None:
        """Release the current group without waiting for it: a Gloo group's abort blocks until its pending
        collective reaches its own timeout (pytorch#130345), so a reaper thread does it."""
        pg, self._pg = self._pg, None
        self._store = None
        self._staging = {}
        if pg is not None:
            self._reapers = [t for t in self._reapers if t.is_alive()]
            reaper = threading.Thread(target=_reap, args=(pg,), name=f"ftar-reap-lane{self.lane}", daemon=True)
            reaper.start()
            self._reapers.append(reaper)

    def _ensure_group(self, epoch: EpochView, tag: int | None) -> None:
        if self._pg is not None and self._pg_epoch == epoch.number:
            if tag is None:
                raise FTARError("tag=None (joiner) is only valid for the first exchange of an epoch")
            return
        self._drop_pg()
        if not epoch.rendezvous:
            raise FTARError(f"epoch {epoch.number} has no rendezvous address (is the lighthouse hosting one?)")
        t0 = time.perf_counter()
        ids = epoch.replica_ids
        self._rank, self._world = ids.index(self.replica_id), len(ids)
        self._pg_epoch = epoch.number
        self._pg_view = epoch
        self._epoch_changed.clear()
        self._seq = 0
        prefix = f"{epoch.rendezvous}/lane{self.lane}"
        timeout = timedelta(seconds=self.config.connect_timeout_s)
        try:
            self._store = create_store_client(prefix, timeout=timeout)
            self._store.set(f"arrived/{self._rank}", b"1")
            pg_cls = ProcessGroupGloo if self.config.backend == "gloo" else ProcessGroupNCCL
            # The group's own timeout bounds its rendezvous; each collective gets timeout_s through its options.
            pg = pg_cls(timeout=timeout)
            self._configure(pg, f"{prefix}/pg", epoch)
            self._pg = pg
        except _Abandoned:
            self._store = None
            raise
        except Exception as e:
            missing = self._missing("arrived", epoch)
            self._store = None
            raise _PeerFailure(f"rendezvous of epoch {epoch.number} failed ({e}); not arrived: {missing}") from e
        self._tag = self._check_alignment(epoch, tag)
        self.rebuilds += 1
        self.last_rebuild_s = time.perf_counter() - t0
        self._log(logging.INFO, epoch.number, self._tag, "data plane rebuilt: rank %d of %d in %.3fs", self._rank,
                  self._world, self.last_rebuild_s)

    def _configure(self, pg: Any, prefix: str, epoch: EpochView) -> None:
        """Rendezvous of the epoch's group, abandoned as soon as a newer epoch is pushed (a member that never
        arrives would otherwise hold everyone for the whole connect timeout)."""
        error: list[BaseException] = []

        def run() -> None:
            try:
                pg.configure(prefix, self.replica_id, self._rank, self._world)
            except BaseException as e:  # handed to the waiting thread
                error.append(e)

        t = threading.Thread(target=run, name=f"ftar-connect-lane{self.lane}", daemon=True)
        t.start()
        while t.is_alive():
            t.join(0.02)
            current = self.membership.current()
            if t.is_alive() and (self._closed or (current is not None and current.number > epoch.number)):
                # Let it finish (or time out) on its own, then release the group.
                reaper = threading.Thread(target=lambda: (t.join(), _reap(pg)), name=f"ftar-reap-lane{self.lane}",
                                          daemon=True)
                reaper.start()
                self._reapers.append(reaper)
                raise _Abandoned()
        if error:
            raise error[0]

    def _device(self) -> torch.device:
        return torch.device("cpu") if self.config.backend == "gloo" else torch.device("cuda",
                                                                                       torch.cuda.current_device())

    def _opts(self, op: dist.ReduceOp.RedOpType) -> dist.AllreduceOptions:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        opts.timeout = timedelta(seconds=self.config.timeout_s)
        return opts

    def _check_alignment(self, epoch: EpochView, tag: int | None) -> int:
        """All-reduce (MAX) of [tag, -tag]; joiners send the minimum so they count in neither. Returns the agreed
        tag."""
        mine = [tag, -tag] if tag is not None else [_NO_TAG, _NO_TAG]
        ctrl = torch.tensor(mine, dtype=torch.int64, device=self._device())
        self._wait(self._pg.allreduce([ctrl], self._opts(dist.ReduceOp.MAX)), epoch)
        highest, lowest = int(ctrl[0]), -int(ctrl[1])
        if highest == _NO_TAG:
            raise FTARError(f"epoch {epoch.number}: every member of lane {self.lane} is a joiner; nobody knows the step")
        if tag is not None and highest != lowest:
            raise Misaligned(tag, lowest, highest)
        return highest

    def _wait(self, work: Any, epoch: EpochView) -> None:
        """Wait for ``work`` until done, its deadline, or a newer epoch; never longer than the deadline."""
        fut = work.get_future()
        done = threading.Event()
        fut.add_done_callback(lambda _: done.set())
        deadline = time.monotonic() + self.config.timeout_s + 0.5
        give_up_at: float | None = None
        while not done.is_set():
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                raise _PeerFailure(f"collective missed its {self.config.timeout_s}s deadline")
            if self._closed or self._excluded:
                raise _Abandoned()
            if give_up_at is None and self._epoch_changed.is_set():
                current = self.membership.current()
                if current is not None and current.number > epoch.number \
                        and current.data_plane != epoch.data_plane:
                    # A newer epoch. If it dropped a member of this collective, give up at once: it cannot
                    # finish. If not (a join, a re-formed epoch), every member may be in it and it may finish
                    # for some: abandoning it could split them (some would have the result, some not), so it
                    # gets a grace period first; a member that moved on without it makes it fail anyway.
                    gone = set(epoch.replica_ids) - set(current.replica_ids)
                    give_up_at = now if gone else now + self.config.abandon_grace_s
                else:
                    self._epoch_changed.clear()
            if give_up_at is not None and now >= give_up_at:
                raise _Abandoned()
            done.wait(min(left, 0.02))
        try:
            fut.wait()
        except Exception as e:
            raise _PeerFailure(f"collective error: {str(e).splitlines()[0][:300]}") from e

    def _buffer(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A staging buffer reused across exchanges (a fresh 64 MB allocation costs more than the copy into
        it). Dropped after a failure: an abandoned collective may still be writing into the old one."""
        buf = self._staging.get(dtype)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype, device=self._device())
            self._staging[dtype] = buf
        return buf[:numel]

    def _run_collective(self, req: _Request, epoch: EpochView, attempt: int) -> ExchangeResult:
        groups: dict[torch.dtype, list[int]] = {}
        for i, t in enumerate(req.tensors):
            groups.setdefault(t.dtype, []).append(i)
        # The contributor count rides in the first float32/float64 buffer (integers exact up to 2**24), or
        # else in a separate int64 collective.
        carrier = next((d for d in groups if d in (torch.float32, torch.float64)), None)
        flats: list[tuple[torch.Tensor, list[int]]] = []
        self._direct = (not req.keep_inputs and req.contribute
                        and all(len(idx) == 1 and req.tensors[idx[0]].is_contiguous() for idx in groups.values()))
        if self._direct:
            carrier = None
            flats = [(req.tensors[idx[0]].view(-1), idx) for idx in groups.values()]
        for dtype, idx in groups.items() if not self._direct else ():
            numel = sum(req.tensors[i].numel() for i in idx)
            flat = self._buffer(dtype, numel + (1 if dtype == carrier else 0))
            offset = 0
            for i in idx:
                n = req.tensors[i].numel()
                if req.contribute:
                    flat[offset: offset + n].copy_(req.tensors[i].detach().reshape(-1))
                offset += n
            if not req.contribute:
                flat.zero_()
            if dtype == carrier:
                flat[-1] = 1.0 if req.contribute else 0.0
            flats.append((flat, idx))
        count = None
        if carrier is None:
            count = torch.tensor([1 if req.contribute else 0], dtype=torch.int64, device=self._device())
        self._seq += 1
        works = [self._pg.allreduce([flat], self._opts(dist.ReduceOp.SUM)) for flat, _ in flats]
        if count is not None:
            works.append(self._pg.allreduce([count], self._opts(dist.ReduceOp.SUM)))
        for w in works:
            self._wait(w, epoch)
        contributors = int(count.item()) if count is not None else int(flats[0][0][-1].item())
        if req.op == "avg" and contributors == 0:
            raise FTARError(f"epoch {epoch.number}: no member contributed (all joined with zeros)")
        out: list[torch.Tensor] = list(req.tensors)
        for flat, idx in flats:
            offset = 0
            for i in idx:
                t = req.tensors[i]
                src = flat[offset: offset + t.numel()].view(t.shape)
                offset += t.numel()
                dst = t if req.inplace else torch.empty_like(t)
                if req.op == "sum":
                    if dst.data_ptr() != src.data_ptr():
                        dst.copy_(src)
                elif t.is_floating_point():
                    torch.div(src, contributors, out=dst)
                else:
                    torch.div(src, contributors, rounding_mode="floor", out=dst)
                out[i] = dst
        return ExchangeResult(out, epoch.number, contributors, attempt, req.tag if req.tag is not None else self._tag)

    # --- blame --------------------------------------------------------------------------------------------------

    def _missing(self, key: str, epoch: EpochView) -> list[str]:
        """Members of ``epoch`` (other than us) that have not set ``key/<rank>`` on the epoch-lane store."""
        if self._store is None:
            return []
        ids = epoch.replica_ids
        missing = []
        for r, rid in enumerate(ids):
            if rid == self.replica_id:
                continue
            try:
                if not self._store.check([f"{key}/{r}"]):
                    missing.append(rid)
            except Exception:  # the store itself is unreachable: nobody can be blamed from here
                return []
        return missing

    def _blame(self, epoch: EpochView, reason: str) -> None:
        """Check in as failed, give the others ``blame_grace_s`` to do the same, report those that did not."""
        key = f"failed/{self._seq}"
        suspects: list[str] = []
        if self._store is not None:
            try:
                self._store.set(f"{key}/{self._rank}", b"1")
            except Exception:
                log.debug("cannot check in on the store", exc_info=True)
            deadline = time.monotonic() + self.config.blame_grace_s
            while True:
                suspects = self._missing(key, epoch)
                current = self.membership.current()
                if not suspects or time.monotonic() >= deadline or (current and current.number > epoch.number):
                    break
                time.sleep(0.01)  # polling the store with a deadline
        current = self.membership.current()
        if current is not None and current.number > epoch.number:
            return  # the lighthouse already moved on
        if not suspects:
            # Everyone checked in: nobody to blame, but the data plane is broken all the same. Reporting the
            # others (alive, so not confirmed) makes the lighthouse re-form the epoch, and everyone rebuilds.
            self._log(logging.WARNING, epoch.number, None, "failure with every member checked in; asking for a "
                      "re-formed epoch")
            suspects = [rid for rid in epoch.replica_ids if rid != self.replica_id]
            reason = f"nobody to blame: {reason}"
        for suspect in suspects:
            self.membership.report(suspect, epoch.number, f"lane {self.lane}: {reason}"[:1000])
