"""The trainer keeps its loop: the pieces that fit fthsdp into an ordinary FSDP2 training loop.

- ``LoopOptimizer``: what ``Replica.optimizer`` returns, the trainer's optimizer wrapped. ``zero_grad()`` begins a
  step (``Replica.begin``: a joiner catches up there, a spare shadows the others there), ``backward()`` exchanges
  the gradient shards across replicas as FSDP2 produces them and returns with the step's averaged gradients as
  ``.grad`` (so clipping or a gradient-norm log sees them), ``step()`` commits (``Replica.finish``).
- ``absorb_step``: the trainer's own ``scheduler.step()`` is absorbed; the runtime steps the scheduler once per
  committed step, replays included.
- ``fsdp_units``: the buckets of a model the trainer sharded itself, one per FSDP2 unit.
- ``SlotLoader``: a real ``torch.utils.data.DataLoader`` (worker processes, prefetch) positioned by the replica's
  data slot and cursor, so every batch is trained exactly once across failures.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import multiprocessing.context
import multiprocessing.forkserver
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, Dataset, Sampler

from ftar.devices import start_thread
from fthsdp.runtime.config import ConfigError
from fthsdp.runtime.data import ReplicaLike, SlotSampler, batch_index
from fthsdp.runtime.result import StepResult

log = logging.getLogger("fthsdp.runtime")


class Loop(Protocol):
    """What the wrapped optimizer drives (``fthsdp.runtime.replica.Replica``)."""

    def begin(self) -> bool: ...
    def finish(self) -> StepResult | None: ...


class LoopOptimizer(torch.optim.Optimizer):
    """The trainer's optimizer, its ``zero_grad`` and ``step`` tied to the commit protocol (see the module's doc).
    Everything else (``param_groups``, ``state``, ``state_dict``) is the wrapped optimizer's, so an LR scheduler
    built on either drives the same groups."""

    def __init__(self, inner: torch.optim.Optimizer, loop: Loop) -> None:  # noqa: D107 - no super().__init__:
        self.inner, self._loop = inner, loop  # the groups and state are the inner optimizer's, not copies

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.inner.param_groups = groups

    @property
    def state(self) -> Any:
        return self.inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self.inner.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.inner.defaults = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Begin a step (``Replica.begin``). ``set_to_none`` is ignored: gradients are always dropped."""
        self._loop.begin()

    def step(self, closure: Callable[[], float] | None = None) -> StepResult | None:  # type: ignore[override]
        """Commit the step (``Replica.finish``): its result, or None for an iteration that trained nothing."""
        if closure is not None:
            raise TypeError("step(closure) is not supported: compute the loss and call backward() before step()")
        return self._loop.finish()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        raise RuntimeError("the runtime owns the optimizer's state once registered: a replica resumes from the job's "
                           "checkpoint (FTHSDP_CHECKPOINT_DIR) or catches up from the others")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise RuntimeError("add every param group before ft.optimizer(): the exchange's buckets are planned then")

    def __repr__(self) -> str:
        return f"LoopOptimizer({self.inner!r})"


def absorb_step(scheduler: Any) -> Callable[[], None]:
    """Make ``scheduler.step()`` a no-op for the trainer and return the real one, which the runtime calls at every
    commit (a joiner's replayed steps included). Done by giving the object a subclass of its own class, so its
    ``__dict__`` (what ``state_dict`` saves) stays as it was."""
    cls = type(scheduler)
    real = cls.step.__get__(scheduler, cls)

    told: list[bool] = []  # not on the object: its __dict__ is its state, digested and compared across replicas

    def absorbed(self: Any, *args: object, **kwargs: object) -> None:
        if not told:
            log.info("fthsdp: the runtime steps the LR scheduler at every committed step; the trainer's "
                     "scheduler.step() calls do nothing")
            told.append(True)

    scheduler.__class__ = type(cls.__name__, (cls,), {"step": absorbed, "__module__": cls.__module__})
    return real  # type: ignore[no-any-return]


