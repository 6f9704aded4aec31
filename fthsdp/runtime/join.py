"""Joining (docs/design.md §6): a replica that starts while the others train catches up without stalling them.

It warms up (one thrown-away step, so its slow first step is not paid in the data plane), enters the data plane
(``Ready(JOINING)``), and from then on exchanges every step as a zero contributor, keeping the averaged gradients
it receives, while background threads fetch the snapshot of the step S the others are training (their state
until S's optimizer update, which waits for this replica's zeros of S) from the healthy replicas' catch-up
servers. Once every rank has its snapshot, the replica loads it and replays the kept steps S, S+1, ... with the
same optimizer step, so it ends bitwise identical to the others; then it turns active.
Replay, not re-fetching a newer snapshot: a fetch slower than a step would chase the others forever, while
replaying a step (an optimizer step, no forward or backward) is always faster than training one.

``Joiner`` holds the bookkeeping of that; the replica (``fthsdp.runtime.replica``) drives the exchanges.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from ftar import ExchangeResult
from ftar.devices import start_thread
from fthsdp.catchup.client import Fetch, FetchResult, Source
from fthsdp.catchup.wire import FetchFailed
from fthsdp.runtime.buckets import LogFn
from fthsdp.runtime.config import RuntimeConfig
from fthsdp.runtime.errors import DigestMismatch, FinishedWhileJoining, RejoinRequired
from fthsdp.runtime.faults import FaultInjector, Phase
from fthsdp.runtime.startup import all_ranks, from_rank0
from fthsdp.runtime.state import DIGEST
from lighthouse import membership as m
from lighthouse.client import LighthouseClient
from lighthouse.epoch_view import EpochView
from lighthouse.errors import Busy, FencedOut, HeldOut, JobOver

MAX_FETCHES = 5
"""Failed fetches of one catch-up before the replica gives up (and restarts to try again)."""
EARLY_POLL_S = 0.01
"""How often a joiner waiting for its fetch looks whether the step's exchange came in first (``Joiner.early``)."""
REGISTER_WAIT_S = 5.0
"""How long a joiner holds its share of the next step back while its sources register the fetch (``QUEUED``):
milliseconds normally; a source that takes longer may have passed the step, and the others serve it."""


def fetch_sources(members: Sequence[m.EpochMember], replica_id: str, slot: int) -> list[Source]:
    """The catch-up servers to fetch from: every other active member's. Each joiner starts on a different one
    (by its slot); the fetch's shared work queue balances the rest."""
    sources = [Source(x.replica_id, x.endpoints.catchup) for x in members
               if x.role == m.ACTIVE and x.replica_id != replica_id and x.endpoints.catchup]
    k = slot % len(sources) if sources else 0
    return sources[k:] + sources[:k]


