"""Gradient buckets: which gradient shards travel across replicas together, the FSDP2 hook that hands each bucket
to FTAR as soon as its shards exist (so the exchange overlaps the rest of the backward pass), and the tag that
names one bucket of one step on the wire. The last bucket also carries the step's state digests
(``fthsdp.runtime.digest``) and, last, the slot mask.

On CUDA a bucket's exchange reads its shards only after an event recorded on the stream the hook runs on (FSDP2's
reduce-scatter stream), and a step's results become the parameters' ``.grad`` in place (``install``)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn

from ftar import ExchangeResult, Excluded, FTARError, Handle, Interrupted, LaneEngine, Misaligned, devices
from fthsdp.runtime import digest, exact, grad_scale, orphans
from fthsdp.runtime.bucket_plan import plan_buckets, slot_mask
from fthsdp.runtime.commit import CommitProtocol, Exchanged, Failed, Failure
from fthsdp.runtime.errors import RejoinRequired
from fthsdp.runtime.state import bind_grad, local_tensor
from fthsdp.runtime.tags import BucketTag
from fthsdp.runtime.timeline import OFF, Timeline
from lighthouse.epoch_view import EpochView


class LogFn(Protocol):
    """The replica's structured log (every line says replica, rank, epoch and step)."""

    def __call__(self, level: int, msg: str, *args: object) -> None: ...


def failure_of(e: FTARError) -> Failure:
    """What an exchange's error means to the commit protocol."""
    if isinstance(e, Misaligned):
        return Failure.BEHIND if e.tag < e.highest else Failure.MISALIGNED
    if isinstance(e, Excluded):
        return Failure.EXCLUDED
    return Failure.INTERRUPTED if isinstance(e, Interrupted) else Failure.ERROR


