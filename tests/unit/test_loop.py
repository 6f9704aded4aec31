"""The trainer keeps its loop (fthsdp/runtime/loop.py, grad_scale.py, the buckets' end-of-backward callback and post
exchange): what the runtime keeps and sends cannot be changed by the trainer's in-place edits of ``.grad``; a
uniform scaling (clipping) is found bitwise and re-applied bitwise, anything else is refused; the scheduler's
own ``step()`` calls are absorbed while its state stays saveable; the loader follows the slot and cursor.
In-process: a one-rank Gloo group over a HashStore, a recording stand-in for the lane engine."""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

from ftar import ExchangeResult, Handle, Interrupted
from fthsdp.runtime import grad_scale, posts
from fthsdp.runtime.buckets import BucketExchange
from fthsdp.runtime.data import SlotSampler
from fthsdp.runtime.loop import LoopOptimizer, SlotLoader, absorb_step, data_split, fsdp_units, indices_of
from fthsdp.runtime.trainer_state import TrainerState

CPU = torch.device("cpu")


@dataclass
class Engine:
    """Records every allreduce and answers at once with a copy of the inputs (one contributor's average); keeps
    every result it returned, as FTAR holds them to serve a lagging partner."""

    calls: list[dict[str, Any]] = field(default_factory=list)
    held: list[list[torch.Tensor]] = field(default_factory=list)

    def allreduce(self, tensors: Sequence[torch.Tensor], **kw: Any) -> Handle:
        self.calls.append({"tensors": [t.clone() for t in tensors], **kw})
        out = [t.clone() for t in tensors]
        self.held.append(out)
        future: Future[ExchangeResult] = Future()
        future.set_result(ExchangeResult(out, 1, 1, 1, kw["tag"] if kw["tag"] is not None else 0))
        return Handle(future)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return self.head(x).sum()


def exchange_of(model: Model, engine: Engine | None = None) -> tuple[Engine, BucketExchange]:
    """A recording engine (``engine``, or a new ``Engine``) and the bucket exchange of ``model``'s FSDP2 units over
    it."""
    engine = engine or Engine()
    params, blocks = fsdp_units(model)
    return engine, BucketExchange(params, blocks, engine, slot=lambda: 0, slots=1, device=CPU,  # type: ignore[arg-type]
                                  wait_s=5.0)


