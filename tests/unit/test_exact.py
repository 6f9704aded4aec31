"""The exact cross-replica sum (fthsdp/runtime/exact.py, FTHSDP_DETERMINISTIC=1): micro-batch gradients rounded once
to fixed point and added as integers give the same bits whoever trained which micro-batch, in whatever order and
grouping (the float sum does not), values that do not fit are refused, and the bucket hook folds every micro-batch
and exchanges int64 sums that ``install`` makes the gradients divided by the slots trained."""

from __future__ import annotations

import random

import pytest
import torch

from ftar import ExchangeResult
from fthsdp.runtime import exact
from tests.unit.test_buckets import FakeEngine, Model, exchange

SLOTS, PARTS = 3, 3


def micro_batch_grads(seed: int) -> list[torch.Tensor]:
    """One gradient shard per (slot, part) of a step, float32, over magnitudes 1e-6 .. 1e2."""
    g = torch.Generator().manual_seed(seed)
    scale = 10.0 ** torch.empty(64).uniform_(-6, 2, generator=g)
    return [(torch.randn(64, generator=g) * scale).float() for _ in range(SLOTS * PARTS)]


def exact_step(grads: list[torch.Tensor], deal: list[list[int]]) -> torch.Tensor:
    """The step's gradient when replica r trains the micro-batches ``deal[r]`` in that order: each folds its own
    into one sum; the sums meet in the exchange (in the members' order)."""
    bound = exact.limit(len(grads))
    total = torch.zeros(64, dtype=torch.int64)
    for mine in deal:
        acc = torch.zeros(64, dtype=torch.int64)
        for i in mine:
            acc += exact.fixed(grads[i], bound)
        total += acc
    return exact.to_float(total, SLOTS, torch.float32)


def float_step(grads: list[torch.Tensor], deal: list[list[int]]) -> torch.Tensor:
    """The same in float32, as the default sum does it."""
    total = torch.zeros(64)
    for mine in deal:
        acc = torch.zeros(64)
        for i in mine:
            acc += grads[i]
        total += acc
    return total / SLOTS


def random_deal(rng: random.Random) -> list[list[int]]:
    """Any membership's deal: every micro-batch to one of 1..3 replicas, each replica's in any order."""
    live = rng.randint(1, SLOTS)
    deal: list[list[int]] = [[] for _ in range(live)]
    for i in range(SLOTS * PARTS):
        deal[rng.randrange(live)].append(i)
    for mine in deal:
        rng.shuffle(mine)
    rng.shuffle(deal)
    return deal


def test_the_exact_sum_is_the_same_bits_whoever_trained_which_micro_batch() -> None:
    grads = micro_batch_grads(0)
    failure_free = [[s * PARTS + p for p in range(PARTS)] for s in range(SLOTS)]  # each replica its own slot
    want = exact_step(grads, failure_free)
    rng = random.Random(1)
    deals = [random_deal(rng) for _ in range(200)]
    assert all(torch.equal(exact_step(grads, deal), want) for deal in deals)
    # The float sum of the same micro-batches is not: some membership gives other bits (which is the point).
    floats = float_step(grads, failure_free)
    assert any(not torch.equal(float_step(grads, deal), floats) for deal in deals)
    # And the exact one is the float one's value, to float32's precision.
    torch.testing.assert_close(want, floats, rtol=1e-5, atol=1e-9)


def test_values_the_fixed_point_sum_cannot_hold_are_refused() -> None:
    bound = exact.limit(SLOTS * PARTS)
    assert bound * SLOTS * PARTS * 2.0 ** exact.FRACTION_BITS <= 2.0 ** 62  # every contribution at the bound fits
    exact.fixed(torch.tensor([bound, -bound], dtype=torch.float64), bound)
    for bad in (torch.tensor([bound * 1.01]), torch.tensor([float("nan")]), torch.tensor([float("-inf")])):
        with pytest.raises(exact.ExactRangeError, match="does not fit the exact sum"):
            exact.fixed(bad, bound)
    assert exact.fixed(torch.tensor([2.0 ** -41, 3 * 2.0 ** -41]), bound).tolist() == [0, 2]  # ties to even


def test_the_words_that_ride_a_summed_bucket_are_averaged_in_new_tensors() -> None:
    sums = [torch.tensor([7], dtype=torch.int64), torch.tensor([2.0, 4.0]), torch.tensor([1.0, 1.0, 0.0])]
    r = ExchangeResult(sums, epoch=3, contributors=2, attempts=1, tag=9)
    out = exact.averaged_extras(r, 2)
    assert out.tensors[0] is sums[0]
    assert out.tensors[1].tolist() == [1.0, 2.0] and out.tensors[2].tolist() == [0.5, 0.5, 0.0]
    assert sums[1].tolist() == [2.0, 4.0]  # FTAR's result (kept to serve a partner) unchanged
    assert exact.averaged_extras(r, 0) is r


def test_the_hook_folds_every_micro_batch_and_exchanges_int64_sums_once() -> None:
    torch.manual_seed(0)
    model, engine = Model(), FakeEngine()
    buckets = exchange(model, engine)
    buckets.exact = exact.Accumulators(SLOTS * PARTS)
    xs = [torch.randn(1, 2) for _ in range(3)]
    per_micro = []
    for x in xs:  # each micro-batch's gradients alone, for the expected sum
        model.zero_grad(set_to_none=True)
        model(x).backward()
        per_micro.append({id(p): p.grad.clone() for p in model.parameters() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    buckets.arm(5)
    for k, x in enumerate(xs):
        buckets.last_micro = k == len(xs) - 1
        model(x).backward()
        if not buckets.last_micro:
            assert engine.calls == []  # nothing goes out before the last micro-batch
            assert all(p.grad is None or not p.grad.any() for p in model.parameters())  # folded, zeroed
    handles = buckets.launch_rest(5)
    assert len(engine.calls) == 3 and all(c["op"] == "sum" for c in engine.calls)
    assert all(t.dtype == torch.int64 for c in engine.calls[:-1] for t in c["tensors"])
    results = buckets.collect(handles, _Protocol(), 5.0, lambda *a: None)
    buckets.install(results)
    bound = exact.limit(SLOTS * PARTS)
    for p in model.parameters():
        if p is model.unused:
            assert not p.grad.any()
            continue
        want = sum((exact.fixed(m[id(p)], bound) for m in per_micro), torch.zeros(p.shape, dtype=torch.int64))
        assert torch.equal(p.grad, exact.to_float(want, 1, torch.float32))  # one contributor: one slot trained
    buckets.arm(6)  # the next step's sums begin at zero
    assert all(not buckets.exact.of(p).any() for p in model.parameters())


class _Protocol:
    def lane(self, outcome: object) -> None:
        return None


def test_a_micro_batch_whose_gradient_does_not_fit_is_refused_before_its_bucket_goes_out() -> None:
    torch.manual_seed(0)
    model, engine = Model(), FakeEngine()
    buckets = exchange(model, engine)
    buckets.exact = exact.Accumulators(2 ** 40)  # a bound of 2^-18: every gradient here is beyond it
    buckets.arm(5)
    buckets.last_micro = False
    model(torch.randn(1, 2)).backward()  # folded, not checked yet: nothing goes out before the last micro-batch
    buckets.last_micro = True
    with pytest.raises(exact.ExactRangeError, match="does not fit the exact sum"):
        model(torch.randn(1, 2)).backward()
    assert engine.calls == []
