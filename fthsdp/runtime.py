"""The trainer-facing runtime: FSDP2 inside the replica, FTAR across replicas, and the commit protocol.

A training process (one rank of one replica group, started by torchrun) does::

    ft = fthsdp.runtime.Replica()                 # reads FTHSDP_* and torchrun's env
    model = ft.shard(model, blocks=model.blocks)  # FSDP2 over the replica's ranks
    opt = ft.optimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))
    while ft.step < steps:
        result = ft.train_step(lambda: loss_fn(model, batch_for(ft.step)))

``train_step`` runs one step under the commit protocol (DESIGN §3): forward/backward (FSDP2 reduce-scatters
inside the replica), FTAR of every gradient shard across replicas (lane = rank), a replica-local vote (every
rank ok, all in the same epoch), then commit (optimizer step, ``step += 1``) or redo the exchange under the
next epoch from the same local gradients. No lighthouse round trip happens on this path.

A replica that starts while others train registers as *joining*: its first step contributes zeros, receives
the current parameters and optimizer state from an active replica at that step's boundary (the FTAR lane's
state-sync hook), and applies the same averaged update, so it ends the step bitwise identical to the others;
then it turns active.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import signal
import sys
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

from fthsdp.config import RuntimeConfig
from fthsdp.faults import FaultInjector
from ftar.engine import ExchangeResult, FTARConfig, Handle, LaneEngine, SyncContext
from ftar.errors import Excluded, FTARError, Interrupted, Misaligned
from ftar.membership import EpochFeed, LighthouseMembership
from lighthouse import membership as m
from lighthouse.client import LighthouseClient
from lighthouse.errors import Busy

log = logging.getLogger("fthsdp.runtime")

EXIT_REJOIN = 75
"""Exit status of a replica whose state fell behind the others (or that was declared dead while alive): the
launcher restarts it, and it catches up as a joiner."""


class RejoinRequired(RuntimeError):
    """This replica's state can no longer be trusted to match the others'; restart it (exit ``EXIT_REJOIN``)."""


class NoStateToResume(RuntimeError):
    """This replica would start the job over: every other replica is gone and there is nothing to resume."""


class StateMismatch(RuntimeError):
    """A joiner's model or optimizer does not have the layout of the state it was sent."""


