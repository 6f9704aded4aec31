"""The FTAR lane engine (docs/design.md §5): a fault-tolerant all-reduce of one lane (shard rank s of every member
replica). Control on the CPU, data through a torch.distributed process group (torchft's reconfigurable Gloo or NCCL
group), rebuilt in the same process for every epoch. One worker thread per lane runs the exchanges in call
order; ``allreduce`` returns a handle at once, so the caller can overlap.

An exchange, under epoch E:
1. (first exchange of E) rendezvous under ``<E's rendezvous>/lane<s>`` (on the store of the lane's host, or the
   lighthouse's: ``ftar.group``), check that every member calls with the same tag (step), then keep the lane's
   candidate hosts' addresses (every member took part, so every candidate announced its own). A member behind is
   served the results it lacks by a member that holds them (``ftar.reconcile``), or, when none does, raises
   ``Misaligned``. A joiner calls with ``tag=None`` and learns the step (it fetches the state on its own).
2. copy the local tensors into one flat buffer (ending with the contributor count and the tag proof), all-reduce
   it, check the proof and divide, once it is known complete without error (``ftar.completion``: on NCCL a work's
   future says queued, not done).
3. on a peer error, a deadline, or a newer epoch pushed while in flight: abort the group (its private buffer is
   never read; the originals are untouched), blame the members that did not check in on the epoch's store,
   report them, wait for the next epoch, rebuild, and redo from the originals.
On CUDA the worker runs on the lane's device and stream (``ftar.devices``), ordered by events with its callers.
Decisions: ``ftar.rules``, ``ftar.completion``, ``ftar.reconcile``; group and store I/O: ``ftar.group``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from ftar import devices
from ftar import reconcile as rc
from ftar.blame import blame_failure, send_reports
from ftar.completion import Outcome, outcome
from ftar.errors import Abandoned, EngineClosed, FTARError, InputsConsumed, Interrupted, Misaligned, PeerFailure
from ftar.exchange import BACKENDS, OPS, ExchangeResult, FTARConfig, Handle, Request
from ftar.group import EpochGroup, Reaper
from ftar.membership import Membership
from ftar.packing import pack, unpack
from ftar.reconcile import Held, HeldResults
from ftar.rules import (
    Attempts,
    CollectiveWatch,
    LaneState,
    PendingReports,
    Recovery,
    agreed_tag,
    alignment_probe,
    newer,
    no_epoch,
    proof_holds,
    recovery,
    tag_proof,
)
from lighthouse.epoch_view import EpochView

log = logging.getLogger("fthsdp.ftar")

_STOP = object()
EPOCH_POLL_S = 0.5
"""Longest single wait for the next epoch (the engine re-checks exclusion and closing between them)."""


class LaneEngine:
    """Fault-tolerant all-reduce for one lane. Thread-safe ``allreduce``; ``close`` when done."""

    def __init__(self, membership: Membership, lane: int = 0, config: FTARConfig | None = None) -> None:
        self.membership = membership
        self.replica_id = membership.replica_id
        self.lane = lane
        self.config = config or FTARConfig()
        if self.config.backend not in BACKENDS:
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.config.backend!r}")
        self._queue: queue.Queue[Request | object] = queue.Queue()
        self._epoch_changed = threading.Event()
        self._wake = threading.Event()  # ends a wait on a collective: its completion, or ``_signal``
        self._state = LaneState(self.replica_id, lane)
        self._reports = PendingReports()  # the last failure's, sent again while its epoch does not come
        self._group: EpochGroup | None = None
        self._plane_epoch = 0  # the epoch of the group last built (or being built): a newer one signals a change
        self.device = devices.resolve(self.config.backend, self.config.device)
        self._reaper = Reaper(lane, self.device)
        self._direct = False  # the last packing reduced the caller's tensors in place
        self._tag = 0
        self._held = HeldResults()  # the results this lane acted on, until forget_before (ftar.reconcile)
        self._served: dict[int, Held] = {}  # what a holder served this lane in the current group, by tag
        self._closed = False
        self.last_rebuild_s = 0.0
        self.tag_label: Callable[[int], str] = lambda tag: f"tag={tag}"  # how log lines name a tag (settable)
        self._remove_listener = membership.add_listener(self._on_epoch)
        self._thread = devices.start_thread(self._worker, name=f"ftar-lane{lane}-{self.replica_id}", device=self.device)

    # --- public -----------------------------------------------------------------------------------------------

    def allreduce(self, tensors: Sequence[torch.Tensor], *, contribute: bool = True, op: str = "avg",
                  tag: int | None = 0, inplace: bool = False, keep_inputs: bool = True,
                  redo: bool = True, new_epoch_ok: bool = True, ready: Any = None,
                  fits: Callable[[EpochView], bool] | None = None) -> Handle:
        """Start an exchange of ``tensors``; don't change them until it is done.

        ``contribute=False`` joins with zeros and is not counted in the divisor. ``op`` is ``avg`` (sum / contributors)
        or ``sum``. ``tag`` (the step) must be the same on every member that knows it; a joiner passes ``None`` and
        learns it (``ExchangeResult.tag``). With ``inplace`` the result is written into ``tensors`` once it is complete
        (never half way: the collective runs on a private buffer, so a failed attempt leaves them intact); otherwise the
        result is in new tensors. ``keep_inputs=False`` (with ``inplace``) skips the private copy: a single contiguous
        tensor per dtype is reduced where it lies, which saves two memory passes. The price: a failed attempt leaves the
        tensors half-reduced, so instead of redoing, the exchange ends with ``InputsConsumed`` once the next epoch is
        known, and the caller recomputes them. ``redo=False`` ends a failed exchange with ``Interrupted`` instead of
        redoing it, and fails every exchange queued after it the same way until ``reset()``: a caller that exchanges
        several buckets per step redoes them all, in order, under one epoch. With ``new_epoch_ok=False`` (its later
        buckets) an exchange stays in the group its sequence began in while that group is whole, even if a newer epoch
        is known, and is ``Interrupted`` before any data moves if the group lost a member. ``ready`` (CUDA): the event
        after which ``tensors`` may be read. ``fits(epoch)`` False: the contribution may not be exchanged in that
        epoch's group, and is ``Interrupted`` before any data moves (``LaneState.misfit``).
        """
        if not keep_inputs and not inplace:
            raise ValueError("keep_inputs=False needs inplace=True")
        if op not in OPS:
            raise ValueError(f"op must be 'avg' or 'sum', got {op!r}")
        if not tensors:
            raise ValueError("nothing to exchange")
        future: Future[ExchangeResult] = Future()
        if self._closed:
            future.set_exception(EngineClosed("engine closed"))
        else:
            self._queue.put(Request(list(tensors), contribute, op, tag, inplace, keep_inputs, redo, new_epoch_ok,
                                    future, ready, fits))
        return Handle(future)

    def forget_before(self, tag: int) -> None:
        """Results tagged below ``tag`` will never be asked for again: stop holding them (until then a lane keeps
        every result it acted on, to serve a member that lost them: step reconciliation, ``ftar.reconcile``)."""
        self._held.forget_before(tag)

    @property
    def held(self) -> tuple[EpochView | None, int]:
        """(the epoch whose group this lane holds, None: none; the epoch it last failed in: it runs in newer ones)."""
        return (self._group.epoch if self._group is not None else None), self._state.failed_epoch

    @property
    def asking(self) -> int:
        """The epoch this lane's pending failure reports ask the lighthouse to move past (0: none)."""
        return self._reports.asking

    def reset(self, after: int = 0, reform: bool = False) -> None:
        """Accept exchanges again after an ``Interrupted`` one (call once every pending handle is done). With
        ``after``, never exchange in epoch ``after`` or an older one again: the caller gave up a sequence it
        exchanged there, and partners that kept it moved on in that epoch's group (a redo there would pair with
        their next exchanges). ``reform``: none of the caller's lanes is ``asking`` past ``after``, so nobody will: if
        it is still the newest epoch a second from now, ask for a re-formed one (``rules.PendingReports.reform``)."""
        self._state.reset()
        if after > self._state.failed_epoch:
            self._state.failed(after)
            current = self.membership.current()
            if reform and current is not None and current.number == after:
                self._reports.reform(current, self.replica_id, time.monotonic())

    def exclude(self, reason: str) -> None:
        """The lighthouse no longer knows this replica (declared dead while alive, e.g. after a hang): end the exchange
        in flight and every later one with ``Excluded`` at once, not waiting for an epoch that never includes it."""
        self._state.exclude(reason)
        self._signal()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the worker; pending exchanges end with ``EngineClosed``."""
        if self._closed:
            return
        self._closed = True
        self._remove_listener()
        self._queue.put(_STOP)
        self._signal()
        self._thread.join(timeout)
        self._drop_group()  # abandoned Gloo groups end by their own timeout: wait for that, no thread outlives us
        self._reaper.join(max(self.config.timeout_s, self.config.connect_timeout_s) + 1.0)

    # --- worker -----------------------------------------------------------------------------------------------

    def _signal(self) -> None:
        """A newer epoch, exclusion or closing: what the lane waits for may have changed."""
        self._epoch_changed.set()
        self._wake.set()

    def _on_epoch(self, epoch: EpochView) -> None:
        if epoch.number > self._plane_epoch:
            self._signal()

    def _worker(self) -> None:
        devices.side_stream(self.device)  # on CUDA, this lane's stream of its own
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            assert isinstance(item, Request)
            if self._closed:
                item.future.set_exception(EngineClosed("engine closed"))
                continue
            try:
                item.future.set_result(self._exchange(item))
            except BaseException as e:  # delivered to the caller through the handle
                item.future.set_exception(e)
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, Request):
                item.future.set_exception(EngineClosed("engine closed"))

    def _log(self, level: int, epoch: int, tag: int | None, msg: str, *args: Any) -> None:
        log.log(level, "ftar replica=%s lane=%d epoch=%d %s " + msg, self.replica_id, self.lane, epoch,
                "tag=?" if tag is None else self.tag_label(tag), *args)

    def _exchange(self, req: Request) -> ExchangeResult:
        """Attempts of one exchange, each in a newer epoch, until one succeeds or the rules end it."""
        self._state.admit()
        devices.receive(req.ready, req.tensors)  # after the producer's stream (FSDP2's reduce-scatter), on the lane's
        attempts = Attempts(self.lane, self.config.max_attempts)
        while True:
            attempt = attempts.next()
            if self._closed:
                raise EngineClosed("engine closed")
            held = self._group.epoch if self._group is not None else None
            try:
                epoch = self._state.place(self._usable_epoch(), held, req.new_epoch_ok, req.redo)
                if req.fits is not None and not req.fits(epoch):
                    if held is not None and held.number == epoch.number:  # its partners wait for it there: ask on
                        self._reports.reform(epoch, self.replica_id, time.monotonic())
                    raise self._state.misfit(epoch, held)
            except Interrupted:
                self._drop_group()  # it lost a member: the redo goes to the newer epoch's group
                raise
            try:
                group = self._ensure_group(epoch, req.tag)
                if req.tag is not None and req.tag in self._served:
                    return self._take_served(req, attempt)
                return self._run_collective(group, req, epoch, attempt)
            except Misaligned as e:
                self._state.misaligned(epoch.number, e)
                self._log(logging.WARNING, epoch.number, req.tag, "members behind (lowest %s, highest %s); waiting "
                          "for the next epoch", self.tag_label(e.lowest), self.tag_label(e.highest))
                self._drop_group()
            except Abandoned:
                self._log(logging.INFO, epoch.number, req.tag, "newer epoch pushed mid-exchange")
                self._drop_group()
                self._after_failure(req, epoch)
            except PeerFailure as e:
                self._log(logging.WARNING, epoch.number, req.tag, "exchange failed: %s", e)
                verdict = blame_failure(self._group, epoch, self.membership, self.lane, self.config.blame_grace_s,
                                        str(e), self._log)
                self._reports.sent(verdict, epoch.number, time.monotonic())
                self._drop_group()
                self._after_failure(req, epoch)

    def _after_failure(self, req: Request, epoch: EpochView) -> None:
        """Mark ``epoch`` failed, then redo (return), or end the exchange with ``InputsConsumed`` /
        ``Interrupted`` as the caller asked."""
        self._state.failed(epoch.number)
        action = recovery(redo=req.redo, keep_inputs=req.keep_inputs, direct=self._direct)
        if action is Recovery.RECOMPUTE:
            nxt = self._usable_epoch()
            raise InputsConsumed(f"lane {self.lane}: exchange failed in epoch {epoch.number}; the inputs were "
                                 f"reduced in place and must be recomputed (next epoch {nxt.number})", nxt.number)
        if action is Recovery.INTERRUPT:
            raise self._state.interrupt(epoch.number)

    def _usable_epoch(self) -> EpochView:
        """The newest epoch above the failed one that has this replica as a member (waiting up to
        ``epoch_wait_s``, sending the last failure's reports again meanwhile: ``rules.PendingReports``)."""
        deadline = time.monotonic() + self.config.epoch_wait_s
        after = self._state.failed_epoch
        current = self.membership.current()
        while True:
            choice = self._state.pick(current, after)
            if isinstance(choice, EpochView):
                return choice
            after = choice
            again = self._reports.due(current, time.monotonic())
            if again is not None:
                self._log(logging.WARNING, self._reports.epoch, None, "no newer epoch yet: reporting %s again",
                          ", ".join(again.suspects))
                send_reports(self.membership, self._reports.epoch, self.lane, again)
            left = deadline - time.monotonic()
            if left <= 0 or self._closed:
                raise no_epoch(current, after, self.replica_id, self.config.epoch_wait_s)
            self._epoch_changed.clear()
            nxt = self.membership.wait_epoch(after, min(left, EPOCH_POLL_S))
            current = nxt if nxt is not None else self.membership.current()

    # --- data plane ---------------------------------------------------------------------------------------------

    def _drop_group(self) -> None:
        self._served = {}  # valid in the group they came in only: a redo elsewhere may have no holder
        group, self._group = self._group, None
        if group is not None:
            group.release(self._reaper)

    def _ensure_group(self, epoch: EpochView, tag: int | None) -> EpochGroup:
        """The group of ``epoch``, built (with the tag check) if this lane does not hold it yet."""
        if self._group is not None and self._group.epoch.number == epoch.number:
            if tag is None:
                raise FTARError("tag=None (joiner) is only valid for the first exchange of an epoch")
            return self._group
        self._drop_group()
        if not epoch.rendezvous:
            raise FTARError(f"epoch {epoch.number} has no rendezvous address (is the lighthouse hosting one?)")
        t0 = time.perf_counter()
        self._plane_epoch = epoch.number
        self._epoch_changed.clear()
        group = EpochGroup.open(epoch, self.replica_id, self.lane, self.config.backend, self.config.connect_timeout_s,
                                self._reaper, lambda: self._closed or newer(self.membership.current(), epoch),
                                *(getattr(self.membership, a, None) for a in ("store_target", "hosting")))
        self._group = group
        self._tag = self._check_alignment(group, epoch, tag)
        self.last_rebuild_s = time.perf_counter() - t0
        self._log(logging.INFO, epoch.number, self._tag, "data plane rebuilt: rank %d of %d in %.3fs on %s",
                  group.rank, group.world, self.last_rebuild_s, group.met_on)
        return group

    def _check_alignment(self, group: EpochGroup, epoch: EpochView, tag: int | None) -> int:
        """All-reduce (MAX) the alignment probe; returns the agreed tag. Members behind are served by a holder
        when there is one (``ftar.reconcile``); otherwise ``Misaligned`` if members disagree."""
        reduced = self._max(group, epoch, alignment_probe(tag))
        group.learn()  # every member took part: each candidate host announced itself before it arrived
        highest, lowest = reduced[0], -reduced[1]
        if rc.needs_reconciling(highest, lowest):
            probe = rc.holder_probe(tag, highest, lowest, self._held, group.rank, group.world)
            holder = rc.holder_of(self._max(group, epoch, probe), group.world)
            if holder is not None:
                self._serve(group, epoch, holder, lowest, highest, tag)
                return highest
        return agreed_tag(tag, reduced, epoch.number, self.lane)

    def _bcast(self, group: EpochGroup, epoch: EpochView, tensor: torch.Tensor, root: int) -> torch.Tensor:
        self._wait(group.broadcast(tensor, root, self.config.timeout_s), epoch)
        return tensor

    def _max(self, group: EpochGroup, epoch: EpochView, values: list[int]) -> list[int]:
        ctrl = torch.tensor(values, dtype=torch.int64, device=group.staging.device)
        self._wait(group.allreduce(ctrl, dist.ReduceOp.MAX, self.config.timeout_s), epoch)
        return [int(x) for x in ctrl.tolist()]

    def _serve(self, group: EpochGroup, epoch: EpochView, holder: int, lowest: int, highest: int,
               tag: int | None) -> None:
        """The holder broadcasts the results of ``[lowest, highest)``; a member asking for a tag in that range takes
        them as the results of its next exchanges (every member takes part in the broadcasts)."""
        device = group.staging.device
        mine = group.rank == holder
        items = self._held.span(lowest, highest) if mine else []
        head = self._bcast(group, epoch, torch.tensor(rc.header(items) if mine else [0, 0], dtype=torch.int64,
                                                          device=device), holder).tolist()
        described = torch.tensor(rc.meta(items), dtype=torch.int64, device=device) if mine else \
            torch.zeros(rc.meta_size(head), dtype=torch.int64, device=device)
        layout = rc.parse(head, self._bcast(group, epoch, described, holder).tolist())
        flats = rc.flatten(items, layout, device) if mine else \
            [torch.empty(n, dtype=dtype, device=device) for dtype, n in layout.flats]
        for flat in flats:
            self._bcast(group, epoch, flat, holder)
        if not mine and tag is not None and tag < highest:
            self._served = {t: h for t, h in layout.split(flats).items() if t >= tag}
            self._log(logging.WARNING, epoch.number, tag, "behind the others: served the results of %s to %s "
                      "(computed in epoch %s) by rank %d", self.tag_label(min(self._served)),
                      self.tag_label(highest - 1), sorted({h.epoch for h in self._served.values()}), holder)

    def _take_served(self, req: Request, attempt: int) -> ExchangeResult:
        """A served result as the result of ``req`` (in the epoch it was computed in)."""
        assert req.tag is not None
        held = self._served[req.tag]  # again on a redo in this group (a failed vote): they last as long as it
        out = rc.shaped_like(held, req.tensors, req.tag)
        if req.inplace:
            for dst, src in zip(req.tensors, out, strict=True):
                dst.copy_(src)
            out = list(req.tensors)
        if self.config.hold:
            self._held.record(req.tag, Held(tuple(out), held.epoch, held.contributors))
        return ExchangeResult(out, held.epoch, held.contributors, attempt, req.tag, devices.record(self.device))

    def _wait(self, work: Any, epoch: EpochView) -> None:
        """Wait for ``work`` until complete without error (``ftar.completion``) or failed; at its deadline or a
        newer epoch (``CollectiveWatch``) abort the group at once. A failed or aborted buffer is never read."""
        group = self._group
        assert group is not None
        watcher = group.watch(work, self._wake)
        watch = CollectiveWatch(epoch, time.monotonic(), self.config.timeout_s, self.config.abandon_grace_s)
        while True:
            self._wake.clear()  # before looking: a signal from here on ends the pause below
            now = time.monotonic()
            if watch.watching and self._epoch_changed.is_set() and not watch.notice(self.membership.current(), now):
                self._epoch_changed.clear()
            verdict = outcome(watcher.poll(), watch.verdict(now, stopping=self._closed or bool(self._state.excluded)))
            if verdict is Outcome.DONE:
                return
            if verdict is Outcome.FAILED:
                raise PeerFailure(watcher.error())
            if verdict is not Outcome.WAIT:
                group.abort(self._reaper)
                if verdict is Outcome.ABORT_EPOCH:
                    raise Abandoned()
                raise PeerFailure(f"collective missed its {self.config.timeout_s}s deadline")
            watcher.pause(watch.left(now))  # until the verdict can change by time alone, or a signal

    def _run_collective(self, group: EpochGroup, req: Request, epoch: EpochView, attempt: int) -> ExchangeResult:
        tag = req.tag if req.tag is not None else self._tag
        packed = pack(req.tensors, contribute=req.contribute, keep_inputs=req.keep_inputs, staging=group.staging,
                      proof=tag_proof(tag), world=group.world)
        self._direct = packed.direct
        t0 = self.config.starting(tag)  # the time in the collective: who arrives last waits least (a slow link)
        for work in group.start_exchange(packed.buffers(), self.config.timeout_s):
            self._wait(work, epoch)
        if not proof_holds(tag, packed.proof(), group.world):
            raise PeerFailure(f"members exchanged different tags in one group (mine {tag}): out of step")
        contributors = packed.contributors()
        if req.op == "avg" and contributors == 0:
            raise FTARError(f"epoch {epoch.number}: no member contributed (all joined with zeros)")
        out = unpack(packed, req.tensors, op=req.op, contributors=contributors, inplace=req.inplace)
        if self.config.hold:
            kept = tuple(t.clone() for t in out) if req.inplace else tuple(out)  # the caller may change its own
            self._held.record(tag, Held(kept, epoch.number, contributors))
        return ExchangeResult(out, epoch.number, contributors, attempt, tag, devices.record(self.device),
                              time.perf_counter() - t0)