class Joiner:
    """One replica's joining: entering the data plane once, then per catch-up the kept averaged gradients (per
    step, from the snapshot's step on) and the fetch of the snapshot."""

    def __init__(self, config: RuntimeConfig, rank: int, slot: Callable[[], int], client: LighthouseClient,
                 faults: FaultInjector, device: torch.device, log: LogFn, *,
                 epoch: Callable[[], EpochView | None]) -> None:
        self.config, self.rank, self.slot = config, rank, slot
        """``slot()``: the replica's data slot now (``Replica.slot``)."""
        self.client, self.faults, self.device, self.log = client, faults, device, log
        self.epoch = epoch
        """The replica's newest epoch (``StepCore.feed``): who to fetch from."""
        self.announced = False
        """Rank 0 told the lighthouse this replica is ready to enter the data plane."""
        self.warmed = False
        """It warmed up already (a warm standby, before its release: ``fthsdp.runtime.standby``)."""
        self.probe_s = 0.0
        """The trainer's own loop: what its warm-up iteration took, the probe step's time while held out."""
        self.kept: dict[int, list[ExchangeResult]] = {}
        self.fetch: Fetch | None = None
        self.layout: tuple[list[tuple[str, str, tuple[int, ...]]], int] | None = None
        self.target = -1
        """The step of the snapshot being fetched (the state after committing ``target - 1``)."""
        self.fetches = 0
        self.attempts = 0
        self.member_unix = 0.0
        """When this replica first exchanged a step (the others' groups include it from there)."""

    def enter(self, opt: torch.optim.Optimizer, closure: Callable[[], torch.Tensor] | None,
              layout: tuple[list[tuple[str, str, tuple[int, ...]]], int] | None = None) -> float:
        """Start a catch-up: warm up, then (rank 0) enter the data plane: the others wait for this replica from
        then on. Returns when it was ready to enter (Unix time). ``closure`` None: the trainer's own loop, which
        warmed up in an iteration of its own (a probe then reuses the warm-up's time). ``layout``: what a snapshot
        for this rank may be (``ShardState.layout``); the fetches refuse any other."""
        self.kept, self.fetch, self.target, self.fetches, self.attempts, self.member_unix = {}, None, -1, 0, 0, 0.0
        self.layout = layout
        if self.config.join_warmup and not self.announced and not self.warmed and closure is not None:
            warm_up(opt, closure, self.log)
            self.warmed = True  # a spare, once caught up, does not warm up again (``fthsdp.runtime.spares``)
        entered = time.time()
        if not self.announced:
            self._enter_data_plane(opt, closure)
            self.announced = True
        return entered

    def _enter_data_plane(self, opt: torch.optim.Optimizer, closure: Callable[[], torch.Tensor] | None) -> None:
        """Every rank: rank 0 asks to enter (``_announce``). While the lighthouse holds this replica out (it was
        ejected as slow: ``HeldOut``), every rank runs a probe step now and then, and rank 0 asks again with its
        time: a slow replica waits, alive and visible in the status, until it is healthy or the job ends. Refused
        because the job finished meanwhile: ``FinishedWhileJoining`` on every rank."""
        probe_s = 0.0
        while True:
            held, over = "", -1
            if self.rank == 0:
                self.faults.before_ready()
                try:
                    held = self._announce(probe_s, time.monotonic() + self.config.epoch_wait_s)
                except JobOver as e:
                    over = e.step
            is_held, over = from_rank0([int(bool(held)), over], self.device)
            if over >= 0:
                raise FinishedWhileJoining(over)
            if not is_held:
                return
            time.sleep(max(5.0, 10 * probe_s))  # probe pacing: at most a tenth of its time probing
            took = probe(opt, closure) if closure is not None else self.probe_s
            probe_s = took + self.faults.slow_down(self.faults.slow_from, took)  # FTHSDP_FAULT_SLOW: a slow host
            if self.rank == 0:
                self.log(logging.WARNING, "%s; probe step took %.3fs", held, probe_s)

    def _announce(self, probe_s: float, deadline: float) -> str:
        """Rank 0: Ready(JOINING) with the probe step's time, retried while another replica is joining (one at a
        time), up to ``deadline``. Returns '' once in, or why the lighthouse holds this replica out (probe and ask
        again). Refused because the job finished (since this incarnation registered): ``JobOver``. Refused because
        this incarnation is over otherwise (dropped): ``RejoinRequired``, so the next incarnation registers, never
        a crash."""
        while True:
            try:
                self.client.ready(m.JOINING, probe_s)
                return ""
            except JobOver:
                raise
            except FencedOut as e:  # this incarnation is over (dropped): come back
                raise RejoinRequired(f"could not enter the data plane: {e}") from e
            except HeldOut as e:
                return str(e)
            except Busy as e:
                if time.monotonic() > deadline:
                    raise RejoinRequired(f"could not enter the data plane: {e}") from e
                self.log(logging.INFO, "waiting to join: %s", e)
                time.sleep(0.2)  # retry pacing, bounded by the deadline

    def exchanged(self, step: int, results: list[ExchangeResult], attempts: int) -> FetchResult | None:
        """Step ``step`` was exchanged (zeros in, averaged gradients kept). Starts the fetch on the first step;
        returns the snapshot once every rank of the replica has its own (a collective: every rank calls it
        after every step), or None to go on exchanging."""
        self.member_unix = self.member_unix or time.time()
        self.attempts += attempts
        self.kept[step] = results
        if self.fetch is None:  # not started at the first exchange (``fetch_from``), or dropped after a failure
            self.fetch_from(step + 1)
        for s in [s for s in self.kept if s < self.target]:
            del self.kept[s]
        if len(self.kept) > self.config.max_replay:
            raise RejoinRequired(f"the catch-up fetch is {len(self.kept)} steps behind (FTHSDP_CATCHUP_MAX_REPLAY="
                                 f"{self.config.max_replay})")
        return self._collect()

    def fetch_from(self, step: int) -> None:
        """Fetch the snapshot of ``step``, a step whose zeros this replica has not all sent yet: the others hold
        its state until its optimizer update, which waits for them, so once the sources have registered the
        request (before those zeros go out) each one serves that state. A catch-up calls it as soon as its first
        exchange names the step (``StepCore.exchange_all``'s ``learned_at``): the snapshot then travels while the
        others compute that step, and may be in when its exchange settles, a step sooner than a fetch of the next."""
        self.target = step
        self.fetch = self._start_fetch(step)
        self.fetches += 1
        self.fetch.wait_registered(REGISTER_WAIT_S)

    def early(self, exchanged: Callable[[], bool]) -> FetchResult | None:
        """While this replica's zeros of the next step are in flight (``exchanged()``: that exchange is in), wait
        for whichever comes first, the exchange or this rank's fetch (the training thread has nothing else to do);
        then, with every rank (a collective), take the snapshot if every rank has it: loaded before that step's
        exchange settles, it saves the joiner a step. None: go on exchanging."""
        if self.fetch is None:  # every rank's fetch failed and was dropped: a new one starts at the next step
            return None
        while not exchanged() and not self.fetch.wait(EARLY_POLL_S):
            pass
        return self._collect()

    def _collect(self) -> FetchResult | None:
        """Every rank (a collective): the snapshot, once every rank has its own; after a failed fetch on any rank,
        every rank drops it (and its kept steps) and starts over at a newer step."""
        assert self.fetch is not None
        if not all_ranks(self.fetch.done(), self.device):
            return None
        try:
            got: FetchResult | None = self.fetch.result(timeout=0)
        except FetchFailed as e:
            self.log(logging.WARNING, "catch-up fetch of step %d failed: %s", self.target, e)
            got = None
        if not all_ranks(got is not None, self.device):
            self.fetch = None  # every rank starts over with a newer step
            self.kept.clear()
            if self.fetches >= MAX_FETCHES:
                raise RejoinRequired(f"catch-up failed {self.fetches} times")
            return None
        return got

    def _start_fetch(self, step: int) -> Fetch:
        epoch = self.epoch()
        sources = fetch_sources(epoch.members if epoch is not None else (), self.config.replica_id, self.slot())
        self.log(logging.INFO, "fetching the snapshot of step %d from %s", step, [s.replica_id for s in sources])
        expected, max_bytes = self.layout if self.layout is not None else (None, None)
        return Fetch(sources, job=self.config.job_id, replica_id=self.config.replica_id, rank=self.rank, step=step,
                     incarnation=self.client.incarnation, token=self.config.token, wait_s=self.config.epoch_wait_s,
                     expected=expected, max_bytes=max_bytes, on_chunk=lambda s, n: self.faults.at(s, Phase.FETCH)
                     ).start()

    def verify(self, got: FetchResult, mine: bytes) -> None:
        """After loading the snapshot, before replaying: this rank's digest of its state (``mine``, RNG included)
        must be the source's digest of the snapshot, on every rank (a collective), else ``DigestMismatch``."""
        theirs = got.tensors.get(DIGEST)
        ok = theirs is not None and theirs.numpy().tobytes() == mine
        if not all_ranks(ok, self.device):
            msg = (f"replica {self.config.replica_id} (index {self.slot()}): the snapshot of step {got.step} from "
                   f"{sorted(got.sources)}, once loaded, does not hash like the source's (rank {self.rank}: "
                   f"{'matches' if ok else 'differs'}): a registered object or param group did not load as saved")
            self.log(logging.ERROR, "%s", msg)
            raise DigestMismatch(msg, got.step, (self.slot(),))
        self.log(logging.INFO, "the loaded snapshot of step %d matches its source's digest", got.step)

    def keep(self, step: int, results: list[ExchangeResult], attempts: int) -> None:
        """Step ``step`` was exchanged while the snapshot is applied: keep its averaged gradients for the replay."""
        self.attempts += attempts
        self.kept[step] = results
        if len(self.kept) > self.config.max_replay:
            raise RejoinRequired(f"the catch-up replay is {len(self.kept)} steps behind (FTHSDP_CATCHUP_MAX_REPLAY="
                                 f"{self.config.max_replay})")

    def replay_slice(self, last: int, commit: Callable[[int, list[ExchangeResult]], object], budget_s: float,
                     at_least: int) -> int:
        """Replay kept steps in order through ``commit(step, results)`` (it advances the state's step), up to
        ``last``: at least ``at_least`` of them, then on while within ``budget_s``. Returns how many it replayed;
        each one's gradients are dropped once applied."""
        t0, n = time.perf_counter(), 0
        while self.kept and min(self.kept) <= last and (n < at_least or time.perf_counter() - t0 < budget_s):
            step = min(self.kept)
            commit(step, self.kept.pop(step))
            n += 1
        return n

    def report(self, got: FetchResult, replayed: int, t_start: float, t_in: float, t_applied: float,
               entered: float) -> dict[str, object]:
        """How the catch-up went (``StepResult.catchup``): ``t_start`` when it started, ``t_in`` when the snapshot
        was in, ``t_applied`` when it was loaded and replayed (``time.perf_counter``); ``entered`` when the
        replica was ready to enter the data plane (Unix time)."""
        now = time.perf_counter()
        return {"bytes": got.bytes, "transfer_s": round(got.transfer_s, 4), "wait_s": round(got.wait_s, 4),
                "sources": got.sources, "source_failures": got.source_failures,
                "refetched_chunks": got.refetched_chunks, "snapshot_step": got.step, "replayed": replayed,
                "fetches": self.fetches, "apply_s": round(t_applied - t_in, 4), "active_s": round(now - t_applied, 4),
                "catchup_s": round(now - t_start, 4), "entered_unix": entered, "member_unix": self.member_unix}

    def turn_active(self) -> None:
        """Rank 0: Ready(ACTIVE), off the critical path: the role change keeps the data plane (the epoch's
        plane), so training does not wait for the lighthouse; a slow or failing-over one only delays the role."""
        if self.rank == 0:
            start_thread(self._ready_active, name="fthsdp-ready-active", device=None)  # the lighthouse only

    def _ready_active(self) -> None:
        """Ready(ACTIVE), retried (bounded by epoch_wait_s) while the lighthouse does not answer."""
        deadline = time.monotonic() + self.config.epoch_wait_s
        while True:
            try:
                self.client.ready(m.ACTIVE)
                return
            except Exception as e:  # noqa: BLE001 - a background retry loop: log, retry, give up at the deadline
                if time.monotonic() > deadline:
                    self.log(logging.ERROR, "could not tell the lighthouse this replica is active: %s", e)
                    return
                self.log(logging.WARNING, "Ready(active) failed (%s); retrying", e)
                time.sleep(0.5)  # retry pacing, bounded by the deadline