def shard(model: Model) -> Model:
    """``model`` with each block and the root sharded by FSDP2 over the one-rank group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (1,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


@pytest.fixture
def sharded(one_rank_group: None) -> Model:
    torch.manual_seed(0)
    return shard(Model())


# --- what the runtime keeps and sends ------------------------------------------------------------------------


def test_an_in_place_edit_of_grad_after_backward_changes_nothing_the_runtime_keeps_or_sends(sharded: Model) -> None:
    """The trainer's loop: the end of backward settles the exchange and binds the averaged gradients as ``.grad``.
    Clipping them in place (as ``clip_grad_norm_`` does) leaves the results FTAR holds for a lagging partner, and
    what was sent, untouched; the scale is found bitwise."""
    engine, buckets = exchange_of(sharded)
    buckets.posts, buckets.alias = True, False  # as Replica.begin sets them
    settled: list[list[ExchangeResult]] = []

    def at_end() -> None:
        settled.append([h.wait() for h in buckets.launch_rest(0) if h is not None])
        buckets.install(settled[-1])

    buckets.arm(0, at_end=at_end)
    sharded(torch.ones(2, 4)).backward()
    buckets.disarm()
    assert len(settled) == 1  # the callback ran once, inside backward()
    sent = [[t.clone() for t in c["tensors"]] for c in engine.calls]
    held = [[t.clone() for t in ts] for ts in engine.held]
    before = [g.clone() for g in buckets.grads()]
    assert all(torch.equal(a, b) for a, b in zip(before, buckets.averaged(settled[0]), strict=True))

    norm = torch.nn.utils.clip_grad_norm_(sharded.parameters(), 1e-3)  # in place, on the bound gradients
    assert float(norm) > 1e-3  # it did clip
    after = buckets.grads()
    assert not all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert all(torch.equal(a, b) for c, s in zip(engine.calls, sent, strict=True) for a, b in zip(c["tensors"], s,
                                                                                                  strict=True))
    assert all(torch.equal(a, b) for ts, hs in zip(engine.held, held, strict=True) for a, b in zip(ts, hs,
                                                                                                  strict=True))
    factor = grad_scale.scale_of(buckets.averaged(settled[0]), after)
    replayed = [g.clone() for g in buckets.averaged(settled[0])]
    grad_scale.apply(replayed, factor)  # what a joiner's replay or a spare does: the same bytes
    assert all(torch.equal(a, b) for a, b in zip(replayed, after, strict=True))


def test_with_aliasing_the_same_edit_would_have_changed_the_held_results(sharded: Model) -> None:
    """The hazard the copy closes (``train_step``'s aliasing, for an optimizer known to leave ``.grad`` alone)."""
    engine, buckets = exchange_of(sharded)
    buckets.alias = True
    with buckets.armed(0):
        sharded(torch.ones(2, 4)).backward()
    results = [h.wait() for h in buckets.launch_rest(0) if h is not None]
    held = [t.clone() for t in buckets.averaged(results)]
    buckets.install(results)
    torch.nn.utils.clip_grad_norm_(sharded.parameters(), 1e-3)
    assert not all(torch.equal(a, b) for a, b in zip(held, buckets.averaged(results), strict=True))


def test_a_second_backward_after_the_exchange_began_is_a_clear_error(sharded: Model) -> None:
    engine, buckets = exchange_of(sharded)
    buckets.arm(3)
    sharded(torch.ones(2, 4)).backward()
    with pytest.raises(RuntimeError, match="set_requires_gradient_sync"):
        sharded(torch.ones(2, 4)).backward()


def test_accumulation_without_sync_exchanges_once_on_the_last_micro_batch(sharded: Model) -> None:
    engine, buckets = exchange_of(sharded)
    ends: list[int] = []
    buckets.arm(0, at_end=lambda: ends.append(len(engine.calls)))
    sharded.set_requires_gradient_sync(False)  # type: ignore[operator]
    sharded(torch.ones(2, 4)).backward()
    assert engine.calls == [] and ends == []
    sharded.set_requires_gradient_sync(True)  # type: ignore[operator]
    sharded(torch.ones(2, 4)).backward()
    assert ends == [3]  # every bucket went out during the last backward, before the callback


def test_fsdp_units_are_the_buckets_of_a_model_the_trainer_sharded(sharded: Model) -> None:
    params, blocks = fsdp_units(sharded)
    assert len(params) == 6 and [len(b) for b in blocks] == [2, 2]  # the head's are the root's
    with pytest.raises(TypeError, match="fully_shard"):
        fsdp_units(nn.Linear(2, 2))


def test_a_ranks_several_fsdp2_roots_are_one_model_every_unit_a_bucket(one_rank_group: None) -> None:
    """A rank of an interleaved pipeline holds several stages, each its own FSDP2 root, handed over as one
    container: every unit is a bucket (no root takes the rest), and a parameter in no unit is refused."""
    from torch.distributed.fsdp import fully_shard

    stages = nn.ModuleList([fully_shard(nn.Linear(2, 2)), fully_shard(nn.Linear(2, 3))])
    params, blocks = fsdp_units(stages)
    assert len(params) == 4 and [len(b) for b in blocks] == [2, 2]
    assert {id(p) for b in blocks for p in b} == {id(p) for p in params}
    stages.append(nn.Linear(1, 1))
    with pytest.raises(TypeError, match="no FSDP2 unit"):
        fsdp_units(stages)


# --- the scale -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("coef", [1.0, 0.5, 0.123456789, 3e-5, 0.9999999])
def test_a_uniform_scaling_is_found_bitwise(coef: float) -> None:
    torch.manual_seed(1)
    before = [torch.randn(50), torch.randn(3, 7), torch.zeros(0)]
    c = torch.tensor(coef, dtype=torch.float32)
    after = [b * c for b in before]
    found = grad_scale.scale_of(before, after)
    again = [b.clone() for b in before]
    grad_scale.apply(again, found)
    assert all(torch.equal(a, b) for a, b in zip(again, after, strict=True))
    assert grad_scale.unpack(grad_scale.pack(found)) == found


def test_other_changes_are_refused() -> None:
    before = [torch.tensor([1.0, -2.0, 3.0])]
    with pytest.raises(grad_scale.UnreplayableGradients, match="uniform scaling"):
        grad_scale.scale_of(before, [torch.tensor([1.0, -2.0, 2.5])])  # clipped by value
    with pytest.raises(grad_scale.UnreplayableGradients):
        grad_scale.scale_of(before + [torch.ones(2)], [before[0] * 0.5, torch.ones(2) * 0.25])  # two factors


def test_the_packed_factor_survives_an_average_and_a_mixed_one_is_refused() -> None:
    f = 0.3141592
    words = grad_scale.pack(f)
    n = 3
    assert grad_scale.unpack([w * n / n for w in words]) == pytest.approx(f, rel=1e-7)
    assert grad_scale.unpack(grad_scale.pack(None)) == 1.0
    mixed = [(a + b) / 2 for a, b in zip(grad_scale.pack(0.5), grad_scale.pack(0.25), strict=True)]
    with pytest.raises(grad_scale.UnreplayableGradients, match="differently"):
        grad_scale.unpack(mixed)


@dataclass
class Answering(Engine):
    """The others' side of a post exchange: answers it with ``words`` (their average), or fails it with ``lost``."""

    words: list[float] = field(default_factory=list)
    lost: bool = False

    def allreduce(self, tensors: Sequence[torch.Tensor], **kw: Any) -> Handle:
        future: Future[ExchangeResult] = Future()
        if self.lost:
            future.set_exception(Interrupted("lost with its epoch", 2))
        else:
            future.set_result(ExchangeResult([torch.tensor(self.words)], 3, 3, 1, kw["tag"]))
        self.calls.append({"tensors": [t.clone() for t in tensors], **kw})
        return Handle(future)


@pytest.mark.parametrize("others", [0.5, 0.25])
def test_a_post_exchange_nobody_waited_for_is_read_after_the_next_exchange(sharded: Model, others: float) -> None:
    """An active replica sends its factor in the step's post exchange and steps its optimizer without waiting; the
    step core reads it once the lane has exchanged something after it: another factor is a clear error there."""
    _, buckets = exchange_of(sharded, Answering(words=[*grad_scale.pack(others), 2.0]))
    buckets.posts = True
    buckets.launch_post(7, 0.5, None)
    assert buckets.unchecked is not None and buckets.unchecked[:2] == (7, 0.5)
    if others == 0.5:
        posts.agree(buckets, 1.0)
    else:
        with pytest.raises(grad_scale.UnreplayableGradients, match="step 7: this replica scaled .* by 0.5, the others "
                           "by 0.25"):
            posts.agree(buckets, 1.0)
    assert buckets.unchecked is None  # read once
    posts.agree(buckets, 1.0)  # nothing left to read


def test_a_post_exchange_lost_with_its_epoch_is_not_read(sharded: Model) -> None:
    """The vote's redo sends it again (and that one is read): the lost one raises nothing."""
    _, buckets = exchange_of(sharded, Answering(lost=True))
    buckets.launch_post(7, 0.5, None)
    posts.agree(buckets, 1.0)
    assert buckets.unchecked is None
    buckets.launch_post(8, None, None)  # a zero contributor's: it waits for it itself
    assert buckets.unchecked is None


# --- the scheduler and the optimizer ---------------------------------------------------------------------------


def test_the_trainers_scheduler_step_is_absorbed_and_its_state_still_saves() -> None:
    opt = torch.optim.AdamW([nn.Parameter(torch.ones(2))], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
    saved = sched.state_dict()
    real = absorb_step(sched)
    sched.step()  # the trainer's call: nothing
    assert sched.state_dict() == saved  # nor a trace in its state (digested: it must be the same on every replica)
    assert sched.get_last_lr() == [1.0] and sched.last_epoch == 0
    real()  # the runtime's, at a commit
    assert sched.get_last_lr() == [0.5] and isinstance(sched, torch.optim.lr_scheduler.LambdaLR)
    state = TrainerState()
    state.register("scheduler", sched, on_commit=real)
    state.encode(opt)  # JSON-able: the absorbing class added nothing to the object's __dict__


def test_the_wrapped_optimizer_shares_the_groups_and_drives_the_loop() -> None:
    calls: list[str] = []

    class Loop:
        def begin(self) -> bool:
            calls.append("begin")
            return True

        def finish(self) -> None:
            calls.append("finish")

    inner = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=0.1)
    opt = LoopOptimizer(inner, Loop())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.1)  # a scheduler built on the wrapper
    assert math.isclose(inner.param_groups[0]["lr"], 0.01) and opt.param_groups is inner.param_groups
    opt.zero_grad()
    opt.step()
    sched.step()
    assert calls == ["begin", "finish"]
    with pytest.raises(TypeError, match="closure"):
        opt.step(lambda: 0.0)
    with pytest.raises(RuntimeError, match="param group"):
        opt.add_param_group({"params": []})


