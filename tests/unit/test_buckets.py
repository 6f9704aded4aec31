"""Gradient buckets (fthsdp/runtime/buckets.py): the tag encodes (step, bucket) and decodes back, the plan orders
the buckets as backward produces them, and the hook hands complete buckets to FTAR in order. A recording
stand-in for the lane engine: no processes, no FSDP."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch import nn

from ftar import ExchangeResult, Handle, Interrupted
from fthsdp.runtime.buckets import BucketExchange, BucketTag, plan_buckets, slot_mask
from fthsdp.runtime.digest import WORDS, pack
from fthsdp.runtime.replica import grads_untouched

CPU = torch.device("cpu")


# --- the tag ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("buckets", [1, 3, 7])
def test_tag_round_trips_and_grows_in_exchange_order(buckets: int) -> None:
    tags = [BucketTag(step, k).encode(buckets) for step in range(5) for k in range(buckets)]
    assert tags == list(range(5 * buckets))  # step-major, bucket-minor: the order buckets go out
    assert [BucketTag.decode(t, buckets) for t in tags] == [BucketTag(s, k) for s in range(5) for k in range(buckets)]


def test_tag_refuses_a_bucket_outside_the_plan() -> None:
    with pytest.raises(ValueError):
        BucketTag(3, 4).encode(4)


def test_tag_prints_as_step_and_bucket() -> None:
    assert str(BucketTag.decode(23, 4)) == "step 5 bucket 3"


# --- the plan --------------------------------------------------------------------------------------------------


def test_plan_is_the_blocks_last_to_first_then_the_root() -> None:
    params = ["emb", "b0.w", "b0.b", "b1.w", "head"]
    blocks = [["b0.w", "b0.b"], ["b1.w"]]
    assert plan_buckets(params, blocks) == [["b1.w"], ["b0.w", "b0.b"], ["emb", "head"]]


def test_plan_drops_empty_buckets() -> None:
    assert plan_buckets(["a", "b"], [["a", "b"], []]) == [["a", "b"]]
    assert plan_buckets(["a"], []) == [["a"]]


def test_slot_mask_marks_this_slot_when_contributing() -> None:
    assert slot_mask(2, 4, True, CPU).tolist() == [0.0, 0.0, 1.0, 0.0]
    assert slot_mask(2, 4, False, CPU).tolist() == [0.0] * 4


def test_slot_mask_with_orphans_carried_marks_every_part_trained_after_the_holders() -> None:
    """3 slots of 2 parts: slot 2's holder trained its own parts (4, 5) and slot 1's second (3)."""
    assert slot_mask(2, 3, True, CPU, parts=2, dealt=(3, 4, 5)).tolist() == [0, 0, 1, 0, 0, 0, 1, 1, 1]
    assert slot_mask(2, 3, False, CPU, parts=2, dealt=(3, 4, 5)).tolist() == [0.0] * 9  # a zero contributor's


# --- launching -------------------------------------------------------------------------------------------------


@dataclass
class FakeEngine:
    """Records every allreduce; answers at once (the average of one contributor: the inputs) in ``epoch``, under
    the tag of ``learn`` for a caller that passes none."""

    epoch: int = 3
    learn: int = 11
    fail_first: bool = False
    width: int = 4
    """The tag width of the exchange under test (``BucketExchange.width``: its buckets + 1)."""
    index: int = 1
    """The tag index a learning caller is answered with: 1, bucket 0; 0, the post exchange of the step before."""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def allreduce(self, tensors: Sequence[torch.Tensor], **kw: Any) -> Handle:
        self.calls.append({"tensors": [t.clone() for t in tensors], **kw})
        future: Future[ExchangeResult] = Future()
        if self.fail_first and len(self.calls) == 1:
            future.set_exception(Interrupted("peer died", self.epoch))
        else:
            tag = kw["tag"] if kw["tag"] is not None else self.learn * self.width + self.index
            future.set_result(ExchangeResult([t.clone() for t in tensors], self.epoch, 1, 1, tag))
        return Handle(future)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(2, 2)
        self.blocks = nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)])
        self.unused = nn.Parameter(torch.ones(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.emb(x)
        for b in self.blocks:
            x = b(x)
        return x.sum()


def exchange(model: Model, engine: FakeEngine) -> BucketExchange:
    return BucketExchange(list(model.parameters()), [list(b.parameters()) for b in model.blocks],
                          engine, slot=lambda: 1, slots=3, device=CPU, wait_s=5.0)  # type: ignore[arg-type]


def test_backward_hands_buckets_to_ftar_in_order_tagged_with_the_step() -> None:
    torch.manual_seed(0)
    model, engine = Model(), FakeEngine()
    buckets = exchange(model, engine)
    assert len(buckets) == 3  # block 1, block 0, root (emb + the unused parameter)
    with buckets.armed(step=4):
        model(torch.ones(1, 2)).backward()
    # The two blocks were complete during backward; the root waits for its unused parameter.
    assert [c["tag"] for c in engine.calls] == [buckets.tag(4, 0), buckets.tag(4, 1)]
    assert buckets.width == 4 and buckets.tag(4, 0) == 17  # index 0 of a step: the post exchange of the step before
    assert [c["new_epoch_ok"] for c in engine.calls] == [True, False]
    assert all(c["contribute"] and c["redo"] is False for c in engine.calls)
    handles = buckets.launch_rest(4)
    assert len(engine.calls) == 3 and all(h is not None for h in handles)
    last = engine.calls[-1]["tensors"]
    assert torch.equal(last[-1], torch.tensor([0.0, 1.0, 0.0]))  # the slot mask rides last
    unused = [i for i, p in enumerate(buckets.buckets[-1]) if p is model.unused]
    assert len(unused) == 1 and torch.equal(last[unused[0]], torch.zeros(2))  # no gradient: zeros
    results = [h.wait() for h in handles if h is not None]
    assert [buckets.step_of(r) for r in results] == [4, 4, 4]
    assert buckets.mask_of(results) == [0.0, 1.0, 0.0]


def test_gradients_reduced_outside_a_backward_settle_once_the_last_bucket_is_out() -> None:
    """A pipeline schedule reduces each stage's gradients after its last backward, outside any backward pass
    (torch.distributed.pipelining's reduce step calls FSDP2's post-backward, which runs the hooks): no autograd
    final callback can be queued, so the step's end runs as its last bucket goes out, and only then."""
    model, engine = Model(), FakeEngine()
    buckets = exchange(model, engine)
    ended: list[int] = []
    buckets.arm(4, at_end=lambda: ended.append(len(engine.calls)))
    params = [p for bucket in buckets.buckets for p in bucket]  # in bucket order, as FSDP2 reduces them
    for i, p in enumerate(params):
        p.grad = torch.ones_like(p)
        for hook in p._post_accumulate_grad_hooks.values():  # as FSDP2's foreach_reduce runs them
            hook(p)
        assert ended == ([] if i < len(params) - 1 else [3]), (i, ended)
    assert [c["tag"] for c in engine.calls] == [buckets.tag(4, k) for k in range(3)]