class BucketExchange:
    """One rank's buckets and their exchanges in flight. During backward the FSDP2 hook launches each bucket
    once its gradient shards are all there; a redo (or a joiner's zero contribution) launches them all, in
    order. Every bucket but the first stays in the epoch its step began in (FTAR's ``new_epoch_ok``)."""

    def __init__(self, params: Sequence[nn.Parameter], blocks: Sequence[Sequence[nn.Parameter]],
                 engine: LaneEngine, *, slot: Callable[[], int], slots: int, device: torch.device,
                 wait_s: float) -> None:
        self.buckets = plan_buckets(params, blocks)
        self.width = len(self.buckets) + 1
        """Wire tags per step: index 0, the post exchange of the step before (``launch_post``), then the buckets."""
        self.posts = False
        """The trainer's own loop: every step's exchange ends with a post exchange (``launch_post``), and a lane's
        first exchange in an epoch is always one (a joiner's first exchange is shaped like it)."""
        self.posted: int | None = None
        """The step whose post exchange this lane launched last."""
        self.unchecked: tuple[int, float, Handle] | None = None
        """The post exchange this lane sent last as a contributor, not read yet: (its step, the factor sent, its
        handle). An active replica does not wait for it before its optimizer step; the step core reads it once the
        lane has exchanged something after it (``posts.agree``)."""
        self._last_post: tuple[int, float | None, float | None] = (-2, None, None)
        self.engine = engine
        self.slot = slot
        """The replica's data slot in the step being exchanged (``Replica.slot``; ``NO_SLOT``: a spare's)."""
        self.slots, self.device = slots, device
        self.parts = 0
        """With orphan slots carried: micro-batches per slot (the mask's parts; 0: not carried)."""
        self.dealt: tuple[int, ...] = ()
        """With orphan slots carried: the mask positions this step's contribution trains (``orphans.dealt``)."""
        self.fits: Callable[[EpochView], bool] | None = None
        """With orphan slots carried: whether this step's exchange (zeros too: a step dealt nothing, ``carry.redealt``)
        may go out in an epoch's group: its member is dealt there what it trained (FTAR interrupts it where not)."""
        self.wait_s = wait_s
        """How long a joiner waits for its first bucket to learn the step."""
        self.exact: exact.Accumulators | None = None
        """``FTHSDP_DETERMINISTIC=1``: each micro-batch's shards folded into fixed-point sums, exchanged as int64
        (``op="sum"``) and made the gradients divided by the slots trained (``fthsdp.runtime.exact``)."""
        self.last_micro = True
        """Exact: the micro-batch being trained is the step's last (``Steps.take``): its shards launch the buckets."""
        self._averaged: tuple[ExchangeResult, list[torch.Tensor]] | None = None
        """``averaged``'s answer for the step whose last result it holds."""
        self._bucket_of = {id(p): k for k, b in enumerate(self.buckets) for p in b}
        self._pending: list[Handle | None] = [None] * len(self.buckets)
        self._filled = [0] * len(self.buckets)
        self._launched = 0
        self._armed: int | None = None
        """The step whose buckets the hook launches (None: the hook does nothing)."""
        self._at_first: Callable[[], None] | None = None
        self._at_end: Callable[[], None] | None = None
        """``arm``'s callbacks: before the step's first bucket goes out, and once backward has ended."""
        self._end_at_last = False
        """``at_end`` runs once the last bucket is out (gradients reduced outside a backward pass)."""
        self.digest: bytes | None = None
        """This replica's state digest for the step being exchanged (None: not a checked step)."""
        self.alias = False
        """``install`` makes the results the gradients, without a copy (set when ``grads_untouched``)."""
        self.timeline: Timeline = OFF
        """Where each exchange's span goes, issue to done (the step core's)."""
        engine.tag_label = functools.partial(BucketTag.label, buckets=self.width)  # its logs: step, bucket
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]

    def __len__(self) -> int:
        return len(self.buckets)

    def tag(self, step: int, bucket: int) -> int:
        """The wire tag of ``bucket`` of ``step``."""
        return BucketTag(step, bucket + 1).encode(self.width)

    def post_tag(self, step: int) -> int:
        """The wire tag of ``step``'s post exchange: after its buckets, before the next step's."""
        return BucketTag(step + 1, 0).encode(self.width)

    def sequence(self, step: int) -> int:
        """The lowest wire tag of ``step``'s exchanges (a commit's ``forget_before``: a partner may still need the
        post exchange of the step before)."""
        return BucketTag(step, 0).encode(self.width)

    @contextmanager
    def armed(self, step: int) -> Iterator[None]:
        """While inside, gradient shards that FSDP2 finishes go out as buckets of ``step``."""
        self.arm(step)
        try:
            yield
        finally:
            self.disarm()

    def arm(self, step: int, at_first: Callable[[], None] | None = None,
            at_end: Callable[[], None] | None = None) -> None:
        """From now on gradient shards that FSDP2 finishes go out as buckets of ``step`` (until ``disarm``).
        ``at_first`` runs before the first bucket goes out; ``at_end`` once the backward pass that produced it has
        ended (an autograd final callback: after FSDP2's own, which finishes every reduce-scatter), still inside
        ``backward()``, so the trainer's code after it sees what ``at_end`` did; when FSDP2 reduces outside a
        backward pass (a pipeline schedule's reduce step), once the step's last bucket is out."""
        self._pending = [None] * len(self.buckets)
        self._filled = [0] * len(self.buckets)
        self._launched = 0
        self._armed = step
        if self.exact is not None:
            self.exact.reset()
        self._at_first, self._at_end = at_first, at_end
        self._end_at_last = False

    def disarm(self) -> None:
        self._armed, self._at_first, self._at_end = None, None, None
        self._end_at_last = False

    def _on_grad(self, p: torch.Tensor) -> None:
        """FSDP2 finished this parameter's gradient shard: launch every bucket that is now complete, in order."""
        if self._armed is None:
            return
        if self.exact is not None:
            with torch.no_grad():
                self.exact.fold(p)
            if not self.last_micro:
                return
        k = self._bucket_of[id(p)]
        if k < self._launched:
            raise RuntimeError(
                f"step {self._armed}: a second backward produced gradients after this step's exchange began. With "
                "gradient accumulation, call model.set_requires_gradient_sync(False) (FSDP2) before every micro-batch "
                "but the last: the exchange runs once, on the last micro-batch's backward")
        if self._launched == 0 and not any(self._filled):
            if self._at_first is not None:
                self._at_first()
            if self._at_end is not None:
                if torch._C._current_graph_task_id() >= 0:
                    torch.autograd.Variable._execution_engine.queue_callback(self._at_end)
                else:
                    self._end_at_last = True
        self._filled[k] += 1
        while self._launched < len(self.buckets) and \
                self._filled[self._launched] == len(self.buckets[self._launched]):
            self._launch(self._launched, self._armed, True)
        if self._end_at_last and self._launched == len(self.buckets) and self._at_end is not None:
            # No backward to end (torch.distributed.pipelining reduces every stage's gradients after its
            # schedule's last backward): the step settles once its last bucket is out, before the schedule scales
            # the gradients, so that scaling is the trainer's, applied to the averaged gradients as clipping is.
            self._end_at_last = False
            self._at_end()

    def _launch(self, k: int, step: int | None, contribute: bool) -> Handle:
        bucket = self.buckets[k]
        if self.exact is not None and contribute:
            self.exact.check(bucket)  # before anything of it moves: a sum that overflowed is never exchanged
        grads = [self.exact.of(p) for p in bucket] if self.exact is not None else \
            [local_tensor(p.grad) if p.grad is not None else torch.zeros_like(local_tensor(p)) for p in bucket]
        if k == len(self.buckets) - 1:
            slot = self.slot()
            words = digest.pack(slot, self.slots, self.digest if contribute else None)
            grads.append(torch.tensor(words, dtype=torch.float32, device=self.device))
            grads.append(slot_mask(slot, self.slots, contribute, self.device, self.parts, self.dealt))
        tag = None if step is None else self.tag(step, k)
        # On CUDA the lane reads the shards after this event, on the stream FSDP2 produced them on (the hook's).
        handle = self.engine.allreduce(grads, contribute=contribute, tag=tag, redo=False, op=self.op,
                                       new_epoch_ok=k == 0 and not self.posts, ready=devices.record(self.device),
                                       fits=self.fits)
        self._pending[k] = handle
        self._launched = k + 1
        self._timed(handle, f"bucket {k}", -1 if step is None else step)
        return handle

    def _timed(self, handle: Handle, name: str, step: int) -> None:
        """The exchange's span on the timeline, from now until FTAR's lane ends it."""
        if self.timeline.enabled:
            t0 = time.perf_counter()
            handle.when_done(lambda failed: self.timeline.span(name, "exchange", step, t0, time.perf_counter(),
                                                               failed=failed))

    def barrier(self, step: int, again: bool = False) -> Handle:
        """The end of the job: an exchange of zeros shaped like ``step``'s first bucket, tagged with it and counted
        nowhere (``op="sum"``). It completes once every member of the epoch asks for that bucket, i.e. has committed
        every step before; a member behind is served meanwhile (FTAR's step reconciliation), and a joiner's zeros
        of that bucket pair with it. Not redone by FTAR (``redo=False``): the caller votes on it with the replica's
        other ranks and redoes it with them (``again``). With ``posts`` it stays in the group of the step before's
        post exchange (``new_epoch_ok=False``) and a redo sends that post exchange again first: a lane's first
        exchange in an epoch is a post exchange (a joiner's first, shaped like one, met this barrier's zeros in a
        new epoch, and Gloo aborted every member on the size mismatch)."""
        if self.posts and again:
            self.launch_post(step - 1, *self.post_again(step - 1))
        grads = [torch.zeros_like(self.exact.of(p) if self.exact is not None else local_tensor(p))
                 for p in self.buckets[0]]
        if len(self.buckets) == 1:
            slot = self.slot()
            grads.append(torch.tensor(digest.pack(slot, self.slots, None), dtype=torch.float32, device=self.device))
            grads.append(slot_mask(slot, self.slots, False, self.device, self.parts))
        return self.engine.allreduce(grads, contribute=False, op="sum", tag=self.tag(step, 0), redo=False,
                                     new_epoch_ok=not self.posts)

    def launch_post(self, step: int | None, factor: float | None, loss: float | None) -> Handle:
        """Step ``step``'s post exchange (the trainer's own loop, ``fthsdp.runtime.loop``), after the trainer's code
        between ``backward()`` and ``step()`` ran: the factor it scaled the averaged gradients by
        (``grad_scale.pack``; None: a zero contributor, which learns it here) and this rank's loss, averaged over the
        contributing replicas. The next step's exchange begins with it, and so does every epoch's first exchange on
        this lane (``new_epoch_ok``). Never redone by FTAR itself (``redo=False``): a failure fails the exchanges
        queued after it too, until the caller resets the lane and starts again (a redo of its own could still be
        pending when the vote's redo sends the same tag again, and pair with a partner's next exchange). FTAR serves
        it to a partner that lost it. ``step`` None: a joiner's first exchange, which learns the step from its
        tag."""
        words = [*grad_scale.pack(factor), 0.0 if loss is None else loss]
        handle = self.engine.allreduce([torch.tensor(words, dtype=torch.float32, device=self.device)],
                                       contribute=factor is not None,
                                       tag=None if step is None else self.post_tag(step), redo=False)
        self._timed(handle, "post", -1 if step is None else step)
        if step is not None:
            self.posted, self._last_post = step, (step, factor, loss)
            if factor is not None:
                self.unchecked = (step, factor, handle)
        return handle

    def post_again(self, step: int) -> tuple[float | None, float | None]:
        """What this lane sends in ``step``'s post exchange sent again (a redo in a newer epoch): what it sent the
        first time, or, never sent (the job's first step, a resume), factor 1 (no change to replay)."""
        last, factor, loss = self._last_post
        return (factor, loss) if last == step else (1.0, None)

    @staticmethod
    def post_of(result: ExchangeResult) -> tuple[float, float]:
        """(the factor, the contributors' mean loss) of a post exchange's result (1.0 and NaN with no contributor)."""
        if result.contributors == 0:
            return 1.0, float("nan")
        words = [float(x) for x in result.tensors[0].detach().cpu().tolist()]
        return grad_scale.unpack(words[:grad_scale.WORDS]), words[grad_scale.WORDS]

    def grads(self) -> list[torch.Tensor]:
        """This rank's gradient shards now, in bucket order (zeros for a parameter without one)."""
        return [local_tensor(p.grad) if p.grad is not None else torch.zeros_like(local_tensor(p))
                for bucket in self.buckets for p in bucket]

    @property
    def op(self) -> str:
        """How FTAR reduces a bucket: exact sums are divided here, by the slots trained (``averaged``)."""
        return "avg" if self.exact is None else "sum"

    def averaged(self, results: Sequence[ExchangeResult]) -> list[torch.Tensor]:
        """A step's averaged gradient shards from its results, in ``grads`` order (the digests and mask left out), as
        ``install`` makes them the gradients: computed once per step (``install`` and the clipping factor's reading,
        ``Steps.finish``, both ask)."""
        if self._averaged is not None and self._averaged[0] is results[-1]:
            return self._averaged[1]
        if self.exact is not None:
            done = orphans.slots_trained(self.mask_of(results), results[-1].contributors, self.slots, self.parts,
                                         self.step_of(results[-1]))
            out = [exact.to_float(g, done, local_tensor(p).dtype) for bucket, res in zip(self.buckets, results,
                   strict=True) for p, g in zip(bucket, res.tensors, strict=False)]
        else:
            fix = self.divisor_fix(results)
            out = [g * fix if fix != 1 else g for bucket, res in zip(self.buckets, results, strict=True)
                   for g in res.tensors[:len(bucket)]]
        self._averaged = (results[-1], out)
        return out

    def divisor_fix(self, results: Sequence[ExchangeResult]) -> float:
        """What a step's averaged gradients are multiplied by to become the mean over the slots it trained: FTAR
        divides by the contributors, and with orphan slots carried a contributor may stand for more than one slot
        (``orphans.divisor_fix``). 1 when nothing is carried."""
        if not self.parts:
            return 1.0
        step = self.step_of(results[-1])
        return orphans.divisor_fix(self.mask_of(results), results[-1].contributors, self.slots, self.parts, step)

    def launch_rest(self, step: int) -> list[Handle | None]:
        """After backward: launch the buckets the hook did not (parameters that got no gradient: zeros)."""
        while self._launched < len(self.buckets):
            self._launch(self._launched, step, True)
        return list(self._pending)

    def exchange_all(self, step: int | None, contribute: bool, redo: bool = False,
                     learned_at: Callable[[int], None] | None = None) -> tuple[list[Handle | None], int | None]:
        """Exchange every bucket in order from the gradients at hand (a redo, or a joiner's zeros). A joiner that
        does not know the step yet (``step`` None) learns it from its first exchange; the others then carry it, and
        ``learned_at(step)`` runs first if a bucket of the step is still held back then (so the others cannot have
        committed it yet: a joiner's fetch of that step's state registers there). With ``posts`` the step's
        exchange begins with the post exchange of the step before where this lane has not launched it yet, and
        always in a ``redo`` (it is what a lane exchanges first in a newer epoch). Returns (the handles, None where
        a bucket was not launched; the step learned, if it was)."""
        self._pending = [None] * len(self.buckets)
        self._launched = 0
        learned = None
        if self.posts and (step is None or redo or self.posted != step - 1):
            first = self.launch_post(None, None, None) if step is None else \
                self.launch_post(step - 1, *self.post_again(step - 1))
            if step is None:
                try:
                    t = BucketTag.decode(first.wait(self.wait_s).tag, self.width)
                except FTARError:
                    return list(self._pending), None  # collecting the handles reports it
                if t.bucket != 0:  # not a post exchange: nobody else is at a step's start; try again
                    return list(self._pending), None
                step = learned = t.step
                self.posted, self._last_post = step - 1, (step - 1, None, None)
        elif step is None:
            first = self._launch(0, step, contribute)
            try:
                step = learned = BucketTag.decode(first.wait(self.wait_s).tag, self.width).step
            except FTARError:
                return list(self._pending), None  # collecting the handles reports it
        if learned is not None and learned_at is not None and self._launched < len(self.buckets):
            learned_at(learned)
        for k in range(self._launched, len(self.buckets)):
            self._launch(k, step, contribute)
        return list(self._pending), learned

    def collect(self, handles: Sequence[Handle | None], protocol: CommitProtocol, wait_s: float,
                log: LogFn, half_way: Callable[[], None] = lambda: None) -> list[ExchangeResult]:
        """Wait for every bucket of an exchange attempt, in order, telling ``protocol`` what became of each;
        returns the results of those exchanged. Raises ``RejoinRequired`` when the protocol says so. ``half_way``
        is called once half the buckets are collected (a fault hook)."""
        results = []
        for k, h in enumerate(handles):
            if k == len(handles) // 2:
                half_way()
            if h is None:
                protocol.lane(Failed(Failure.NOT_SENT))
                continue
            try:
                r = h.wait(wait_s)
            except FTARError as e:
                why = failure_of(e)
                if why is Failure.ERROR:
                    log(logging.WARNING, "bucket %d of %d: exchange failed: %s", k, len(handles), e)
                rejoin = protocol.lane(Failed(why))
                if rejoin is not None:
                    raise RejoinRequired(f"{rejoin.reason}: {e}") from e
            else:
                last = k == len(handles) - 1  # the last bucket ends with two float words: the digests and the mask
                results.append(exact.averaged_extras(r, 2 if last else 0) if self.exact is not None else r)
                protocol.lane(Exchanged(r.epoch, self.step_of(r), r.in_collective_s))
        return results

    def step_of(self, result: ExchangeResult) -> int:
        """The step an exchanged bucket belongs to."""
        return BucketTag.decode(result.tag, self.width).step

    def install(self, results: Sequence[ExchangeResult]) -> None:
        """Make a step's averaged gradients (every bucket's result) the parameters' ``.grad``. Only once the vote
        has committed (a redo needs the gradients as they were), so in place means: with ``alias`` the results
        *become* the gradients, without a copy; else they are copied in. FTAR holds these results to serve a
        partner that lost them (``ftar.reconcile``), so they may be aliased only when the optimizer never
        changes ``.grad`` in place (``grads_untouched``). Exact sums are converted once (``averaged``, which keeps
        them for the clipping factor's reading) and copied in."""
        if self.exact is not None:
            for p, g in zip((p for b in self.buckets for p in b), self.averaged(results), strict=True):
                bind_grad(p, g.clone())
            return
        fix = self.divisor_fix(results)
        for bucket, res in zip(self.buckets, results, strict=True):
            for p, g in zip(bucket, res.tensors, strict=False):  # the last bucket's digests and mask: no parameter
                if self.alias and fix == 1:
                    bind_grad(p, g)
                    continue
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                local_tensor(p.grad).copy_(g)
                if fix != 1:
                    local_tensor(p.grad).mul_(fix)

    @staticmethod
    def mask_of(results: Sequence[ExchangeResult]) -> list[float]:
        """The averaged slot mask of a step (see ``slot_mask``)."""
        return [float(x) for x in results[-1].tensors[-1].detach().cpu().tolist()]

    @staticmethod
    def digests_of(results: Sequence[ExchangeResult]) -> dict[int, int]:
        """The state digests of a step, per slot that sent one (``fthsdp.runtime.digest.unpack``)."""
        last = results[-1]
        return digest.unpack([float(x) for x in last.tensors[-2].detach().cpu().tolist()], last.contributors)