def probe(opt: torch.optim.Optimizer, closure: Callable[[], torch.Tensor]) -> float:
    """Seconds one forward and backward take (every rank, together), thrown away: how fast this replica computes
    now, for a lighthouse that ejected it as slow (``lighthouse.ejection.held_out``)."""
    t0 = time.perf_counter()
    closure().backward()  # type: ignore[no-untyped-call]
    took = time.perf_counter() - t0
    opt.zero_grad(set_to_none=True)
    return took


def warm_up(opt: torch.optim.Optimizer, closure: Callable[[], torch.Tensor], log: LogFn,
            optimizer_step: bool = True) -> None:
    """One forward, backward and optimizer step, thrown away, before entering the data plane: a process's first
    step is slow (FSDP2's lazy init, the optimizer's first step, first allocations), and once this replica is
    a member the others would wait for it. Nothing is exchanged; what the optimizer step changes is
    overwritten by the snapshot (every parameter and optimizer-state tensor). The closure must not consume data
    (index the data by ``cursor``). Without ``optimizer_step`` (a warm standby, whose role is not known yet) the
    state stays exactly as built."""
    t0 = time.perf_counter()
    loss = closure()
    loss.backward()  # type: ignore[no-untyped-call]
    if optimizer_step:
        opt.step()
    opt.zero_grad(set_to_none=True)
    log(logging.INFO, "warm-up step%s took %.3fs", "" if optimizer_step else " (no optimizer step)",
        time.perf_counter() - t0)
