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
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from fthsdp.runtime import exact, roles
from fthsdp.runtime.buckets import BucketExchange
from fthsdp.runtime.closure import ClosureSteps
from fthsdp.runtime.config import RuntimeConfig
from fthsdp.runtime.loop import LoopOptimizer, absorb_step, fsdp_units, layout_of
from fthsdp.runtime.state import replica_hash
from fthsdp.runtime.trainer_state import Scheduler, Stateful


def grads_untouched(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt`` is known never to change ``.grad`` in place (so a step's results can be the gradients):
    torch's Adam and AdamW, and SGD without Nesterov (which adds the momentum into ``.grad``), none of them
    ``differentiable``. Anything else is not known, so its gradients are copied. (Version counters cannot tell:
    an in-place op on a DTensor does not move its local tensor's counter.)"""
    groups = opt.param_groups
    if any(g.get("differentiable", False) for g in groups):
        return False
    if type(opt) in (torch.optim.Adam, torch.optim.AdamW):
        return True
    return type(opt) is torch.optim.SGD and not any(g.get("nesterov", False) for g in groups)


class Replica(ClosureSteps):
    """One rank's handle on fault-tolerant HSDP. Create it after torchrun has set the environment: it joins the
    replica's process group, registers with the lighthouse (a warm standby once released) and takes the role the
    lighthouse gives it (``fthsdp.runtime.roles``). ``mesh``: the device mesh the trainer built over the
    replica's ranks, if any (tensor or pipeline parallelism inside: docs/design.md §3b); its layout is registered,
    and a replica whose layout differs from the job's is refused (``ConfigError``)."""

    def __init__(self, config: RuntimeConfig | None = None, mesh: DeviceMesh | None = None) -> None:
        cfg = config or RuntimeConfig.from_env()
        super().__init__(cfg, layout_of(mesh, cfg.world_size))
        self._sharded: list[nn.Parameter] = []
        self._buckets: BucketExchange | None = None
        if not self.config.standby_gate:
            self.become(roles.given(self.register(), self.slot))
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
        self.log(logging.INFO, "replica up as %s (incarnation %s, catch-up server %s)",
                 "a warm standby" if self.standby else "joining" if self.joining else
                 "resuming" if self.resume else "active", self.incarnation, self.server.address)

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
        self._buckets = self._exchange(self._sharded, [list(b.parameters()) for b in blocks])
        return model

    def _exchange(self, params: list[nn.Parameter], blocks: list[list[nn.Parameter]]) -> BucketExchange:
        buckets = BucketExchange(params, blocks, self.engine, slot=lambda: self.slot, slots=self.config.num_replicas,
                                 device=self.device, wait_s=self.wait_s)
        buckets.parts = self.config.micro_batches if self.config.carry_orphans else 0  # the mask's, every replica's
        if self.config.deterministic:
            buckets.exact = exact.Accumulators(self.config.num_replicas * self.config.micro_batches)
        return buckets

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
        assert self._buckets is not None
        self._buckets.alias = grads_untouched(opt)  # the step's results become .grad, without a copy
        self.attach(self.model, self._sharded, opt, self._buckets)
        return LoopOptimizer(opt, self)

    def _adopt(self, model: nn.Module) -> None:
        """Take a model the trainer sharded with FSDP2 (``loop.fsdp_units``): one bucket per unit."""
        params, blocks = fsdp_units(model)
        self.model, self._sharded = model, params
        self._buckets = self._exchange(params, blocks)

    def state_hash(self) -> str:
        """SHA-256 over every rank's tensors, the cursors, param groups and registered state (a collective over the
        replica): equal across replicas exactly when their states are bitwise equal (RNG aside: design.md §7)."""
        return replica_hash(self.parts()[0].digest(self.cursors), self.world_size, self.device)