# --- the loader ------------------------------------------------------------------------------------------------


class Position:
    """A stand-in for the replica: slot, cursor and the loop's iteration, set by the test."""

    def __init__(self) -> None:
        self.slot, self.rank, self.world_size, self.iteration, self.cursor, self.slots = 1, 1, 2, 0, 0, 3
        self.carrying = False
        self.batches: tuple[tuple[int, int, int], ...] = ()  # with orphan slots carried: the iteration's
        self.taken: list[int] = []

    def step_batches(self) -> tuple[tuple[int, int, int], ...]:
        return self.batches

    def take(self, k: int) -> tuple[int, int, int]:
        self.taken.append(k)
        return self.batches[k]


class Items(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 50

    def __getitem__(self, i: int) -> int:
        return i


def test_the_loader_yields_the_slots_batches_by_cursor_and_restarts_where_the_cursor_is() -> None:
    ft = Position()
    loader = SlotLoader(ft, Items(), 4, micro_batches=2, seed=7)  # type: ignore[arg-type]
    sampler = SlotSampler(50, 4, seed=7)

    def want(slot: int, cursor: int, micro: int) -> list[int]:
        return list(indices_of(sampler, slot, cursor, 1, micro, slots=3, ranks=2, micro_batches=2))

    def take() -> list[int]:
        return [int(x) for x in next(loader)]

    ft.iteration = 1
    assert [take(), take()] == [want(1, 0, 0), want(1, 0, 1)]
    with pytest.raises(RuntimeError, match="micro_batches"):
        take()
    ft.iteration, ft.cursor = 2, 1  # committed: the next step's batches come as prefetched
    assert [take(), take()] == [want(1, 1, 0), want(1, 1, 1)] and loader.restarts == 0
    ft.iteration = 3  # step 1 did not commit (cursor stays): the same batches again
    assert [take(), take()] == [want(1, 1, 0), want(1, 1, 1)] and loader.restarts == 1
    ft.iteration, ft.cursor, ft.slot = 4, 5, 2  # a catch-up moved the cursor, a spare took slot 2
    assert take() == want(2, 5, 0) and loader.restarts == 2
    with pytest.raises(ValueError, match="sampler"):
        SlotLoader(ft, Items(), 4, sampler=None)  # type: ignore[arg-type]


def test_with_orphan_slots_carried_the_loader_yields_the_step_dealt_and_ends_there() -> None:
    """A survivor dealt its slot's two micro-batches and one of the orphan slot 0's: ``for batch in loader`` yields
    those three in order, each taken through the replica (which sets FSDP2's gradient sync on the last), then
    ends; the next step's come as prefetched while the deal holds, and a new deal restarts the position."""
    ft = Position()
    ft.carrying, ft.slot = True, 1
    loader = SlotLoader(ft, Items(), 4, micro_batches=2, seed=7)  # type: ignore[arg-type]
    sampler = SlotSampler(50, 4, seed=7)

    def want(slot: int, cursor: int, micro: int) -> list[int]:
        return list(indices_of(sampler, slot, cursor, 1, micro, slots=3, ranks=2, micro_batches=2))

    ft.iteration, ft.batches = 1, ((0, 3, 1), (1, 3, 0), (1, 3, 1))
    assert [[int(x) for x in b] for b in loader] == [want(0, 3, 1), want(1, 3, 0), want(1, 3, 1)]
    assert ft.taken == [0, 1, 2]
    ft.iteration, ft.batches = 2, ((0, 4, 1), (1, 4, 0), (1, 4, 1))  # committed, the same deal
    assert [[int(x) for x in b] for b in loader] == [want(0, 4, 1), want(1, 4, 0), want(1, 4, 1)]
    assert loader.restarts == 0
    ft.iteration, ft.batches = 3, ((1, 5, 0), (1, 5, 1))  # the orphan's holder is back: its own slot alone
    assert [[int(x) for x in b] for b in loader] == [want(1, 5, 0), want(1, 5, 1)] and loader.restarts == 1


@dataclass
class Mesh:
    """A stand-in for a ``DeviceMesh``: what ``data_split`` reads."""

    ndim: int
    ranks: int
    local: int
    mesh_dim_names: tuple[str, ...] | None = None

    def size(self) -> int:
        return self.ranks

    def get_local_rank(self) -> int:
        return self.local


def test_a_data_mesh_splits_the_slots_batch_over_its_ranks_alone() -> None:
    """A tensor-parallel replica of 4 ranks hands the loader its data-parallel dimension (2 ranks): the batch is
    split in 2, and rank 3 (data rank 1) reads what data rank 1 of a 2-rank replica would."""
    ft = Position()
    ft.rank, ft.world_size = 3, 4
    assert data_split(None, 4) is None  # every rank of the replica
    dp = Mesh(ndim=1, ranks=2, local=1, mesh_dim_names=("dp",))
    assert data_split(dp, 4) == (1, 2)  # type: ignore[arg-type]
    loader = SlotLoader(ft, Items(), 4, micro_batches=1, split=data_split(dp, 4))  # type: ignore[arg-type]
    ft.iteration = 1
    sampler = SlotSampler(50, 4, seed=0)
    assert [int(x) for x in next(loader)] == list(indices_of(sampler, 1, 0, 1, 0, slots=3, ranks=2, micro_batches=1))
    with pytest.raises(ValueError, match="1-D"):
        data_split(Mesh(ndim=2, ranks=4, local=0, mesh_dim_names=("dp", "tp")), 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a dimension"):
        data_split(Mesh(ndim=1, ranks=3, local=0), 4)  # type: ignore[arg-type]


class Checkpointed(Model):
    """``Model`` with activation checkpointing in every block (recomputed during backward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        for b in self.blocks:
            x = x + checkpoint(b, x, use_reentrant=False)
        return self.head(x).sum()


def test_activation_checkpointing_still_exchanges_every_bucket_once_at_backwards_end(one_rank_group: None) -> None:
    torch.manual_seed(0)
    model = shard(Checkpointed())
    engine, buckets = exchange_of(model)
    ends: list[int] = []
    buckets.arm(0, at_end=lambda: ends.append(len(engine.calls)))
    model(torch.ones(2, 4)).backward()
    assert ends == [3] and [c["tag"] for c in engine.calls] == [buckets.tag(0, k) for k in range(3)]