def test_the_hook_does_nothing_unless_armed() -> None:
    model, engine = Model(), FakeEngine()
    exchange(model, engine)
    model(torch.ones(1, 2)).backward()
    assert engine.calls == []


def test_install_puts_the_averaged_gradients_into_grad() -> None:
    model, engine = Model(), FakeEngine()
    buckets = exchange(model, engine)
    handles, _ = buckets.exchange_all(2, contribute=True)
    results = [h.wait() for h in handles if h is not None]
    for r in results:
        for t in r.tensors:
            t.fill_(0.5)
    buckets.install(results)
    assert all(torch.equal(p.grad, torch.full_like(p, 0.5)) for p in model.parameters() if p.grad is not None)
    assert all(p.grad is not None for p in model.parameters())


def test_a_joiner_learns_the_step_from_its_first_bucket() -> None:
    model, engine = Model(), FakeEngine(learn=11)
    buckets = exchange(model, engine)
    handles, learned = buckets.exchange_all(None, contribute=False)
    assert learned == 11
    assert [c["tag"] for c in engine.calls] == [None, buckets.tag(11, 1), buckets.tag(11, 2)]
    assert not any(c["contribute"] for c in engine.calls)
    assert torch.equal(engine.calls[-1]["tensors"][-1], torch.zeros(3))  # a zero contributor's mask is empty
    assert all(h is not None for h in handles)


