"""The replica's step core (docs/design.md §3): one rank's context, built whole, and the moves every step of every
role is made of.

- ``settle``: wait for the step's buckets and vote, redoing the exchange under a new epoch until it commits;
- ``vote``: the replica-local MAX all-reduce of every rank's ballot (the commit protocol: ``commit.py``);
- ``commit``: the optimizer step with the degraded-mode learning rate, the data cursors of the contributing slots;
- ``after_commit``: the lighthouse's step, the snapshot boundary, checkpoints, a SIGTERM's stop.

The roles (``fthsdp.runtime.roles``: active, joining, spare, standby, ...) and the trainer's drivers
(``fthsdp.runtime.iteration``) are built on these public methods and nothing else of the replica; the core knows of
a role only what its state is (``Standing``). The replica learns its epochs in one place, ``feed`` (FTAR's
membership interface; the lighthouse client publishes into it, and a follower rank's epochs come from rank 0
through ``epochs``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ftar import EpochFeed, ExchangeResult, FTARConfig, FTARError, Handle, LaneEngine, LighthouseMembership, nccl_env
from fthsdp.catchup.server import CatchupServer
from fthsdp.runtime import checkpoint, ending, grad_scale, orphans, posts, selfcheck, siblings, startup
from fthsdp.runtime.agreement import DigestCheck
from fthsdp.runtime.buckets import BucketExchange, failure_of
from fthsdp.runtime.checkpoint_writer import CheckpointWriter
from fthsdp.runtime.commit import Commit, CommitProtocol, Rejoin, Tally, advance_cursors, contributing_slots
from fthsdp.runtime.config import RuntimeConfig
from fthsdp.runtime.device_clock import DeviceClock
from fthsdp.runtime.epoch_relay import GroupEpochs
from fthsdp.runtime.errors import JobFinished, NoStateToResume, RejoinRequired, Terminated
from fthsdp.runtime.faults import FaultInjector, Phase
from fthsdp.runtime.join import Joiner
from fthsdp.runtime.lr import lr_factor
from fthsdp.runtime.metrics import ReplicaMetrics
from fthsdp.runtime.pace import PaceWindow
from fthsdp.runtime.standing import Standing
from fthsdp.runtime.state import ShardState
from fthsdp.runtime.timeline import Timeline
from fthsdp.runtime.trainer_state import TrainerState
from lighthouse import membership as m
from lighthouse.client import LighthouseClient
from lighthouse.incarnations import finished_step_of
from lighthouse.model import NO_SLOT

log = logging.getLogger("fthsdp.runtime")


class StepCore:
    """One rank's context and step core. Built whole here (the process group, the catch-up server, the lighthouse
    session registering ``layout``: ``loop.layout_of``; FTAR's lane); the model and optimizer join it at ``attach``."""

    def __init__(self, config: RuntimeConfig, layout: str = "") -> None:
        self.config = cfg = config
        startup.die_with_parent(cfg.under_torchrun)
        if cfg.backend == "nccl":
            torch.cuda.set_device(cfg.device_index)
        nccl_env.prepare_process()  # c10d reads its watchdog settings as it builds each group: before the first
        if not dist.is_initialized():
            dist.init_process_group(cfg.backend)
        if dist.get_world_size() != cfg.world_size or dist.get_rank() != cfg.rank:
            raise RuntimeError("the replica's process group does not match RANK/WORLD_SIZE")
        self.rank, self.world_size = cfg.rank, cfg.world_size
        self.slot, self.slots = cfg.asked_slot, cfg.num_replicas  # this step's data slot (-1: a spare); the job's
        self.device = torch.device("cuda", torch.cuda.current_device()) if cfg.backend == "nccl" \
            else torch.device("cpu")
        self.mesh = init_device_mesh(self.device.type, (cfg.world_size,))
        self.faults = FaultInjector.for_rank(cfg.faults, self.rank)
        if cfg.selfcheck:  # before anything registers or serves: a broken host is reported, not let back
            selfcheck.run(self.rank, self.world_size, self.device, min_gflops=cfg.selfcheck_min_gflops,
                          timeout_s=cfg.timeout_s * 6, fail=self.faults.fails_selfcheck)
        self.incarnation = startup.agree_incarnation(self.rank, self.device)
        self.step = 0  # committed steps so far (a joiner learns it at its first exchange)
        self.learned = -1  # a joiner: the step it learned from its first exchange (-1: not yet)
        self.cursors = torch.zeros(cfg.num_replicas, dtype=torch.int64)  # per slot, batches trained (the job's)
        self.protocol = CommitProtocol()
        self.pace_window, self.own_compute_s = PaceWindow(), 0.0  # fail-slow evidence; last step's compute, unslowed
        self.busy_ms, self.ranks_busy_ms, self.ranks_lane_ms = 0, tuple[int, ...](), tuple[int, ...]()  # fail-slow
        self.lr_factor = 1.0
        self.held: tuple[int, ...] = ()  # the slots whose holders contributed to the last commit (its writers)
        self.scales: dict[int, float] = {}  # a zero contributor's: per step, the factor the trainers scaled it by
        self.state = TrainerState()  # param groups and registered objects: they travel with the tensors
        self.terminated = False  # stopped by SIGTERM
        self.job_over_at: int | None = None  # the step the job finished at, when the lighthouse said so (``on_lost``)
        self.feed = EpochFeed()
        timed = cfg.timeline_events > 0
        self.timeline = Timeline(max(1, cfg.timeline_events), enabled=timed,
                                 epoch=lambda: e.number if (e := self.feed.current()) is not None else 0,
                                 clock=DeviceClock.for_device(self.device) if timed and self.device.type == "cuda"
                                 else None)
        self.server = CatchupServer(job=cfg.job_id, replica_id=cfg.replica_id, rank=self.rank,
                                    world_size=self.world_size, host=cfg.host, snapshot=self._snapshot,
                                    seal=ShardState.seal, device=self.device, epoch=self.feed.current,
                                    token=cfg.token, wait_s=cfg.epoch_wait_s, on_chunk_sent=self.faults.on_chunk_sent,
                                    corrupt=self.faults.corrupter())
        self.server.directory = startup.gather_strings(self.server.address, self.world_size, self.device)
        self.server.incarnation = self.incarnation  # for fthsdp trace, with the timeline if this rank keeps one
        self.server.timeline = self.timeline.read if self.timeline.enabled else None
        self.metrics = ReplicaMetrics(cfg.replica_id, self.rank, port=cfg.metrics_port, addr=cfg.host)
        self.client = LighthouseClient(cfg.lighthouse, cfg.job_id, cfg.replica_id, shard_count=cfg.world_size,
                                       on_epoch=self.feed.publish, incarnation=self.incarnation, layout=layout,
                                       endpoints=m.Endpoints(catchup=self.server.address),
                                       security=cfg.security, on_lost=self.on_lost, slot=self.slot, slots=self.slots)
        self.membership = LighthouseMembership(self.client, self.feed, key=cfg.token, host=cfg.host)  # + lane store
        self.engine = LaneEngine(self.membership, lane=self.rank, config=FTARConfig(
            backend=cfg.backend, timeout_s=cfg.timeout_s, epoch_wait_s=cfg.epoch_wait_s, hold=True, device=self.device,
            before_collective=self.faults.link_hook))
        # One session per group: rank 0 relays its epochs, and that the lighthouse dropped this incarnation.
        self.epochs = GroupEpochs(self.client, self.feed, self.rank, self.world_size, on_lost=self.on_lost,
                                  key=startup.group_secret(self.rank, self.device))
        self.writer = CheckpointWriter(cfg.checkpoint_dir, cfg.replica_index, self.rank, cfg.token, log_line=self.log,
                                       asynchronous=cfg.writes_behind)
        self.siblings = siblings.watch(self.client, self.rank, self.world_size, cfg.rank_timeout_s, self.log,
                                       self.device)  # a rank silent for FTHSDP_RANK_TIMEOUT ends the replica
        self.check = DigestCheck(cfg.digest_every, lambda: self.slot, self.log, self.client.set_digest)
        self.joiner = Joiner(cfg, self.rank, lambda: self.slot, self.client, self.faults, self.device, self.log,
                             epoch=self.feed.current)
        self.standing = Standing.STANDBY
        """What this replica's state is (its role's: ``fthsdp.runtime.roles``): a standby's until it registers
        (``register``; at once unless it is a warm standby, ``FTHSDP_STANDBY_GATE``)."""
        self.waiting: list[Callable[[], object]] = []
        self.resume: checkpoint.Checkpoint | None = None  # the checkpoint the role resumes from, until loaded
        self.resumed_from: int | None = None  # the step of the checkpoint this replica resumed from, if it did
        self.model: nn.Module | None = None
        self.opt: torch.optim.Optimizer | None = None
        self._parts: tuple[ShardState, BucketExchange] | None = None
        self.on_active: Callable[[], None] | None = None
        """Run once, at this incarnation's first commit as an active replica (``fthsdp.runtime.session``)."""

    def attach(self, model: nn.Module, params: list[nn.Parameter], opt: torch.optim.Optimizer,
               buckets: BucketExchange) -> None:
        """The trainer's sharded model (``params``: its sharded parameters), its optimizer and the model's buckets:
        the step core is whole. A registered replica takes its place now (``take_place``)."""
        self.model, self.opt = model, opt
        self._parts = ShardState(params, opt, self.device, self.state), buckets
        buckets.timeline = self.timeline
        if self.standing is not Standing.STANDBY:
            self.take_place()

    def register(self) -> startup.Role:
        """Register (rank 0; the others watch): returns the role the lighthouse gives this replica, with the
        checkpoint it resumes from chosen (``resume``). The caller takes that role, then ``registered``."""
        cfg = self.config
        given, finished_step = startup.register(self.epochs, self.rank, cfg.epoch_wait_s, self.device)
        try:
            self.resume = startup.start_from(given, finished_step, cfg.job_id, cfg.checkpoint_dir)
        except (JobFinished, NoStateToResume):
            self.close(leave=False)
            raise
        if given == startup.Role.FINISHED:
            self.client.close()  # not registered: nothing to heartbeat
            self.log(logging.WARNING, "the job finished at step %d before this replica came back: taking its final "
                     "checkpoint, training nothing", finished_step)
        return given

    def registered(self) -> None:
        """In the role the registration gave: once the optimizer is attached, take its place; then run what waited
        for the registration (``when_registered``)."""
        if self._parts is not None:
            self.take_place()
        for fn in self.waiting:
            fn()
        self.waiting.clear()

    def when_registered(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` once registered: now, or for a warm standby once released (a launcher's ``start`` line)."""
        if self.standing is Standing.STANDBY:
            self.waiting.append(fn)
        else:
            fn()

    def take_place(self) -> None:
        """Registered, with the optimizer: load the checkpoint the role needs, and serve snapshots if a member."""
        if (ck := self.resume) is not None:
            assert self.model is not None
            self.cursors = checkpoint.resume(ck, self.model, self.parts()[0], len(self.cursors), self.rank,
                                             self.config.token)
            self.step = ck.step
            if self.standing is not Standing.FINISHED:  # a finished job's final state: nothing resumes
                self.resumed_from = ck.step
                self.log(logging.WARNING, "resumed from checkpoint %s", ck.path)
            self.resume = None
        if self.standing is Standing.MEMBER:
            self.parts()[0].mark(self.cursors)  # what a snapshot of the coming step takes at its boundary
            self.server.at_commit(self.step, active=True)

    def parts(self) -> tuple[ShardState, BucketExchange]:
        """This rank's state (the shards, the optimizer, registered objects) and the step's bucket exchange."""
        if self._parts is None:
            raise RuntimeError("call optimizer(opt) first")
        return self._parts

    def _snapshot(self) -> list[tuple[str, torch.Tensor]]:
        return self.parts()[0].snapshot()

    @property
    def joining(self) -> bool:
        """True until this replica holds the others' state (a warm standby counts as joining until it registers)."""
        return self.standing in (Standing.STANDBY, Standing.JOINING)

    @property
    def standby(self) -> bool:
        """A warm standby not released yet: unregistered until its first step (``fthsdp.runtime.standby``)."""
        return self.standing is Standing.STANDBY

    @property
    def finished(self) -> bool:
        """The job completed before this replica came back: it holds the final checkpoint, never trains."""
        return self.standing is Standing.FINISHED

    @property
    def cursor(self) -> int:
        """Index of the next batch of this replica's data slot (``slot``; a spare has none: ``RuntimeError``)."""
        if self.slot == NO_SLOT:
            raise RuntimeError(f"replica {self.config.replica_id} is a spare at step {self.step}: it has no data "
                               "slot, so no batch to train (train_step does not call the closure of a spare)")
        return int(self.cursors[self.slot])

    def log(self, level: int, msg: str, *args: object) -> None:
        """Every line says which replica, rank, epoch and (committed) step it is about."""
        epoch = self.feed.current()
        log.log(level, "fthsdp replica=%s rank=%d epoch=%d step=%d " + msg, self.config.replica_id, self.rank,
                epoch.number if epoch is not None else 0, self.step, *args)

    def on_lost(self, reason: str) -> None:
        """The lighthouse dropped this incarnation (e.g. hung; rank 0 learns it, the others from rank 0's relay):
        fail the exchanges now, so that every rank restarts and rejoins (or, told the job finished, takes the final
        checkpoint in place: ``job_over_at``, ``roles.finished_meanwhile``, ``session``)."""
        self.log(logging.WARNING, "the lighthouse dropped this replica (%s): its exchanges fail from now on", reason)
        self.job_over_at = finished_step_of(reason)
        self.epochs.lost(reason)
        self.engine.exclude(f"dropped by the lighthouse: {reason}")

    def seen_slot(self) -> int:
        """This replica's slot in the newest epoch this rank saw (``NO_SLOT``: none, or not in it)."""
        epoch = self.feed.current()
        me = epoch.member(self.client.replica_id) if epoch is not None else None
        return me.slot if me is not None and me.incarnation == self.incarnation else NO_SLOT

    def take_slot(self, slot: int) -> None:
        """Train ``slot`` from the next step on (the tally's, at a commit): the data cursor, the slot mask and the
        digest read it."""
        if slot == self.slot:
            return
        self.log(logging.INFO, "data slot %s from step %d (was %s)", "none (a spare)" if slot == NO_SLOT else slot,
                 self.step + 1, "none" if self.slot == NO_SLOT else self.slot)
        self.slot = slot

    @property
    def wait_s(self) -> float:
        """How long a wait on an exchange lasts before it is an error."""
        return self.config.epoch_wait_s * 2 + 60

    # --- the step core ------------------------------------------------------------------------------------------

    def settle(self, handles: list[Handle | None], contribute: bool,
               redo: Callable[[Tally], list[Handle | None]] | None = None) -> tuple[Commit, list[ExchangeResult]]:
        """Wait for the step's buckets and vote, redoing the exchange (``redo``'s, if given) until it commits."""
        _, buckets = self.parts()
        self.protocol.begin()
        while True:
            self.faults.at(self.step, Phase.EXCHANGE)
            results = buckets.collect(handles, self.protocol, self.wait_s, self.log,
                                      lambda: self.faults.at(self.step, Phase.EXCHANGE_LATE))
            self.faults.at(self.step, Phase.VOTE)
            tally = self.vote()
            decision = self.protocol.vote(tally)
            if isinstance(decision, Commit):
                self.take_slot(tally.slot)  # the slot the newest epoch gives this replica, from the next step
                # Hold this step's results until the next commit: a partner that lost one of them is served it.
                self.engine.forget_before(buckets.sequence(decision.step))
                if buckets.posts and not contribute:  # the trainers' change to the step's gradients, to apply too
                    self.scales[decision.step] = self.post(decision.step, None, None)[0]
                return decision, results
            if isinstance(decision, Rejoin):
                raise RejoinRequired(f"step {self.step}: {decision.reason}")
            self.metrics.on_retry(decision.reason)
            self.log(logging.INFO, "vote failed (epochs %s, failed=%d); redoing the step's exchange",
                     list(decision.epochs), decision.failed)
            # Partners that committed moved on in that epoch's group; if no lane's reports ask past it, ask.
            self.engine.reset(after=tally.newest, reform=tally.reform)
            handles = redo(tally) if redo is not None else self.exchange_all(contribute, redo=True)

    def exchange_all(self, contribute: bool, redo: bool = False,
                     learned_at: Callable[[int], None] | None = None) -> list[Handle | None]:
        """Exchange every bucket of the step from the gradients at hand (a ``redo``, or a joiner's zeros). A joiner
        that has not learned the step yet learns it from its first exchange (``BucketExchange.exchange_all``)."""
        step = self.step if not self.joining or self.learned >= 0 else None
        handles, learned = self.parts()[1].exchange_all(step, contribute, redo=redo, learned_at=learned_at)
        if learned is not None:
            self.learned = self.step = learned
        return handles

    def vote(self, protocol: CommitProtocol | None = None) -> Tally:
        """The replica-local vote: one MAX all-reduce of every rank's ballot (``protocol``'s, the step's by
        default). It carries SIGTERM too, so every rank stops at the same commit boundary without a collective of
        its own, and this rank's busy time in the step's compute (``busy_ms``: the tally has every rank's)."""
        ballot = (protocol or self.protocol).ballot(self.engine.asking, self.seen_slot(), self.busy_ms, self.rank,
                                                    self.world_size)
        ctrl = torch.tensor(ballot.encode(), dtype=torch.int64, device=self.device)
        with self.timeline.timed("vote", "vote", self.step):
            dist.all_reduce(ctrl, op=dist.ReduceOp.MAX)
        self.ranks_busy_ms, self.ranks_lane_ms = (tally := Tally.decode(ctrl.tolist())).busy_ms, tally.lane_ms
        return tally

    def commit(self, step: int, results: list[ExchangeResult], installed: bool = False) -> tuple[tuple[int, int], ...]:
        """Apply a step's averaged gradients (bound already with ``installed``, and changed by the trainer's loop
        maybe; else bound here and scaled as the trainers did, ``grad_scale``): the optimizer step with the
        degraded-mode learning rate, the data cursors of the slots that contributed, ``self.step = step + 1``.
        Replaying a kept step runs this too, so a joiner's state follows the same arithmetic as the others'.
        Returns the batches the step trained."""
        shards, buckets = self.parts()
        contributors, mask = results[-1].contributors, buckets.mask_of(results)
        if buckets.parts:  # every part of every slot trained is in the sum: the orphans' cursors move too
            self.held, slots = orphans.read_mask(mask, contributors, self.slots, buckets.parts, self.step)
        else:
            self.held = slots = contributing_slots(mask, contributors, self.step)
        if not installed:
            buckets.install(results)
            grad_scale.apply(buckets.grads(), self.scales.pop(step, 1.0))
        for old in [s for s in self.scales if s < step]:  # settled before a snapshot that made them moot
            del self.scales[old]
        factor = lr_factor(self.config.lr_rule, len(slots), self.config.num_replicas)
        joining = self.joining
        if factor != self.lr_factor and not joining:
            self.log(logging.WARNING, "learning rate x%.4f (%s rule: %d of %d slots trained)", factor,
                     self.config.lr_rule, len(slots), self.config.num_replicas)
        self.lr_factor = factor
        self.faults.at(step, Phase.OPTIMIZER)
        self.server.before_update(step)  # a snapshot of this step's state in progress finishes first
        with self.timeline.timed("optimizer", "optimizer", step):
            shards.optimizer_step(factor)
        if not joining and self.faults.corrupts(step):
            shards.flip_bit()
            self.log(logging.WARNING, "FTHSDP_FAULT_CORRUPT: flipped a bit of this replica's state")
        cursors, batches = advance_cursors(self.cursors.tolist(), slots)
        self.cursors = torch.tensor(cursors, dtype=torch.int64)
        self.step = step + 1
        return batches

    def after_commit(self, holders: tuple[int, ...], stop: bool) -> None:
        """Commit-boundary duties: lighthouse step, snapshot for joiners, checkpoints (a share by each of the
        ``holders``: the slots whose holders contributed, ``held``), and stopping if the vote carried a SIGTERM; the
        first one as an active replica runs ``on_active`` (a launcher's cue)."""
        self.client.set_step(self.step)
        on_active = self.on_active
        if on_active is not None and not self.joining:
            self.on_active = None
            on_active()
        self.parts()[0].mark(self.cursors)  # what a snapshot of the coming step takes at its boundary
        self.server.at_commit(self.step, active=True)
        cfg = self.config
        if cfg.checkpoint_dir and cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 \
                and self.slot in (writers := sorted(holders)):  # a share each (``checkpoint``)
            self.checkpoint(now=False, share=(writers.index(self.slot), len(writers)))
        if stop:
            path = self.checkpoint() if cfg.checkpoint_dir else None
            self.log(logging.WARNING, "SIGTERM: stopping at a commit boundary%s",
                     f" (checkpoint {path})" if path else " (no FTHSDP_CHECKPOINT_DIR: nothing saved)")
            self.terminated = True
            self.close(leave=True)
            raise Terminated(self.step, path)

    def checkpoint(self, now: bool = True, share: tuple[int, int] = (0, 1)) -> str:
        """Write this rank's part of this replica's ``share`` of a checkpoint of the committed state; its path. ``now``
        False: begin it ('' returned), written off the step with ``FTHSDP_CHECKPOINT_ASYNC`` (``checkpoint_writer``)."""
        assert self.model is not None and self.opt is not None
        write = self.writer.now if now else self.writer.periodic
        with self.timeline.timed("checkpoint" if now else "checkpoint (staged)", "checkpoint", self.step):
            return str(write(self.step, self.model, self.opt, self.cursors, self.parts()[0].side_state(), share) or "")

    def post(self, step: int, factor: float | None, loss: float | None) -> tuple[float, float]:
        """The step's post exchange on this rank's lane (``BucketExchange.launch_post``), waited for, with its own
        bounded retries: returns (the factor the contributors scaled the step's gradients by, their mean loss)."""
        _, buckets = self.parts()
        for attempt in range(1, self.protocol.max_attempts + 1):
            try:
                handle = buckets.launch_post(step, factor, loss)
                buckets.unchecked = None  # read here
                return buckets.post_of(handle.wait(self.wait_s))
            except FTARError as e:
                if failure_of(e).needs_rejoin:
                    raise RejoinRequired(f"step {step}'s post exchange: {e}") from e
                self.log(logging.WARNING, "step %d: post exchange failed (attempt %d): %s", step, attempt, e)
                self.engine.reset()
        raise RejoinRequired(f"step {step}'s post exchange failed {self.protocol.max_attempts} times")

    def end_of_job(self) -> None:
        """Before leaving after the last step: wait until every member of the epoch is at this step too (a member
        one step behind is served that step's results by this replica meanwhile: it must not redo it alone, with
        no holder left), then write the final checkpoint (a replica that comes back after the job finished takes
        it), then leave "finished" (the lighthouse then tells late comers the job is over). The barrier goes
        through the replica-local vote like a step's exchange (``fthsdp.runtime.ending``)."""
        _, buckets = self.parts()
        if ending.barrier(buckets, self.engine, self.step, self.vote, self.wait_s, self.log):
            posts.agree(buckets, self.wait_s)  # the last step's post exchange came back before the barrier
        buckets.unchecked = None
        if self.config.checkpoint_dir:
            self.checkpoint()

    def close(self, leave: bool = True) -> None:
        """Stop the engine, the lighthouse session (rank 0 leaves the job) and then the catch-up server (a closed
        session whose endpoint refuses connections is a dead replica: ``lighthouse.server.probe``; transfers in
        progress get a few seconds). An active replica that leaves at the end first ends the job (``end_of_job``)."""
        if leave and self.standing is Standing.MEMBER and not self.terminated and self._parts is not None:
            self.end_of_job()
        for part in (self.writer, self.siblings, self.engine, self.membership):
            part.close()
        self.epochs.close()
        self.client.close(leave="finished" if leave and self.rank == 0 else None)
        self.server.close(drain_s=10.0)
        self.metrics.close()
