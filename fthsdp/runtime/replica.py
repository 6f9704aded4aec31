"""The trainer-facing runtime: FSDP2 inside the replica, FTAR across replicas, and the commit protocol.

A training process (one rank of one replica group, started by torchrun) does::

    ft = fthsdp.runtime.Replica()                 # reads FTHSDP_* and torchrun's env
    model = ft.shard(model, blocks=model.blocks)  # FSDP2 over the replica's ranks
    opt = ft.optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))
    while ft.step < steps:
        result = ft.train_step(lambda: loss_fn(model, batch_for(ft.slot, ft.cursor)))

``train_step`` runs one step under the commit protocol (DESIGN §3): forward/backward (FSDP2 reduce-scatters
inside the replica), FTAR of every gradient shard across replicas (lane = rank), a replica-local vote (every
rank ok, all in the same epoch), then commit (optimizer step with the degraded-mode learning rate, data cursors
advanced, ``step += 1``) or redo the exchange under the next epoch from the same local gradients. No lighthouse
round trip happens on this path.

Data is exactly-once: one slot per configured replica (``ft.slot``), and a cursor per slot (``ft.cursor`` is
this slot's: the index of the batch to train next). The step's exchange carries which slots contributed, so
every replica advances the same cursors, on commit only; a replica that comes back resumes its slot where the
committed steps left it.

A replica that starts while others train registers as *joining* and catches up without stalling them (DESIGN
§6): it enters the exchanges as a zero-gradient contributor and keeps the averaged gradients it receives, while
background threads fetch a snapshot of a step S just ahead from the healthy replicas' catch-up servers. Once
the snapshot is in, it loads it and replays the kept gradients of steps S, S+1, ... with the same optimizer
step, so it ends bitwise identical to the others; then it turns active. Replay, not re-fetching a newer
snapshot: a fetch slower than a step would chase the others forever, while replaying a step (an optimizer step,
no forward or backward) is always faster than training one.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fthsdp.runtime import checkpoint
from fthsdp.catchup.client import Fetch, FetchResult, Source
from fthsdp.catchup.server import CatchupServer
from fthsdp.catchup.wire import FetchFailed
from fthsdp.runtime.config import RuntimeConfig
from fthsdp.testing.faults import FaultInjector
from fthsdp.runtime.lr import lr_factor
from fthsdp.runtime.metrics import ReplicaMetrics
from ftar.engine import ExchangeResult, FTARConfig, Handle, LaneEngine
from ftar.errors import Excluded, FTARError, Interrupted, Misaligned
from ftar.membership import EpochFeed, LighthouseMembership
from lighthouse import membership as m
from lighthouse.client import LighthouseClient
from lighthouse.errors import Busy
from lighthouse.security import security_from_env

log = logging.getLogger("fthsdp.runtime")

EXIT_REJOIN = 75
"""Exit status of a replica whose state fell behind the others (or that was declared dead while alive): the
launcher restarts it, and it catches up as a joiner."""


class RejoinRequired(RuntimeError):
    """This replica's state can no longer be trusted to match the others'; restart it (exit ``EXIT_REJOIN``)."""


class NoStateToResume(RuntimeError):
    """This replica would start the job over: every other replica is gone and there is no checkpoint."""


class StateMismatch(RuntimeError):
    """A joiner's model or optimizer does not have the layout of the state it was sent."""


class SlotConflict(RuntimeError):
    """Two live replicas train the same data slot (the same ``FTHSDP_REPLICA_INDEX``)."""


class Terminated(SystemExit):
    """SIGTERM: the replica wrote a checkpoint at a commit boundary (if a directory is configured) and stops."""

    def __init__(self, step: int, path: str | None) -> None:
        super().__init__(0)
        self.step = step
        self.path = path


@dataclass(frozen=True)
class StepResult:
    step: int
    """The step that was committed."""
    loss: float | None
    """This rank's loss, or None for a joining replica (it trained nothing: it caught up)."""
    epoch: int
    contributors: int
    joined: bool
    """True for the step in which this replica finished catching up (it loaded the state and replayed)."""
    attempts: int
    """Exchanges the step needed (1: no failure)."""
    exchange_s: float
    """From the start of backward (a joiner: of the step) until every bucket was exchanged."""
    batches: tuple[tuple[int, int], ...] = ()
    """(slot, batch index) of every slot whose batch this step trained, all replicas together."""
    lr_factor: float = 1.0
    catchup: dict[str, object] | None = None
    """For the joined step: how the catch-up went (bytes, seconds, sources, failures, replayed steps)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _die_with_parent() -> None:
    """Under torchrun, end with the agent: a SIGKILLed replica group then leaves no worker behind."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the agent died before prctl took effect
        os._exit(1)