def test_a_joiner_that_cannot_learn_the_step_launches_nothing_more() -> None:
    model, engine = Model(), FakeEngine(fail_first=True)
    buckets = exchange(model, engine)
    told: list[int] = []
    handles, learned = buckets.exchange_all(None, contribute=False, learned_at=told.append)
    assert learned is None and len(engine.calls) == 1
    assert handles[0] is not None and handles[1:] == [None, None]
    assert told == []  # no step learned: a joiner's fetch starts after the step settles instead


def test_a_joiner_is_told_the_step_while_the_rest_of_its_zeros_are_held_back() -> None:
    """The others cannot commit the step before these buckets go out, so a fetch of its state registered in
    ``learned_at`` is served (``Joiner.fetch_from``)."""
    model, engine = Model(), FakeEngine(learn=11)
    buckets = exchange(model, engine)
    told: list[tuple[int, int]] = []
    _, learned = buckets.exchange_all(None, contribute=False, learned_at=lambda s: told.append((s, len(engine.calls))))
    assert learned == 11 and told == [(11, 1)]  # only the bucket that named the step was out
    assert len(engine.calls) == 3
    # In the trainer's loop the step is named by the post exchange of the step before: every bucket is held back.
    engine2 = FakeEngine(learn=11, index=0)
    looped = exchange(Model(), engine2)
    looped.posts, told = True, []
    _, learned = looped.exchange_all(None, contribute=False, learned_at=lambda s: told.append((s, len(engine2.calls))))
    assert learned == 11 and told == [(11, 1)] and len(engine2.calls) == 1 + len(looped)


def test_a_joiner_whose_only_bucket_named_the_step_is_not_told() -> None:
    """Every zero of the step is out once it is learned: the others may commit it before a fetch registers."""
    model, engine = Model(), FakeEngine(learn=11, width=2)
    one = BucketExchange(list(model.parameters()), [], engine, slot=lambda: 1, slots=3,  # type: ignore[arg-type]
                         device=CPU, wait_s=5.0)
    assert len(one) == 1
    told: list[int] = []
    _, learned = one.exchange_all(None, contribute=False, learned_at=told.append)
    assert learned == 11 and told == []
    learned_step = one.exchange_all(5, contribute=False, learned_at=told.append)[1]
    assert learned_step is None and told == []  # a step known already is not learned again


def test_the_step_digest_rides_the_last_bucket_in_this_slot_and_again_on_a_redo() -> None:
    model, engine = Model(), FakeEngine()
    buckets = exchange(model, engine)
    buckets.digest = bytes(range(8))
    with buckets.armed(step=4):
        model(torch.ones(1, 2)).backward()
    results = [h.wait() for h in buckets.launch_rest(4) if h is not None]
    assert torch.equal(engine.calls[-1]["tensors"][-2], torch.tensor(pack(1, 3, bytes(range(8)))))
    assert buckets.digests_of(results) == {1: 0x0001020304050607}
    handles, _ = buckets.exchange_all(4, contribute=True)  # a redo sends the same digest
    assert buckets.digests_of([h.wait() for h in handles if h is not None]) == {1: 0x0001020304050607}
    handles, _ = buckets.exchange_all(4, contribute=False)  # a zero contributor sends none
    assert torch.equal(engine.calls[-1]["tensors"][-2], torch.zeros(3 * WORDS))


