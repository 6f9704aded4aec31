"""The trainer-facing runtime: FSDP2 inside the replica, FTAR across replicas, and the commit protocol.

A training process (one rank of one replica group, started by torchrun) does::

    ft = fthsdp.runtime.Replica()                 # reads FTHSDP_* and torchrun's env
    model = ft.shard(model, blocks=model.blocks)  # FSDP2 over the replica's ranks
    opt = ft.optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))   # scheduler=... : stepped per commit
    while ft.step < steps:
        result = ft.train_step(lambda: loss_fn(model, batch_for(ft.slot, ft.cursor)))

``train_step`` runs one step under the commit protocol (docs/design.md §3): forward/backward, FTAR of every
gradient bucket across replicas (``fthsdp.runtime.buckets``), a replica-local vote, then commit (optimizer step,
data cursors advanced: exactly-once data, §7) or redo the exchange under the next epoch from the same gradients.
The rules are a pure state machine (``fthsdp.runtime.commit``); no lighthouse round trip happens on this path.
A replica that starts while others train catches up without stalling them (§6, ``fthsdp.runtime.join``); the
replicas compare state digests every ``FTHSDP_DIGEST_EVERY`` steps (``fthsdp.runtime.agreement``).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ftar import EpochFeed, ExchangeResult, FTARConfig, Handle, LaneEngine, LighthouseMembership
from fthsdp.catchup.server import CatchupServer
from fthsdp.runtime import checkpoint, ending, grad_scale, spares
from fthsdp.runtime.agreement import DigestCheck
from fthsdp.runtime.buckets import BucketExchange, grads_untouched
from fthsdp.runtime.commit import (
    Commit,
    CommitProtocol,
    Rejoin,
    Tally,
    advance_cursors,
    contributing_slots,
)
from fthsdp.runtime.config import RuntimeConfig
from fthsdp.runtime.epoch_relay import GroupEpochs
from fthsdp.runtime.errors import JobFinished, NoStateToResume, RejoinRequired, Terminated
from fthsdp.runtime.faults import FaultInjector, Phase
from fthsdp.runtime.iteration import Steps
from fthsdp.runtime.join import Joiner
from fthsdp.runtime.loop import LoopOptimizer, absorb_step, fsdp_units
from fthsdp.runtime.lr import lr_factor
from fthsdp.runtime.metrics import ReplicaMetrics
from fthsdp.runtime.pace import PaceWindow
from fthsdp.runtime.startup import Role, agree_incarnation, die_with_parent, gather_addresses, register, start_from
from fthsdp.runtime.state import ShardState, replica_hash
from fthsdp.runtime.trainer_state import Scheduler, Stateful, TrainerState
from lighthouse import membership as m
from lighthouse.client import LighthouseClient

log = logging.getLogger("fthsdp.runtime")

class Replica(Steps):
    """One rank's handle on fault-tolerant HSDP. Create it after torchrun has set the environment."""

    def __init__(self, config: RuntimeConfig | None = None) -> None:
        self.config = cfg = config or RuntimeConfig.from_env()
        die_with_parent(cfg.under_torchrun)
        if cfg.backend == "nccl":
            torch.cuda.set_device(cfg.device_index)
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
        self.incarnation = agree_incarnation(self.rank, self.device)
        self.step = 0  # committed steps so far (a joiner learns it at its first exchange)
        self.cursors = torch.zeros(cfg.num_replicas, dtype=torch.int64)  # per slot, batches trained (the job's)
        self._settling: list[Handle | None] | None = None  # caught up: the next step's zeros, sent (zero_step)
        self.protocol = CommitProtocol()
        self.pace, self._own_compute_s = PaceWindow(), 0.0  # fail-slow evidence; the last step's compute, unslowed
        self.shadow = spares.Shadow()  # a spare's step clock
        self._lr_factor = 1.0
        self.state = TrainerState()  # param groups and registered objects: they travel with the tensors
        self.check = DigestCheck(cfg.digest_every, lambda: self.slot, self._log,
                                 lambda s, d: self.client.set_digest(s, d))
        self.server = CatchupServer(job=cfg.job_id, replica_id=cfg.replica_id, rank=self.rank,
                                    world_size=self.world_size, host=cfg.host,
                                    snapshot=lambda: self._parts()[0].snapshot(),
                                    seal=ShardState.seal, device=self.device,
                                    epoch=lambda: self.client.epoch if hasattr(self, "client") else None,
                                    token=cfg.token, wait_s=cfg.epoch_wait_s, on_chunk_sent=self.faults.on_chunk_sent,
                                    corrupt=self.faults.corrupter())
        self.server.directory = gather_addresses(self.server.address, self.world_size, self.device)
        self.metrics = ReplicaMetrics(cfg.replica_id, self.rank, port=cfg.metrics_port)
        self.feed = EpochFeed()
        self.client = LighthouseClient(cfg.lighthouse, cfg.job_id, cfg.replica_id, shard_count=cfg.world_size,
                                       on_epoch=self.feed.publish, incarnation=self.incarnation,
                                       endpoints=m.Endpoints(catchup=self.server.address),
                                       security=cfg.security, on_lost=self._on_lost, slot=self.slot, slots=self.slots)
        # One session per group: rank 0 relays its epochs, and that the lighthouse dropped this incarnation.
        self.epochs = GroupEpochs(self.client, self.feed, self.rank, self.world_size, on_lost=self._on_lost)
        self.standby = bool(cfg.standby_gate)
        """A warm standby not released yet: unregistered until its first ``train_step`` (``fthsdp.runtime.standby``)."""
        self._registered: list[Callable[[], object]] = []
        self.finished = False  # the job completed before it came back: it holds the final checkpoint, never trains
        self.joining = True
        """True until this replica has caught up with the others (a standby counts as one until it registers)."""
        self.resumed_from: int | None = None  # the step of the checkpoint this replica resumed from, if it did
        self._resume_from: checkpoint.Checkpoint | None = None
        if not self.standby:
            self._register()
        self.engine = LaneEngine(LighthouseMembership(self.client, self.feed), lane=self.rank,
                                 config=FTARConfig(backend=cfg.backend, timeout_s=cfg.timeout_s,
                                                   epoch_wait_s=cfg.epoch_wait_s, hold=True, device=self.device))
        self.joiner = Joiner(cfg, self.rank, lambda: self.slot, self.client, self.faults, self.device, self._log)
        self.model: nn.Module | None = None
        self.opt: torch.optim.Optimizer | None = None
        self._sharded: list[nn.Parameter] = []
        self._buckets: BucketExchange | None = None
        self._shards: ShardState | None = None
        self._terminated, self._learned = False, -1  # stopped by SIGTERM; a joiner: the step it learned (-1: not yet)
        self._scales: dict[int, float] = {}  # a zero contributor's: per step, the factor the trainers scaled it by
        self.on_active: Callable[[], None] | None = None
        """Run once, at this incarnation's first commit as an active replica (``fthsdp.runtime.session``)."""
        self._init_steps()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
        self._log(logging.INFO, "replica up as %s (incarnation %s, catch-up server %s)",
                  "a warm standby" if self.standby else "joining" if self.joining else
                  "resuming" if self._resume_from else "active", self.incarnation, self.server.address)

    def _register(self) -> None:
        """Register (rank 0; the others watch) and take the role the lighthouse gives this replica."""
        cfg = self.config
        role, finished_step = register(self.epochs, self.rank, cfg.epoch_wait_s, self.device)
        try:
            self._resume_from = start_from(role, finished_step, cfg.job_id, cfg.checkpoint_dir)
        except (JobFinished, NoStateToResume):
            self.close(leave=False)
            raise
        self.finished = role == Role.FINISHED
        if self.finished:
            self.client.close()  # not registered: nothing to heartbeat
            self._log(logging.WARNING, "the job finished at step %d before this replica came back: taking its "
                      "final checkpoint, training nothing", finished_step)
        self.joining = role == Role.JOINING
        self.metrics.on_joining(self.joining)

    def when_registered(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` once registered: now, or for a warm standby once released (a launcher's ``start`` line)."""
        if self.standby:
            self._registered.append(fn)
        else:
            fn()

    # --- setup --------------------------------------------------------------------------------------------------

    def _log(self, level: int, msg: str, *args: object) -> None:
        """Every line says which replica, rank, epoch and (committed) step it is about."""
        epoch = self.client.epoch.number if getattr(self, "client", None) and self.client.epoch else 0
        log.log(level, "fthsdp replica=%s rank=%d epoch=%d step=%d " + msg, self.config.replica_id, self.rank,
                epoch, getattr(self, "step", 0), *args)

    def _on_lost(self, reason: str) -> None:
        """The lighthouse dropped this incarnation (e.g. hung; rank 0 learns it, the others from rank 0's relay):
        fail the exchanges now, so that every rank restarts and rejoins."""
        self._log(logging.WARNING, "the lighthouse dropped this replica (%s); restarting to rejoin", reason)
        self.epochs.lost(reason)  # the client calls this once started: after the relay exists
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.exclude(f"dropped by the lighthouse: {reason}")

    def _on_sigterm(self, signum: int, frame: object) -> None:
        if self.standby:  # nothing registered, nothing to save: a standby just ends
            raise SystemExit(0)
        self.protocol.sigterm()  # acted on at the next commit boundary, on every rank together

    def shard(self, model: nn.Module, blocks: Iterable[nn.Module] = ()) -> nn.Module:
        """Shard ``model`` with FSDP2 over this replica's ranks (each of ``blocks`` as its own unit). Each unit's
        gradient shards form one FTAR bucket, exchanged as soon as FSDP2 has reduce-scattered them, so the exchange
        overlaps the rest of the backward pass (``fthsdp.runtime.buckets``)."""
        blocks = list(blocks)
        for block in blocks:
            fully_shard(block, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)
        self.model = model
        # The sharded parameters, captured now: FSDP2 registers unsharded ones on the modules during forward and
        # backward, but these objects (which the optimizer holds) only change in the optimizer step.
        self._sharded = list(model.parameters())
        self._buckets = BucketExchange(self._sharded, [list(b.parameters()) for b in blocks], self.engine,
                                       slot=lambda: self.slot, slots=self.config.num_replicas, device=self.device,
                                       wait_s=self._wait_s)
        return model

    def register_state(self, name: str, obj: Stateful, on_commit: Callable[[], object] | None = None) -> None:
        """Carry ``obj`` (``state_dict()``/``load_state_dict()``, the same on every replica) in snapshots, checkpoints
        and the state digest; it changes only in ``on_commit``, run after every committed (or replayed) optimizer
        step. Call before ``optimizer``. Raises ``UnencodableState`` if its state cannot be JSON."""
        if self.opt is not None:
            raise RuntimeError(f"register_state({name!r}) after optimizer(): register every object before it")
        self.state.register(name, obj, on_commit)

    def optimizer(self, opt: torch.optim.Optimizer, scheduler: Scheduler | None = None,
                  model: nn.Module | None = None) -> LoopOptimizer:
        """Register the optimizer whose ``step`` the commit protocol runs (over the sharded parameters), and its LR
        ``scheduler`` if any: the runtime steps it once after every committed optimizer step, a joiner's replayed
        ones included (the trainer's own ``scheduler.step()`` calls are absorbed: ``loop.absorb_step``). ``model``:
        a model the trainer sharded itself with ``fully_shard`` (any mesh over this replica's ranks), if
        ``shard`` was not called; one bucket per FSDP2 unit. A replica resuming a job whose replicas all died loads
        the newest checkpoint here. Returns ``opt`` wrapped (``loop.LoopOptimizer``): its ``zero_grad`` begins a
        step and its ``step`` commits it, for a trainer that keeps its own loop; ``train_step`` works too."""
        if model is not None:
            if self.model is not None:
                raise RuntimeError("optimizer(model=...) after shard(model): the model is registered already")
            self._adopt(model)
        if self.model is None:
            raise RuntimeError("call shard(model) first, or pass the model you sharded: optimizer(opt, model=model)")
        if scheduler is not None:
            self.state.register("scheduler", scheduler, on_commit=absorb_step(scheduler))
        self.opt = opt
        self._shards = ShardState(self._sharded, opt, self.device, self.state)
        self._parts()[1].alias = grads_untouched(opt)  # the step's results become .grad, without a copy
        self._take_role()
        return LoopOptimizer(opt, self)

    def _adopt(self, model: nn.Module) -> None:
        """Take a model the trainer sharded with FSDP2 (``loop.fsdp_units``): one bucket per unit."""
        params, blocks = fsdp_units(model)
        self.model, self._sharded = model, params
        self._buckets = BucketExchange(params, blocks, self.engine, slot=lambda: self.slot,
                                       slots=self.config.num_replicas, device=self.device, wait_s=self._wait_s)

    def _take_role(self) -> None:
        """Once registered, with the optimizer: load the checkpoint the role needs, and serve snapshots if active."""
        if self._resume_from is not None:
            ck = self._resume_from
            assert self.model is not None
            self.cursors = checkpoint.resume(ck, self.model, self._parts()[0], len(self.cursors), self.rank)
            self.step = ck.step
            if not self.finished:  # a finished job's final checkpoint: the state it ended with, nothing resumes
                self.resumed_from = ck.step
                self._log(logging.WARNING, "resumed from checkpoint %s", ck.path)
            self._resume_from = None
        if not self.joining and not self.standby:
            self._parts()[0].mark(self.cursors)  # what a snapshot of the coming step takes at its boundary
            self.server.at_commit(self.step, active=True)

    @property
    def cursor(self) -> int:
        """Index of the next batch of this replica's data slot (``slot``; a spare has none: ``RuntimeError``)."""
        return spares.cursor(self)

    def _parts(self) -> tuple[ShardState, BucketExchange]:
        if self._shards is None or self._buckets is None:
            raise RuntimeError("call optimizer(opt) first")
        return self._shards, self._buckets

    # --- the step -----------------------------------------------------------------------------------------------

    def _pace(self, attempts: int, step: int, compute_s: float, wait_s: float) -> None:
        """Fail-slow evidence: a step's compute and wait to Prometheus; a failure-free one's to the lighthouse too."""
        self.metrics.on_pace(compute_s, wait_s)
        if attempts == 1 and (pace := self.pace.add(step, compute_s, wait_s)) is not None and self.rank == 0:
            self.client.set_pace(pace)

    def _settle(self, handles: list[Handle | None], contribute: bool,
                redo: Callable[[Tally], list[Handle | None]] | None = None) -> tuple[Commit, list[ExchangeResult]]:
        """Wait for the step's buckets and vote, redoing the exchange (``redo``'s, if given) until it commits."""
        _, buckets = self._parts()
        self.protocol.begin()
        while True:
            self.faults.at(self.step, Phase.EXCHANGE)
            results = buckets.collect(handles, self.protocol, self._wait_s, self._log,
                                      lambda: self.faults.at(self.step, Phase.EXCHANGE_LATE))
            self.faults.at(self.step, Phase.VOTE)
            tally = self._vote()
            decision = self.protocol.vote(tally)
            if isinstance(decision, Commit):
                spares.take(self, tally.slot)  # the slot the newest epoch gives this replica, from the next step
                # Hold this step's results until the next commit: a partner that lost one of them is served it.
                self.engine.forget_before(buckets.sequence(decision.step))
                if buckets.posts and not contribute:  # the trainers' change to the step's gradients, to apply too
                    self._scales[decision.step] = self._post(decision.step, None, None)[0]
                return decision, results
            if isinstance(decision, Rejoin):
                raise RejoinRequired(f"step {self.step}: {decision.reason}")
            self.metrics.on_retry(decision.reason)
            self._log(logging.INFO, "vote failed (epochs %s, failed=%d); redoing the step's exchange",
                      list(decision.epochs), decision.failed)
            # Partners that committed moved on in that epoch's group; if no lane's reports ask past it, ask.
            self.engine.reset(after=tally.newest, reform=tally.reform)
            handles = redo(tally) if redo is not None else self._exchange_all(contribute, redo=True)

    def _exchange_all(self, contribute: bool, redo: bool = False) -> list[Handle | None]:
        """Exchange every bucket of the step from the gradients at hand (a ``redo``, or a joiner's zeros). A joiner
        that has not learned the step yet learns it from its first exchange."""
        _, buckets = self._parts()
        step = self.step if not self.joining or self._learned >= 0 else None
        handles, learned = buckets.exchange_all(step, contribute, redo=redo)
        if learned is not None:
            self._learned = self.step = learned
        return handles

    @property
    def _wait_s(self) -> float:
        return self.config.epoch_wait_s * 2 + 60

    def _vote(self, protocol: CommitProtocol | None = None) -> Tally:
        """The replica-local vote: one MAX all-reduce of every rank's ballot (``protocol``'s, the step's by
        default). It carries SIGTERM too, so every rank stops at the same commit boundary without a collective of
        its own."""
        ballot = (protocol or self.protocol).ballot(self.engine.asking, spares.seen(self.client))
        ctrl = torch.tensor(ballot.encode(), dtype=torch.int64, device=self.device)
        dist.all_reduce(ctrl, op=dist.ReduceOp.MAX)
        return Tally.decode(ctrl.tolist())

    def _commit(self, step: int, results: list[ExchangeResult], installed: bool = False) -> tuple[tuple[int, int], ...]:
        """Apply a step's averaged gradients (bound already with ``installed``, and changed by the trainer's loop
        maybe; else bound here and scaled as the trainers did, ``grad_scale``): the optimizer step with the
        degraded-mode learning rate, the data cursors of the slots that contributed, ``self.step = step + 1``.
        Replaying a kept step runs this too, so a joiner's state follows the same arithmetic as the others'.
        Returns the batches the step trained."""
        shards, buckets = self._parts()
        contributors = results[-1].contributors
        slots = contributing_slots(buckets.mask_of(results), contributors, self.step)
        if not installed:
            buckets.install(results)
            grad_scale.apply(buckets.grads(), self._scales.pop(step, 1.0))
        for old in [s for s in self._scales if s < step]:  # settled before a snapshot that made them moot
            del self._scales[old]
        factor = lr_factor(self.config.lr_rule, contributors, self.config.num_replicas)
        if factor != self._lr_factor and not self.joining:
            self._log(logging.WARNING, "learning rate x%.4f (%s rule: %d of %d replicas contribute)", factor,
                      self.config.lr_rule, contributors, self.config.num_replicas)
        self._lr_factor = factor
        self.faults.at(step, Phase.OPTIMIZER)
        self.server.before_update(step)  # a snapshot of this step's state in progress finishes first
        shards.optimizer_step(factor)
        if not self.joining and self.faults.corrupts(step):
            shards.flip_bit()
            self._log(logging.WARNING, "FTHSDP_FAULT_CORRUPT: flipped a bit of this replica's state")
        cursors, batches = advance_cursors(self.cursors.tolist(), slots)
        self.cursors = torch.tensor(cursors, dtype=torch.int64)
        self.step = step + 1
        return batches

    def _after_commit(self, batches: tuple[tuple[int, int], ...], stop: bool) -> None:
        """Commit-boundary duties: lighthouse step, snapshot for joiners, checkpoints, and stopping if the vote
        carried a SIGTERM; the first one as an active replica runs ``on_active`` (a launcher's cue)."""
        self.client.set_step(self.step)
        on_active = self.on_active
        if on_active is not None and not self.joining:
            self.on_active = None
            on_active()
        self._parts()[0].mark(self.cursors)  # what a snapshot of the coming step takes at its boundary
        self.server.at_commit(self.step, active=True)
        cfg = self.config
        if cfg.checkpoint_dir and cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and batches \
                and min(s for s, _ in batches) == self.slot:
            self._checkpoint()
        if stop:
            path = self._checkpoint() if cfg.checkpoint_dir else None
            self._log(logging.WARNING, "SIGTERM: stopping at a commit boundary%s",
                      f" (checkpoint {path})" if path else " (no FTHSDP_CHECKPOINT_DIR: nothing saved)")
            self._terminated = True
            self.close(leave=True)
            raise Terminated(self.step, path)

    def _checkpoint(self) -> str:
        assert self.model is not None and self.opt is not None
        t0 = time.perf_counter()
        path = checkpoint.save(self.config.checkpoint_dir, self.step, self.config.replica_index, self.model, self.opt,
                               self.cursors, self.rank, self._parts()[0].side_state())
        self._log(logging.INFO, "checkpoint %s written in %.3fs", path, time.perf_counter() - t0)
        return str(path)

    def _end_of_job(self) -> None:
        """Before leaving after the last step: wait until every member of the epoch is at this step too (a member
        one step behind is served that step's results by this replica meanwhile: it must not redo it alone, with
        no holder left), then write the final checkpoint (a replica that comes back after the job finished takes
        it), then leave "finished" (the lighthouse then tells late comers the job is over). The barrier goes
        through the replica-local vote like a step's exchange (``fthsdp.runtime.ending``)."""
        _, buckets = self._parts()
        if ending.barrier(buckets, self.engine, self.step, self._vote, self._wait_s, self._log):
            self._agree()  # the last step's post exchange came back before the barrier
        buckets.unchecked = None
        if self.config.checkpoint_dir:
            self._checkpoint()

    # --- state --------------------------------------------------------------------------------------------------

    def state_hash(self) -> str:
        """SHA-256 over every rank's tensors, the cursors, param groups and registered state (a collective over the
        replica): equal across replicas exactly when their states are bitwise equal (RNG aside: design.md §7)."""
        return replica_hash(self._parts()[0].digest(self.cursors), self.world_size, self.device)

    def close(self, leave: bool = True) -> None:
        """Stop the engine, the lighthouse session (rank 0 leaves the job) and then the catch-up server (a closed
        session whose endpoint refuses connections is a dead replica: ``lighthouse.server.probe``; transfers in
        progress get a few seconds). An active replica that leaves at the end first ends the job (``_end_of_job``)."""
        if leave and not self.finished and not self.joining and not self._terminated and self._buckets is not None:
            self._end_of_job()
        if getattr(self, "engine", None) is not None:
            self.engine.close()
        self.epochs.close()
        self.client.close(leave="finished" if leave and self.rank == 0 else None)
        self.server.close(drain_s=10.0)
        self.metrics.close()