_ADDR_BYTES = 256


class Replica:
    """One rank's handle on fault-tolerant HSDP. Create it after torchrun has set the environment."""

    def __init__(self, config: RuntimeConfig | None = None) -> None:
        self.config = cfg = config or RuntimeConfig.from_env()
        _die_with_parent()
        if cfg.backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", cfg.rank)))
        if not dist.is_initialized():
            dist.init_process_group(cfg.backend)
        if dist.get_world_size() != cfg.world_size or dist.get_rank() != cfg.rank:
            raise RuntimeError("the replica's process group does not match RANK/WORLD_SIZE")
        self.rank, self.world_size = cfg.rank, cfg.world_size
        self.slot = cfg.replica_index
        """This replica's data slot."""
        self.device = torch.device("cuda", torch.cuda.current_device()) if cfg.backend == "nccl" else torch.device("cpu")
        self.mesh = init_device_mesh(self.device.type, (cfg.world_size,))
        self.faults = FaultInjector.from_env(self.rank)
        self.incarnation = self._agree_incarnation()
        self.step = 0
        """Committed steps so far (a joiner learns it at its first exchange)."""
        self.cursors = torch.zeros(cfg.num_replicas, dtype=torch.int64)
        """Per data slot, the batches trained so far (the same on every replica)."""
        self.joining = False
        self._terminate = False
        self._stop_agreed = False
        """Some rank of this replica got SIGTERM before the last vote: every rank stops after this commit."""
        self._lr_factor = 1.0
        self.server = CatchupServer(job=cfg.job_id, replica_id=cfg.replica_id, rank=self.rank,
                                    world_size=self.world_size, snapshot=self._snapshot, host=cfg.host,
                                    token=cfg.token, wait_s=cfg.epoch_wait_s,
                                    on_chunk_sent=_serve_hook(self.faults),
                                    corrupt=_corrupt_from_env())
        self.server.directory = self._gather_addresses(self.server.address)
        self.metrics = ReplicaMetrics.from_env(cfg.replica_id, self.rank)
        self.feed = EpochFeed()
        self.client = LighthouseClient(cfg.lighthouse, cfg.job_id, cfg.replica_id, shard_count=cfg.world_size,
                                       on_epoch=self.feed.publish, incarnation=self.incarnation,
                                       endpoints=m.Endpoints(catchup=self.server.address),
                                       security=security_from_env(), on_lost=self._on_lost)
        role = 0
        if self.rank == 0:
            reg = self.client.start(register=True, deadline_s=cfg.epoch_wait_s)
            assert reg is not None
            role = 1 if reg.role == m.JOINING else 0
            if reg.resume:
                role = 2  # the job ran before and nobody is left to catch up from
        else:
            self.client.start(register=False)
        flag = torch.tensor([role], dtype=torch.int64, device=self.device)
        dist.broadcast(flag, 0)
        # An active replica that finds a checkpoint resumes from it: the whole job was restarted (a fresh
        # lighthouse: bootstrap), or every replica had died (the lighthouse says resume). Joiners catch up instead.
        self._resume_from: checkpoint.Checkpoint | None = None
        if flag.item() != 1 and cfg.checkpoint_dir:
            self._resume_from = checkpoint.latest(cfg.checkpoint_dir)
        if flag.item() == 2 and self._resume_from is None:
            self.close(leave=False)
            raise NoStateToResume(f"job {cfg.job_id!r} trained before but no replica is alive to catch up from "
                                  f"and there is no checkpoint to resume from (FTHSDP_CHECKPOINT_DIR="
                                  f"{cfg.checkpoint_dir!r})")
        self.resumed_from: int | None = None
        """The step of the checkpoint this replica resumed from, if it did."""
        self.joining = bool(flag.item() == 1)
        """True until this replica has caught up with the others."""
        self.metrics.on_joining(self.joining)
        self._announced = False
        self.engine = LaneEngine(LighthouseMembership(self.client, self.feed), lane=self.rank,
                                 config=FTARConfig(backend=cfg.backend, timeout_s=cfg.timeout_s,
                                                   epoch_wait_s=cfg.epoch_wait_s))
        self.model: nn.Module | None = None
        self.opt: torch.optim.Optimizer | None = None
        self._sharded: list[nn.Parameter] = []
        self._buckets: list[list[nn.Parameter]] = []
        self._bucket_of: dict[int, int] = {}
        self._pending: list[Handle | None] = []
        self._filled: list[int] = []
        self._launched = 0
        self._armed_tag: int | None = None
        self._learned = -1
        """A joiner: the step it learned from the others (-1: not yet)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
        self._log(logging.INFO, "replica up as %s (incarnation %s, catch-up server %s)",
                  "joining" if self.joining else "resuming" if self._resume_from else "active", self.incarnation,
                  self.server.address)

    # --- setup --------------------------------------------------------------------------------------------------

    def _log(self, level: int, msg: str, *args: object) -> None:
        epoch = self.client.epoch.number if getattr(self, "client", None) and self.client.epoch else 0
        log.log(level, "fthsdp replica=%s rank=%d epoch=%d step=%d " + msg, self.config.replica_id, self.rank,
                epoch, getattr(self, "step", 0), *args)

    def _agree_incarnation(self) -> str:
        raw = torch.zeros(16, dtype=torch.uint8, device=self.device)
        if self.rank == 0:
            raw.copy_(torch.frombuffer(bytearray(uuid.uuid4().bytes), dtype=torch.uint8))
        dist.broadcast(raw, 0)
        return bytes(raw.cpu().tolist()).hex()

    def _gather_addresses(self, mine: str) -> list[str]:
        """Every rank's catch-up address (the lighthouse only carries rank 0's; it redirects joiners)."""
        raw = mine.encode()
        if len(raw) > _ADDR_BYTES:
            raise ValueError(f"catch-up address {mine!r} is longer than {_ADDR_BYTES} bytes")
        buf = torch.zeros(_ADDR_BYTES, dtype=torch.uint8, device=self.device)
        buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        out = [torch.empty_like(buf) for _ in range(self.world_size)]
        dist.all_gather(out, buf)
        return [bytes(t.cpu().tolist()).rstrip(b"\0").decode() for t in out]

    def _on_lost(self, reason: str) -> None:
        """The lighthouse dropped this incarnation (it was declared dead, e.g. while hung): its state can no
        longer be trusted to follow the others'. Fail the exchanges now, so the replica restarts and rejoins
        (instead of waiting ``epoch_wait_s`` for an epoch that will not include it)."""
        self._log(logging.WARNING, "the lighthouse dropped this replica (%s); restarting to rejoin", reason)
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.exclude(f"dropped by the lighthouse: {reason}")

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self._terminate = True  # acted on at the next commit boundary, on every rank together

    def shard(self, model: nn.Module, blocks: Iterable[nn.Module] = ()) -> nn.Module:
        """Shard ``model`` with FSDP2 over this replica's ranks (each of ``blocks`` as its own unit).

        Each unit's gradient shards form one FTAR bucket, exchanged as soon as FSDP2 has reduce-scattered them
        (a post-accumulate-grad hook), so the exchange overlaps the rest of the backward pass. Buckets go out in
        a fixed order (the blocks last to first, then the root's own parameters), the same on every replica.
        """
        blocks = list(blocks)
        for block in blocks:
            fully_shard(block, mesh=self.mesh)
        fully_shard(model, mesh=self.mesh)
        self.model = model
        # The sharded parameters, captured now: FSDP2 registers unsharded ones on the modules during forward and
        # backward, but these objects (which the optimizer holds) only change in the optimizer step.
        self._sharded = list(model.parameters())
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        buckets = [list(b.parameters()) for b in reversed(blocks)]
        buckets.append([p for p in self._sharded if id(p) not in in_blocks])
        self._buckets = [b for b in buckets if b]
        self._bucket_of = {id(p): k for k, b in enumerate(self._buckets) for p in b}
        for p in self._sharded:
            p.register_post_accumulate_grad_hook(self._on_grad)
        return model

    def optimizer(self, opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Register the optimizer whose ``step`` the commit protocol runs (over the sharded parameters). A replica
        resuming a job whose replicas all died loads the newest checkpoint here."""
        if self.model is None:
            raise RuntimeError("call shard(model) first")
        self.opt = opt
        if self._resume_from is not None:
            ck = self._resume_from
            checkpoint.load(ck, self.model, opt)
            if len(ck.cursors) != len(self.cursors):
                raise StateMismatch(f"checkpoint {ck.path} has {len(ck.cursors)} data slots, the job "
                                    f"{len(self.cursors)}")
            self.step = self.resumed_from = ck.step
            self.cursors = torch.tensor(ck.cursors, dtype=torch.int64)
            self._log(logging.WARNING, "resumed from checkpoint %s", ck.path)
            self._resume_from = None
        if not self.joining:
            self.server.at_commit(self.step, active=True)
        return opt

    @property
    def cursor(self) -> int:
        """Index of the next batch of this replica's data slot."""
        return int(self.cursors[self.slot])

    @property
    def _params(self) -> list[nn.Parameter]:
        if self.model is None:
            raise RuntimeError("call shard(model) first")
        return self._sharded

    # --- the step -----------------------------------------------------------------------------------------------

    def train_step(self, closure: Callable[[], torch.Tensor]) -> StepResult:
        """Run one step: ``closure()`` returns the loss (the runtime calls ``backward``). Returns once the step is
        committed. A joining replica calls ``closure`` once to warm up (the result is thrown away: see
        ``_warm_up``), then catches up (it exchanges zeros while fetching the state) and returns once it holds
        the same state as the others, with ``joined=True``."""
        if self.opt is None:
            raise RuntimeError("call optimizer(opt) first")
        if self.joining:
            return self._catch_up(closure)
        self.faults.at(self.step, "forward")
        self.opt.zero_grad(set_to_none=True)
        self._pending = [None] * len(self._buckets)
        self._filled = [0] * len(self._buckets)
        self._launched = 0
        self._armed_tag = self.step
        try:
            loss = closure()
            self.faults.at(self.step, "backward")
            t0 = time.perf_counter()
            loss.backward()  # buckets are handed to FTAR as FSDP2 produces them
        finally:
            self._armed_tag = None
        loss_value = float(loss.detach().item())
        while self._launched < len(self._buckets):  # parameters that got no gradient
            self._launch(self._launched, self.step, True)
        agreed, epochs, results, attempts = self._settle(list(self._pending), contribute=True)
        exchange_s = time.perf_counter() - t0
        batches = self._commit(agreed, results)
        result = StepResult(agreed, loss_value, max(epochs), results[0].contributors, False, attempts, exchange_s,
                            batches, self._lr_factor)
        self.metrics.on_exchange(sum(t.numel() * t.element_size() for r in results for t in r.tensors), exchange_s)
        self.metrics.on_commit(agreed, max(epochs), results[0].contributors, attempts,
                               stall_s=exchange_s if attempts > 1 else 0.0)
        self._after_commit(batches)
        return result

    def _settle(self, handles: list[Handle | None], contribute: bool) -> tuple[int, list[int], list[ExchangeResult],
                                                                              int]:
        """Wait for the step's buckets and vote; redo under the next epoch until the vote passes. Returns
        (agreed step, epochs, results, attempts)."""
        attempts = 1
        while True:
            self.faults.at(self.step, "exchange")
            failed, epochs, agreed, results = self._collect(handles)
            self.faults.at(self.step, "vote")
            passed, newest = self._vote(failed, epochs, agreed)
            if passed:
                return agreed, epochs, results, attempts
            if attempts >= 20:
                raise RejoinRequired(f"step {self.step}: no consistent exchange in {attempts} attempts")
            attempts += 1
            self.metrics.on_retry("failure" if failed else "epoch_change")
            if not failed and min(epochs) == newest:
                # This lane has the whole step in the newest epoch any rank of the replica saw: its partners in
                # that epoch have it too and will not exchange it again, so keep it; the other lanes catch up.
                self._log(logging.INFO, "vote failed (epochs %s); keeping this lane's epoch-%d result", epochs,
                          newest)
                continue
            self._log(logging.INFO, "vote failed (epochs %s, failed=%d); redoing the step's exchange", epochs, failed)
            self.engine.reset()
            handles = self._exchange_all(self._known_tag(agreed), contribute=contribute)

    def _known_tag(self, agreed: int = -1) -> int | None:
        """The step to exchange: a joiner that has not learned it yet passes None."""
        if not self.joining or self._learned >= 0:
            return self.step
        return agreed if agreed >= 0 else None

    def _commit(self, agreed: int, results: list[ExchangeResult]) -> tuple[tuple[int, int], ...]:
        """Apply a step's averaged gradients: the optimizer step with the degraded-mode learning rate, the data
        cursors of the slots that contributed, ``step = agreed + 1``. Replaying a kept step runs this too, so a
        joiner's state follows the same arithmetic as the others'."""
        assert self.opt is not None
        slots = self._slots(results)
        for bucket, res in zip(self._buckets, results):
            for p, g in zip(bucket, res.tensors):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                _local(p.grad).copy_(g)
        contributors = results[-1].contributors
        factor = lr_factor(self.config.lr_rule, contributors, self.config.num_replicas)
        if factor != self._lr_factor and not self.joining:
            self._log(logging.WARNING, "learning rate x%.4f (%s rule: %d of %d replicas contribute)", factor,
                      self.config.lr_rule, contributors, self.config.num_replicas)
        self._lr_factor = factor
        self.faults.at(agreed, "optimizer")
        base = [group["lr"] for group in self.opt.param_groups]  # a scheduler may own these: scale, then restore
        for group, lr in zip(self.opt.param_groups, base):
            group["lr"] = lr * factor
        try:
            self.opt.step()
        finally:
            for group, lr in zip(self.opt.param_groups, base):
                group["lr"] = lr
        batches = tuple((s, int(self.cursors[s])) for s in slots)
        for s in slots:
            self.cursors[s] += 1
        self.step = agreed + 1
        return batches

    def _slots(self, results: list[ExchangeResult]) -> list[int]:
        """The data slots that contributed to the step (the mask riding at the end of the last bucket)."""
        mask = results[-1].tensors[-1].detach().cpu()
        counts = (mask.double() * results[-1].contributors).round().to(torch.int64)
        if int(counts.sum()) != results[-1].contributors or bool((counts > 1).any()):
            raise SlotConflict(f"step {self.step}: slot counts {counts.tolist()} for {results[-1].contributors} "
                               "contributors: two replicas have the same FTHSDP_REPLICA_INDEX, or the job's "
                               "FTHSDP_NUM_REPLICAS differs between replicas")
        return [i for i, c in enumerate(counts.tolist()) if c]

    def _after_commit(self, batches: tuple[tuple[int, int], ...]) -> None:
        """Commit-boundary duties of an active replica: lighthouse step, snapshot for joiners, checkpoints,
        SIGTERM."""
        self.client.set_step(self.step)
        self.server.at_commit(self.step, active=True)
        cfg = self.config
        if cfg.checkpoint_dir and cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and batches \
                and min(s for s, _ in batches) == self.slot:
            self._checkpoint()
        if self._stop_agreed:
            path = self._checkpoint() if cfg.checkpoint_dir else None
            self._log(logging.WARNING, "SIGTERM: stopping at a commit boundary%s",
                      f" (checkpoint {path})" if path else " (no FTHSDP_CHECKPOINT_DIR: nothing saved)")
            self.close(leave=True)
            raise Terminated(self.step, path)

    def _checkpoint(self) -> str:
        assert self.model is not None and self.opt is not None
        t0 = time.perf_counter()
        path = checkpoint.save(self.config.checkpoint_dir, self.step, self.slot, self.model, self.opt, self.cursors,
                               self.rank)
        self._log(logging.INFO, "checkpoint %s written in %.3fs", path, time.perf_counter() - t0)
        return str(path)

    # --- catching up --------------------------------------------------------------------------------------------

    def _catch_up(self, closure: Callable[[], torch.Tensor]) -> StepResult:
        """Exchange zeros step after step, keeping the averaged gradients, while the snapshot of step S (ahead of
        the others) is fetched; then load it, replay the kept steps from S, and turn active."""
        t_start = time.perf_counter()
        if self.config.join_warmup and not self._announced:
            self._warm_up(closure)
        entered = time.time()
        if self.rank == 0 and not self._announced:
            # Enter the data plane only now that everything is set up: the others wait for us from here on.
            self._announce()
        kept: dict[int, list[ExchangeResult]] = {}
        fetch: Fetch | None = None
        target = -1
        attempts = 0
        fetches = 0
        member = 0.0
        while True:
            t0 = time.perf_counter()
            handles = self._exchange_all(self._known_tag(), contribute=False)
            agreed, epochs, results, n = self._settle(handles, contribute=False)
            member = member or time.time()  # in the data plane: the others' groups include us from here
            attempts += n
            self.step = agreed + 1
            self._learned = agreed
            kept[agreed] = results
            if fetch is None:
                # The others cannot commit step agreed+1 without us: step agreed+2 is ahead of every source.
                target = agreed + 2
                fetch = self._start_fetch(target)
                fetches += 1
            for s in [s for s in kept if s < target]:
                del kept[s]
            if len(kept) > self.config.max_replay:
                raise RejoinRequired(f"the catch-up fetch is {len(kept)} steps behind (FTHSDP_CATCHUP_MAX_REPLAY="
                                     f"{self.config.max_replay})")
            if not self._all_ranks(fetch.done()):
                continue
            try:
                got: FetchResult | None = fetch.result(timeout=0)
            except FetchFailed as e:
                self._log(logging.WARNING, "catch-up fetch of step %d failed: %s", target, e)
                got = None
            if not self._all_ranks(got is not None):
                fetch = None  # every rank starts over with a newer step
                kept.clear()
                if fetches >= 5:
                    raise RejoinRequired(f"catch-up failed {fetches} times")
                continue
            assert got is not None
            t_in = time.perf_counter()
            self._load(got)
            replayed = 0
            for s in range(target, agreed + 1):
                self._commit(s, kept[s])
                replayed += 1
            if self.step != agreed + 1:
                raise StateMismatch(f"replay ended at step {self.step}, expected {agreed + 1}")
            t_applied = time.perf_counter()
            self.joining = False
            self.metrics.on_joining(False)
            self.metrics.on_catchup(got.bytes, time.perf_counter() - t_start)
            self.metrics.on_commit(agreed, max(epochs), results[0].contributors, attempts)
            self._after_commit(())
            if self.rank == 0:
                # Off the critical path: the role change keeps the data plane (the epoch's plane), so training
                # does not wait for the lighthouse; a slow or failing-over lighthouse only delays the role.
                threading.Thread(target=self._turn_active, name="fthsdp-ready-active", daemon=True).start()
            catchup = {"bytes": got.bytes, "transfer_s": round(got.transfer_s, 4), "wait_s": round(got.wait_s, 4),
                       "sources": got.sources, "source_failures": got.source_failures,
                       "refetched_chunks": got.refetched_chunks, "snapshot_step": got.step, "replayed": replayed,
                       "fetches": fetches, "apply_s": round(t_applied - t_in, 4),
                       "active_s": round(time.perf_counter() - t_applied, 4),
                       "catchup_s": round(time.perf_counter() - t_start, 4), "entered_unix": entered,
                       "member_unix": member}
            self._log(logging.INFO, "caught up at step %d: snapshot of step %d (%.1f MB in %.3fs from %s), %d "
                      "step(s) replayed; now active", agreed, got.step, got.bytes / 1e6, got.transfer_s,
                      sorted(got.sources), replayed)
            return StepResult(agreed, None, max(epochs), results[0].contributors, True, attempts,
                              time.perf_counter() - t0, (), self._lr_factor, catchup)

    def _turn_active(self) -> None:
        """Ready(ACTIVE), retried (bounded by epoch_wait_s) while the lighthouse does not answer."""
        deadline = time.monotonic() + self.config.epoch_wait_s
        while True:
            try:
                self.client.ready(m.ACTIVE)
                return
            except Exception as e:  # noqa: BLE001 - a background retry loop: log, retry, give up at the deadline
                if time.monotonic() > deadline:
                    self._log(logging.ERROR, "could not tell the lighthouse this replica is active: %s", e)
                    return
                self._log(logging.WARNING, "Ready(active) failed (%s); retrying", e)
                time.sleep(0.5)  # retry pacing, bounded by the deadline

    def _warm_up(self, closure: Callable[[], torch.Tensor]) -> None:
        """One forward, backward and optimizer step, thrown away, before entering the data plane: a process's
        first step is slow (FSDP2's lazy init, the optimizer's first step, first allocations), and once this
        replica is a member the others would wait for it. Nothing is exchanged; what the optimizer step changes
        is overwritten by the snapshot (every parameter and optimizer-state tensor). The closure must not
        consume data (index the data by ``cursor``)."""
        assert self.opt is not None
        t0 = time.perf_counter()
        loss = closure()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self._log(logging.INFO, "warm-up step before joining took %.3fs", time.perf_counter() - t0)

    def _all_ranks(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def _start_fetch(self, step: int) -> Fetch:
        epoch = self.client.epoch
        members = epoch.members if epoch is not None else ()
        sources = [Source(x.replica_id, x.endpoints.catchup) for x in members
                   if x.role == m.ACTIVE and x.replica_id != self.config.replica_id and x.endpoints.catchup]
        # Start each joiner on a different source; the shared work queue balances the rest.
        k = self.slot % len(sources) if sources else 0
        sources = sources[k:] + sources[:k]
        self._log(logging.INFO, "fetching the snapshot of step %d from %s", step, [s.replica_id for s in sources])
        return Fetch(sources, job=self.config.job_id, replica_id=self.config.replica_id, rank=self.rank, step=step,
                     token=self.config.token, wait_s=self.config.epoch_wait_s,
                     on_chunk=lambda s, n: self.faults.at(s, "fetch")).start()

    def _load(self, got: FetchResult) -> None:
        """Put a fetched snapshot into this rank's shards, optimizer state, data cursors and RNG."""
        self._make_optimizer_state(got.tensors)
        mine = [(name, tuple(t.shape), str(t.dtype)) for name, t, _ in self._state()]
        theirs = [(name, tuple(t.shape), str(t.dtype)) for name, t in got.tensors.items()
                  if name.startswith(("param/", "optim/"))]
        if mine != theirs:
            diff = next((f"{a} vs {b}" for a, b in zip(mine, theirs) if a != b), f"{len(mine)} vs {len(theirs)}")
            raise StateMismatch(f"joiner state layout differs from the source's (mine vs source: {diff}): same "
                                "model, shard count and optimizer needed")
        with torch.no_grad():
            for name, t, _ in self._state():
                t.copy_(got.tensors[name])
        cursors = got.tensors.get("data/cursors")
        if cursors is None or cursors.shape != self.cursors.shape:
            raise StateMismatch(f"the source has data cursors {None if cursors is None else list(cursors.shape)}, "
                                f"this job {list(self.cursors.shape)} (FTHSDP_NUM_REPLICAS must match)")
        self.cursors = cursors.clone()
        if "rng/cpu" in got.tensors:
            torch.set_rng_state(got.tensors["rng/cpu"])
        if "rng/cuda" in got.tensors and self.device.type == "cuda":
            torch.cuda.set_rng_state(got.tensors["rng/cuda"])
        self.step = got.step

    def _announce(self) -> None:
        """Ready(JOINING), retried while another replica is joining (one at a time), up to epoch_wait_s."""
        deadline = time.monotonic() + self.config.epoch_wait_s
        while True:
            try:
                self.client.ready(m.JOINING)
                self._announced = True
                return
            except Busy as e:
                if time.monotonic() > deadline:
                    raise RejoinRequired(f"could not enter the data plane: {e}") from e
                self._log(logging.INFO, "waiting to join: %s", e)
                time.sleep(0.2)  # retry pacing, bounded by the deadline

    # --- buckets ------------------------------------------------------------------------------------------------

    def _on_grad(self, p: torch.Tensor) -> None:
        """FSDP2 finished this parameter's gradient shard: launch every bucket that is now complete, in order."""
        if self._armed_tag is None:
            return
        self._filled[self._bucket_of[id(p)]] += 1
        while self._launched < len(self._buckets) and \
                self._filled[self._launched] == len(self._buckets[self._launched]):
            self._launch(self._launched, self._armed_tag, True)

    def _launch(self, k: int, step: int | None, contribute: bool) -> Handle:
        bucket = self._buckets[k]
        grads = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p in bucket]
        if k == len(self._buckets) - 1:
            # The data-slot mask rides with the last bucket: after averaging, slot i is 1/contributors if its
            # replica contributed to the step, 0 if not.
            mask = torch.zeros(self.config.num_replicas, dtype=torch.float32, device=self.device)
            if contribute:
                mask[self.slot] = 1.0
            grads.append(mask)
        tag = None if step is None else step * len(self._buckets) + k
        handle = self.engine.allreduce(grads, contribute=contribute, tag=tag, redo=False, new_epoch_ok=k == 0)
        self._pending[k] = handle
        self._launched = k + 1
        return handle

    def _exchange_all(self, tag: int | None, contribute: bool) -> list[Handle | None]:
        """Exchange every bucket in order from the kept gradients (a redo, or a joiner's zeros). A joiner's first
        bucket learns the step; the others then carry it."""
        self._pending = [None] * len(self._buckets)
        self._launched = 0
        first = self._launch(0, tag, contribute)
        if tag is None:
            try:
                tag = first.wait(self._wait_s).tag // len(self._buckets)
            except FTARError:
                return list(self._pending)  # _collect reports it
            self._learned, self.step = tag, tag
        for k in range(1, len(self._buckets)):
            self._launch(k, tag, contribute)
        return list(self._pending)

    @property
    def _wait_s(self) -> float:
        return self.config.epoch_wait_s * 2 + 60

    def _collect(self, handles: list[Handle | None]) -> tuple[int, list[int], int, list[ExchangeResult]]:
        """Wait for every bucket: (failed, epochs, agreed step, results)."""
        failed, epochs, tags, results = 0, [], [], []
        for h in handles:
            if h is None:
                failed = 1
                continue
            try:
                r = h.wait(self._wait_s)
            except Misaligned as e:
                if e.tag < e.highest:
                    raise RejoinRequired(f"this replica is behind the others: {e}") from e
                failed = 1
            except Excluded as e:
                raise RejoinRequired(f"this replica was declared dead: {e}") from e
            except FTARError as e:
                if not isinstance(e, Interrupted):
                    self._log(logging.WARNING, "exchange failed: %s", e)
                failed = 1
            else:
                results.append(r)
                epochs.append(r.epoch)
                tags.append(r.tag // len(self._buckets))
        agreed = tags[0] if tags and len(set(tags)) == 1 else -1
        return failed or int(agreed < 0), epochs or [0], agreed, results

    def _vote(self, failed: int, epochs: list[int], step: int) -> tuple[bool, int]:
        """Replica-local two-phase vote: commit only if every rank exchanged every bucket, all in one epoch, for
        the same step. Returns (commit, the newest epoch any rank exchanged in). The same collective carries
        SIGTERM, so every rank stops at the same commit boundary without a collective of its own."""
        hi, lo = max(epochs), min(epochs)
        ctrl = torch.tensor([failed, hi, -lo, step, -step, int(self._terminate)], dtype=torch.int64,
                            device=self.device)
        dist.all_reduce(ctrl, op=dist.ReduceOp.MAX)
        f, ehi, elo, shi, slo, stop = (int(x) for x in ctrl.tolist())
        self._stop_agreed = bool(stop)
        return f == 0 and ehi == -elo and shi == -slo, ehi

    # --- state: snapshot for joiners, hash ----------------------------------------------------------------------

    def _state(self) -> list[tuple[str, torch.Tensor, bool]]:
        """(name, local tensor, is a DTensor) of every parameter shard and optimizer-state tensor, in order.
        Optimizer-state names say whether the tensor is sharded like its parameter, so a joiner can create it."""
        assert self.opt is not None
        out = []
        for i, p in enumerate(self._params):
            out.append((f"param/{i}", _local(p.detach()), isinstance(p, DTensor)))
        for i, p in enumerate(self._params):
            for key, value in sorted(self.opt.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    kind = "sharded" if isinstance(value, DTensor) else "plain"
                    out.append((f"optim/{i}/{key}/{kind}", _local(value), isinstance(value, DTensor)))
        return out

    def _snapshot(self) -> list[tuple[str, torch.Tensor]]:
        """A copy of everything a joiner needs, on the CPU: taken by the training thread at a commit boundary."""
        out = [(name, t.detach().to("cpu", copy=True).contiguous()) for name, t, _ in self._state()]
        out.append(("data/cursors", self.cursors.clone()))
        out.append(("rng/cpu", torch.get_rng_state()))
        if self.device.type == "cuda":
            out.append(("rng/cuda", torch.cuda.get_rng_state()))
        return out

    def _make_optimizer_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """On a joiner: create the optimizer-state tensors the source has and we lack (zeros, same layout)."""
        assert self.opt is not None
        params = self._params
        for name, t in tensors.items():
            parts = name.split("/")
            if parts[0] != "optim" or len(parts) != 4:
                continue
            try:
                p = params[int(parts[1])]
            except (ValueError, IndexError):
                raise StateMismatch(f"the source's optimizer state {name!r} has no parameter here") from None
            state = self.opt.state[p]
            if parts[2] not in state:
                if parts[3] == "sharded":
                    state[parts[2]] = torch.zeros_like(p.detach(), dtype=t.dtype)
                else:
                    state[parts[2]] = torch.zeros(t.shape, dtype=t.dtype)

    def state_hash(self) -> str:
        """SHA-256 over every rank's parameter and optimizer-state shards and the data cursors (a collective over
        the replica): equal across replicas exactly when their states are bitwise equal."""
        h = hashlib.sha256()
        for name, t, _ in self._state() + [("data/cursors", self.cursors, False)]:
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        mine = torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8).to(self.device)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine)
        return hashlib.sha256(b"".join(bytes(g.cpu().tolist()) for g in gathered)).hexdigest()

    def close(self, leave: bool = True) -> None:
        """Stop the engine, the catch-up server (transfers in progress get a few seconds to finish) and the
        lighthouse session (rank 0 leaves the job gracefully)."""
        if getattr(self, "engine", None) is not None:
            self.engine.close()
        self.server.close(drain_s=10.0)
        self.client.close(leave="finished" if leave and self.rank == 0 else None)
        self.metrics.close()


def _serve_hook(faults: FaultInjector) -> Callable[[int, int], None]:
    """After each chunk a catch-up server sends: the ``serve`` fault, and (tests) ``FTHSDP_FAULT_SLOW_SERVE_S``,
    a slow link: that long after every chunk."""
    slow = float(os.environ.get("FTHSDP_FAULT_SLOW_SERVE_S", "0") or 0)

    def hook(step: int, n: int) -> None:
        faults.at(step, "serve")
        if slow > 0:
            time.sleep(slow)  # a simulated slow link, not synchronisation

    return hook


def _corrupt_from_env() -> Callable[[int, int, bytearray], bool] | None:
    """``FTHSDP_FAULT_CORRUPT_CHUNKS=N`` (tests): this rank's catch-up server flips a byte in the first N chunks
    it sends; the joiner must detect them and fetch them again."""
    n = int(os.environ.get("FTHSDP_FAULT_CORRUPT_CHUNKS", "0") or 0)
    if n <= 0:
        return None
    left = [n]

    def corrupt(entry: int, offset: int, data: bytearray) -> bool:
        if left[0] <= 0 or not data:
            return False
        left[0] -= 1
        data[len(data) // 2] ^= 0xFF
        return True

    return corrupt