def test_each_bucket_goes_out_with_an_event_of_the_stream_that_produced_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from ftar import devices

    events = iter(range(100))
    monkeypatch.setattr(devices, "record", lambda device: f"event{next(events)}")
    model, engine = Model(), FakeEngine()
    buckets = exchange(model, engine)
    with buckets.armed(step=1):
        model(torch.ones(1, 2)).backward()  # the hook records on the stream it runs on (FSDP2's reduce-scatter)
    buckets.launch_rest(1)
    assert [c["ready"] for c in engine.calls] == ["event0", "event1", "event2"]


def test_results_become_the_gradients_without_a_copy_only_with_an_optimizer_that_keeps_them() -> None:
    params = [nn.Parameter(torch.ones(2))]
    assert grads_untouched(torch.optim.AdamW(params)) and grads_untouched(torch.optim.SGD(params, lr=0.1))
    assert not grads_untouched(torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True))
    assert not grads_untouched(torch.optim.RMSprop(params))  # not known: copied
    model, engine = Model(), FakeEngine()
    buckets = exchange(model, engine)
    handles, _ = buckets.exchange_all(2, contribute=True)
    results = [h.wait() for h in handles if h is not None]
    buckets.alias = True
    buckets.install(results)
    by_param = dict(zip((id(p) for b in buckets.buckets for p in b),
                        (t for b, r in zip(buckets.buckets, results, strict=True) for t in r.tensors[:len(b)]),
                        strict=True))
    assert all(p.grad is not None and p.grad.data_ptr() == by_param[id(p)].data_ptr() for p in model.parameters())
    model.zero_grad(set_to_none=True)  # the next step
    buckets.alias = False
    buckets.install(results)
    assert all(p.grad is not None and p.grad.data_ptr() != by_param[id(p)].data_ptr() for p in model.parameters())


def test_fsdp2_gradients_are_bound_and_step_like_copied_ones(one_rank_group: Any) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fthsdp.runtime.state import local_tensor

    mesh = init_device_mesh("cpu", (1,))
    updated = []
    for alias in (True, False):
        torch.manual_seed(0)
        model = Model()
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        engine = FakeEngine()
        buckets = BucketExchange(list(model.parameters()), [list(b.parameters()) for b in model.blocks], engine,
                                 slot=lambda: 1, slots=3, device=CPU, wait_s=5.0)  # type: ignore[arg-type]
        buckets.alias = alias
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        with buckets.armed(step=0):
            model(torch.ones(1, 2)).backward()
        results = [h.wait() for h in buckets.launch_rest(0) if h is not None]
        for r in results:
            for t in r.tensors:
                t.mul_(0.5)  # "averaged"
        buckets.install(results)
        grads = [t for b, r in zip(buckets.buckets, results, strict=True) for t in r.tensors[:len(b)]]
        params = [p for b in buckets.buckets for p in b]
        shared = [local_tensor(p.grad).data_ptr() == g.data_ptr() for p, g in zip(params, grads, strict=True)]
        assert all(shared) if alias else not any(shared)
        assert all(torch.equal(local_tensor(p.grad), g) for p, g in zip(params, grads, strict=True))
        opt.step()
        updated.append([local_tensor(p.detach()).clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*updated, strict=True))


def test_the_engines_logs_name_the_step_and_bucket_not_the_wire_tag() -> None:
    model, engine = Model(), FakeEngine()
    buckets = exchange(model, engine)
    assert len(buckets) == 3
    assert engine.tag_label(37) == "step=9 bucket=0"
    assert engine.tag_label(buckets.tag(4, 2)) == "step=4 bucket=2"
    assert engine.tag_label(buckets.post_tag(4)) == "step=4 post"