def fsdp_units(model: nn.Module) -> tuple[list[nn.Parameter], list[list[nn.Parameter]]]:
    """A model the trainer sharded with ``fully_shard``: its (sharded) parameters, and per FSDP2 unit other than
    the root, in module order, the parameters that unit manages (not those of a unit inside it). Each unit's
    gradient shards form one bucket of the exchange. ``model`` may also hold several roots (a container that is
    not itself sharded, e.g. an ``nn.ModuleList`` of a rank's pipeline stages): then every unit is a bucket, and
    every parameter must be in one. Raises ``TypeError`` for a model not sharded with FSDP2."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        raise TypeError(f"{type(model).__name__} is not sharded with FSDP2: apply torch.distributed.fsdp.fully_shard "
                        "to its blocks and to the model itself (or let ft.shard(model, blocks) do it)")
    owner: dict[int, nn.Module] = {}
    for unit in units:  # pre-order: an inner unit comes after the units around it, and takes its parameters
        for p in unit.parameters():
            owner[id(p)] = unit
    params = list(model.parameters())
    if outside := [name for name, p in model.named_parameters() if id(p) not in owner]:
        raise TypeError(f"{type(model).__name__}: parameters in no FSDP2 unit ({', '.join(outside[:3])}): shard "
                        "every stage with fully_shard")
    root = model if isinstance(model, FSDPModule) else None
    blocks = [[p for p in params if owner[id(p)] is unit] for unit in units if unit is not root]
    return params, [b for b in blocks if b]


def worker_context() -> multiprocessing.context.BaseContext:
    """How the loader's workers start: from a fork server, never by forking this process, whose gRPC and FTAR
    threads make a fork unsafe (a worker forked while gRPC was busy crashed with SIGSEGV). The server imports torch
    and the training script once, started here, before the first batch is asked for (a joiner's catch-up runs
    meanwhile); each worker forks from it."""
    multiprocessing.set_forkserver_preload(["__main__", "torch"])
    ctx = multiprocessing.get_context("forkserver")
    multiprocessing.forkserver.ensure_running()  # starts it now (it imports meanwhile): a joiner catches up then
    return ctx


WATCH_S = 1.0
"""How often a loader worker looks whether its training process is still there (``watch_trainer``)."""


def watch_trainer(trainer: int, then: Callable[[int], object] | None, worker_id: int) -> None:
    """A loader worker's ``worker_init_fn``: end the worker once the training process ``trainer`` is gone. A worker
    started from the fork server is the server's child, so DataLoader's own check (its parent's pid) never sees
    the trainer die (a SIGKILL), and the worker, and the server it keeps alive, would outlive it. Then the
    trainer's own ``worker_init_fn``, if any."""

    def watch() -> None:
        while True:
            time.sleep(WATCH_S)  # a liveness poll, not synchronisation
            try:
                os.kill(trainer, 0)
            except ProcessLookupError:
                os._exit(0)
            except PermissionError:
                pass  # alive, another user's: not ours to judge

    start_thread(watch, name="fthsdp-watch-trainer", device=None)
    if then is not None:
        then(worker_id)


class Position(ReplicaLike, Protocol):
    """What the loader reads of the replica: its slot and cursor now (``data.ReplicaLike``), the loop's iteration,
    and with orphan slots carried the iteration's micro-batches (``Steps.step_batches``, ``Steps.take``)."""

    iteration: int

    @property
    def carrying(self) -> bool: ...

    def step_batches(self) -> tuple[tuple[int, int, int], ...]: ...

    def take(self, k: int) -> tuple[int, int, int]: ...


Plan = tuple[tuple[int, int, int], ...]
"""A step's micro-batches, in order, as (slot, cursor, micro-batch)."""


def planned(plan: Plan, i: int) -> tuple[int, int, int]:
    """The ``i``-th micro-batch from the start of ``plan`` when every step after the first trains the same (the
    same parts, each cursor one further)."""
    slot, cursor, micro = plan[i % len(plan)]
    return slot, cursor + i // len(plan), micro


class CursorSampler(Sampler[list[int]]):
    """A batch sampler: from ``plan`` (the first step's micro-batches) on, every step's micro-batches of this rank
    (``planned``), endlessly."""

    def __init__(self, sampler: SlotSampler, micro_batches: int, rank: int, ranks: int, slots: int) -> None:
        self.sampler, self.micro_batches = sampler, micro_batches
        self.rank, self.ranks, self.slots = rank, ranks, slots
        self.plan: Plan = ((0, 0, 0),)

    def index(self, slot: int, cursor: int, micro: int) -> int:
        """The global micro-batch number of (slot, cursor, this rank, micro)."""
        return batch_index(slot, cursor, self.rank, self.slots, self.ranks) * self.micro_batches + micro

    def __iter__(self) -> Iterator[list[int]]:
        plan, i = self.plan, 0
        while True:
            yield self.sampler.indices(self.index(*planned(plan, i)))
            i += 1


class SlotLoader:
    """A ``torch.utils.data.DataLoader`` over a map-style dataset, positioned by the replica's data slot and cursor
    (``Replica.dataloader``). Each step of a slot is ``micro_batches`` batches of ``batch_size`` items per rank
    (a seeded permutation per pass, like ``DistributedSampler``). The loader prefetches ahead in its worker
    processes; whenever the batch the replica needs next is not the one coming (a step that did not commit, a
    catch-up or checkpoint that moved the cursor, a spare handed a slot), it restarts at the right place (the
    workers persist). Take a step's batches after ``zero_grad()``. With orphan slots carried
    (``FTHSDP_ORPHANS=carry``) a step's batches are those dealt to the replica (its slot's and its share of the
    orphans', ``Steps.step_batches``): iterate them with ``for batch in loader:``, which ends after the step's
    last and sets FSDP2's gradient sync on for it alone."""

    def __init__(self, ft: Position, dataset: Dataset[Any], batch_size: int, *, micro_batches: int = 1,
                 seed: int = 0, shuffle: bool = True, split: tuple[int, int] | None = None,
                 **loader_kwargs: Any) -> None:
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        for key in ("sampler", "batch_sampler", "batch_size", "shuffle", "drop_last"):
            if key in loader_kwargs:
                raise ValueError(f"{key}= is the slot loader's to set: it samples by the replica's slot and cursor")
        self.ft, self.micro_batches = ft, micro_batches
        size = len(dataset)  # type: ignore[arg-type]
        rank, ranks = split or (ft.rank, ft.world_size)  # who shares the slot's batch: data_split
        self.sampler = CursorSampler(SlotSampler(size, batch_size, seed=seed, shuffle=shuffle), micro_batches,
                                     rank, ranks, ft.slots)
        if loader_kwargs.get("num_workers", 0) > 0:
            loader_kwargs.setdefault("persistent_workers", True)  # the workers outlive a restart of the position
            if "multiprocessing_context" not in loader_kwargs:
                loader_kwargs["multiprocessing_context"] = worker_context()
                loader_kwargs["worker_init_fn"] = functools.partial(
                    watch_trainer, os.getpid(), loader_kwargs.get("worker_init_fn"))
        self.loader = DataLoader(dataset, batch_sampler=self.sampler, **loader_kwargs)
        self._it: Iterator[Any] | None = None
        self._next: tuple[int, int, int] | None = None  # (slot, cursor, micro) the iterator yields next
        self._yielded = 0  # batches the iterator yielded since it (re)started at ``sampler.plan``
        self._iteration, self._taken = -1, 0
        self.restarts = 0
        """How often the position was restarted (prefetched batches thrown away)."""

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        if self.ft.iteration != self._iteration:
            self._iteration, self._taken = self.ft.iteration, 0
        if self.ft.carrying:
            plan = self.ft.step_batches()
            if self._taken >= len(plan):
                raise StopIteration  # the step's batches are all out
        else:
            if self._taken >= self.micro_batches:
                raise RuntimeError(f"more than micro_batches={self.micro_batches} batches taken in one step")
            plan = tuple((self.ft.slot, self.ft.cursor, micro) for micro in range(self.micro_batches))
        want = plan[self._taken]
        if self._it is None or self._next != want:
            self.sampler.plan = plan
            self._it = iter(self.loader)
            self.restarts += self._next is not None
            for _ in range(self._taken):
                next(self._it)
            self._yielded = self._taken
        if self.ft.carrying:
            self.ft.take(self._taken)
        batch = next(self._it)
        self._taken += 1
        self._yielded += 1
        self._next = planned(self.sampler.plan, self._yielded)
        return batch


def layout_of(mesh: DeviceMesh | None, world_size: int) -> str:
    """How the lighthouse names a replica's layout: its device mesh's dimensions, name and size each, joined by
    ``x`` (``dp2xtp2``; an unnamed dimension is ``d<i>``); '' for no mesh. Every replica of a job must register the
    same (rank r of each exchanges its shards with rank r of the others). Raises ``ConfigError`` for a mesh that
    is not over the replica's ``world_size`` ranks."""
    if mesh is None:
        return ""
    if mesh.size() != world_size:
        raise ConfigError(f"the replica's mesh has {mesh.size()} ranks, its process group {world_size}: hand the "
                          "runtime the mesh of the whole replica")
    names = mesh.mesh_dim_names or tuple(f"d{i}" for i in range(mesh.ndim))
    return "x".join(f"{name}{size}" for name, size in zip(names, mesh.shape, strict=True))


def data_split(mesh: DeviceMesh | None, world_size: int) -> tuple[int, int] | None:
    """(this rank's part, parts) of a slot's batch split over ``mesh``, the replica's data-parallel ranks (None:
    over all its ``world_size`` ranks). Raises ``ValueError`` for a mesh that cannot be that dimension."""
    if mesh is None:
        return None
    if mesh.ndim != 1:
        raise ValueError(f"the data's mesh must be 1-D (the replica's data-parallel dimension, e.g. mesh['dp']), "
                         f"got {mesh.ndim}-D {mesh.mesh_dim_names or ''}")
    if mesh.size() > world_size or world_size % mesh.size():
        raise ValueError(f"the data's mesh has {mesh.size()} ranks: not a dimension of this replica's {world_size}")
    rank = mesh.get_local_rank()
    assert isinstance(rank, int)
    return rank, mesh.size()


def indices_of(sampler: SlotSampler, slot: int, cursor: int, rank: int, micro: int, *, slots: int, ranks: int,
               micro_batches: int) -> Sequence[int]:
    """The dataset indices a ``SlotLoader`` with these settings yields for (slot, cursor, rank, micro)."""
    return sampler.indices(batch_index(slot, cursor, rank, slots, ranks) * micro_batches + micro)