@dataclass(frozen=True)
class StepResult:
    step: int
    """The step that was committed."""
    loss: float | None
    """This rank's loss, or None for a joining replica's zero-gradient step."""
    epoch: int
    contributors: int
    joined: bool
    """True for the step in which this replica received the state and joined."""
    attempts: int
    """Exchanges the step needed (1: no failure)."""
    exchange_s: float
    """From the start of backward (a joiner: of the step) until every bucket was exchanged."""


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
        self.device = torch.device("cuda", torch.cuda.current_device()) if cfg.backend == "nccl" else torch.device("cpu")
        self.mesh = init_device_mesh(self.device.type, (cfg.world_size,))
        self.faults = FaultInjector.from_env(self.rank)
        self.incarnation = self._agree_incarnation()
        self.feed = EpochFeed()
        self.client = LighthouseClient(cfg.lighthouse, cfg.job_id, cfg.replica_id, shard_count=cfg.world_size,
                                       on_epoch=self.feed.publish, incarnation=self.incarnation)
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
        if flag.item() == 2:
            self.client.close()
            raise NoStateToResume(f"job {cfg.job_id!r} trained before but no replica is alive to catch up from, "
                                  "and resuming from a checkpoint is not built yet")
        self.joining = bool(flag.item())
        """True until this replica has received the state and committed its first step."""
        self._announced = False
        self.engine = LaneEngine(LighthouseMembership(self.client, self.feed), lane=self.rank,
                                 config=FTARConfig(backend=cfg.backend, timeout_s=cfg.timeout_s,
                                                   epoch_wait_s=cfg.epoch_wait_s),
                                 state_sync=self._sync)
        self.step = 0
        """Committed steps so far (a joiner learns it at its first step)."""
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
        self._log(logging.INFO, "replica up as %s (incarnation %s)", "joining" if self.joining else "active",
                  self.incarnation)

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
        # backward, but these objects (which the optimizer holds) only change in the optimizer step, so a joiner
        # can be served from them at any time between two commits.
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
        """Register the optimizer whose ``step`` the commit protocol runs (over the sharded parameters)."""
        self.opt = opt
        return opt

    @property
    def _params(self) -> list[nn.Parameter]:
        if self.model is None:
            raise RuntimeError("call shard(model) first")
        return self._sharded

    # --- the step -----------------------------------------------------------------------------------------------

    def train_step(self, closure: Callable[[], torch.Tensor]) -> StepResult:
        """Run one step: ``closure()`` returns the loss (the runtime calls ``backward``), unless this replica is
        joining (it then contributes zeros and skips the closure). Returns once the step is committed."""
        if self.opt is None:
            raise RuntimeError("call optimizer(opt) first")
        joined = self.joining
        loss_value: float | None = None
        self.faults.at(self.step, "forward")
        t0 = time.perf_counter()
        if joined:
            if self.rank == 0 and not self._announced:
                # Enter the data plane only now that everything is set up: the others wait for us from here on.
                self._announce()
            handles = self._exchange_all(tag=None, contribute=False)
        else:
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
            handles = list(self._pending)
        attempts = 1
        while True:
            self.faults.at(self.step, "exchange")
            failed, epochs, agreed, results = self._collect(handles)
            self.faults.at(self.step, "vote")
            passed, newest = self._vote(failed, epochs, agreed)
            if passed:
                break
            if attempts >= 20:
                raise RejoinRequired(f"step {self.step}: no consistent exchange in {attempts} attempts")
            attempts += 1
            if not failed and min(epochs) == newest:
                # This lane has the whole step in the newest epoch any rank of the replica saw: its partners in
                # that epoch have it too and will not exchange it again, so keep it; the other lanes catch up.
                self._log(logging.INFO, "vote failed (epochs %s); keeping this lane's epoch-%d result", epochs,
                          newest)
                continue
            self._log(logging.INFO, "vote failed (epochs %s, failed=%d); redoing the step's exchange", epochs, failed)
            self.engine.reset()
            # A joiner that already learned the step says so (its group may still be the one it learned it in).
            known = agreed if agreed >= 0 else self._learned
            handles = self._exchange_all(tag=None if joined and known < 0 else (known if joined else self.step),
                                         contribute=not joined)
        exchange_s = time.perf_counter() - t0
        for bucket, res in zip(self._buckets, results):
            for p, g in zip(bucket, res.tensors):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                _local(p.grad).copy_(g)
        self.faults.at(agreed, "optimizer")
        self.opt.step()
        self.step = agreed + 1
        self.client.set_step(self.step)
        if joined:
            self.joining = False
            if self.rank == 0:
                self.client.ready(m.ACTIVE)
            self._log(logging.INFO, "caught up at step %d, now active", agreed)
        return StepResult(agreed, loss_value, max(epochs), results[0].contributors, joined, attempts, exchange_s)

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
                tag = self._learned = first.wait(self._wait_s).tag // len(self._buckets)
            except FTARError:
                return list(self._pending)  # _collect reports it
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
        the same step. Returns (commit, the newest epoch any rank exchanged in)."""
        hi, lo = max(epochs), min(epochs)
        ctrl = torch.tensor([failed, hi, -lo, step, -step], dtype=torch.int64, device=self.device)
        dist.all_reduce(ctrl, op=dist.ReduceOp.MAX)
        f, ehi, elo, shi, slo = (int(x) for x in ctrl.tolist())
        return f == 0 and ehi == -elo and shi == -slo, ehi

    # --- state: sync to joiners, hash -----------------------------------------------------------------------------

    def _state(self) -> list[tuple[str, torch.Tensor, bool]]:
        """(name, local tensor, is a DTensor) of every parameter shard and optimizer-state tensor, in order."""
        assert self.opt is not None
        out = []
        for i, p in enumerate(self._params):
            out.append((f"param/{i}", _local(p.detach()), isinstance(p, DTensor)))
        for i, p in enumerate(self._params):
            for key, value in sorted(self.opt.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    out.append((f"optim/{i}/{key}", _local(value), isinstance(value, DTensor)))
        return out

    def _make_optimizer_state(self, manifest: list[list[object]]) -> None:
        """On a joiner: create the optimizer-state tensors the source has and we lack (zeros, same layout)."""
        assert self.opt is not None
        params = self._params
        for name, shape, dtype, is_dtensor in manifest:
            parts = str(name).split("/")
            if parts[0] != "optim":
                continue
            p = params[int(parts[1])]
            state = self.opt.state[p]
            if parts[2] not in state:
                if is_dtensor:
                    state[parts[2]] = torch.zeros_like(p.detach())
                else:
                    state[parts[2]] = torch.zeros(shape, dtype=getattr(torch, str(dtype).split(".")[-1]),
                                                  device=self.device if is_dtensor else "cpu")

    def _sync(self, ctx: SyncContext) -> None:
        """FTAR's state-sync hook (engine thread; the main thread is waiting on the exchange): the source sends
        its parameter and optimizer-state shards to the joiners of the lane, as flat per-dtype buffers."""
        if ctx.sending:
            state = self._state()
            manifest = [[n, list(t.shape), str(t.dtype), d] for n, t, d in state]
            ctx.publish("manifest", json.dumps(manifest).encode())
        else:
            manifest = json.loads(ctx.fetch("manifest"))
            if ctx.receiving:
                self._make_optimizer_state(manifest)
            state = self._state() if ctx.receiving else []
        if ctx.receiving:
            got = [[n, list(t.shape), str(t.dtype), d] for n, t, d in state]
            if got != manifest:
                diff = next((f"{g} vs {w}" for g, w in zip(got, manifest) if g != w), f"{len(got)} vs {len(manifest)}")
                raise StateMismatch(f"joiner state layout differs from the source's (mine vs source: {diff}): "
                                    "same model, shard count and optimizer needed")
        dtypes = sorted({str(e[2]) for e in manifest})
        for dtype in dtypes:
            entries = [i for i, e in enumerate(manifest) if str(e[2]) == dtype]
            sizes = [int(torch.Size(manifest[i][1]).numel()) for i in entries]
            torch_dtype = getattr(torch, dtype.split(".")[-1])
            if ctx.sending:
                flat = torch.cat([state[i][1].reshape(-1).to(self.device) for i in entries])
            else:
                flat = torch.empty(sum(sizes), dtype=torch_dtype, device=self.device)
            ctx.broadcast(flat)
            if ctx.receiving:
                offset = 0
                for i, n in zip(entries, sizes):
                    with torch.no_grad():
                        state[i][1].copy_(flat[offset: offset + n].view(state[i][1].shape))
                    offset += n

    def state_hash(self) -> str:
        """SHA-256 over every rank's parameter and optimizer-state shards (a collective over the replica):
        equal across replicas exactly when their states are bitwise equal."""
        h = hashlib.sha256()
        for name, t, _ in self._state():
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        mine = torch.frombuffer(bytearray(h.digest()), dtype=torch.uint8).to(self.device)
        gathered = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(gathered, mine)
        return hashlib.sha256(b"".join(bytes(g.cpu().tolist()) for g in gathered)).hexdigest()

    def close(self, leave: bool = True) -> None:
        """Stop the engine and the lighthouse session (rank 0 leaves the job gracefully)."""
        self.engine.close()
        self.client.close(leave="finished" if leave and self.rank == 0 else None)
