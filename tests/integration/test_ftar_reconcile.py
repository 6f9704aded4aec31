"""FTAR's step reconciliation on real Gloo groups (lane engines in one process, epochs set by the test): a member
behind is served what a holder acted on, bitwise, in the epoch it was computed in; without a holder it is told it
is behind (``Misaligned``)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
import torch
from torch.distributed import TCPStore

from ftar import ExchangeResult, FTARConfig, LaneEngine, Misaligned, NoEpoch
from lighthouse.epoch_view import EpochView
from lighthouse.model import ACTIVE, JOINING, EpochMember
from lighthouse.model import Endpoints as Endpoints

pytestmark = pytest.mark.timeout(120)
WAIT_S = 60.0


class Epochs:
    """The epochs of a test, set by hand; every engine's membership reads them."""

    def __init__(self, rendezvous: str) -> None:
        self.rendezvous = rendezvous
        self.epoch: EpochView | None = None
        self.cond = threading.Condition()
        self.listeners: list[Callable[[EpochView], None]] = []

    def set(self, number: int, members: dict[str, str]) -> None:
        epoch = EpochView("job", number, tuple(EpochMember(rid, f"{rid}-inc", role, 1, Endpoints())
                                               for rid, role in members.items()),
                          f"{self.rendezvous}/job/epoch{number}", 0.0, "test")
        with self.cond:
            self.epoch = epoch
            self.cond.notify_all()
            listeners = list(self.listeners)
        for fn in listeners:
            fn(epoch)


class Member:
    """``ftar.Membership`` of one replica over ``Epochs``."""

    def __init__(self, epochs: Epochs, replica_id: str) -> None:
        self.epochs = epochs
        self.replica_id = replica_id

    def current(self) -> EpochView | None:
        return self.epochs.epoch

    def wait_epoch(self, after: int, timeout: float) -> EpochView | None:
        with self.epochs.cond:
            self.epochs.cond.wait_for(lambda: self.epochs.epoch is not None and self.epochs.epoch.number > after,
                                      timeout)
            e = self.epochs.epoch
        return e if e is not None and e.number > after else None

    def report(self, suspect: str, epoch: int, reason: str, *, early: bool = False) -> None:
        pass

    def add_listener(self, fn: Callable[[EpochView], None]) -> Callable[[], None]:
        self.epochs.listeners.append(fn)
        return lambda: None


@pytest.fixture
def epochs() -> Iterator[Epochs]:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield Epochs(f"127.0.0.1:{store.port}")


def engines(epochs: Epochs, ids: list[str], **cfg: object) -> dict[str, LaneEngine]:
    config = FTARConfig(timeout_s=10.0, connect_timeout_s=20.0, epoch_wait_s=2.0, **cfg)  # type: ignore[arg-type]
    return {rid: LaneEngine(Member(epochs, rid), 0, config) for rid in ids}


def grads(seed: int) -> list[torch.Tensor]:
    """Floats whose average is rounded (so a different reduction would show) and an int64 tensor."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1000, generator=g), torch.randn(7, 3, generator=g), torch.arange(5) * seed]


def step_zero(eng: dict[str, LaneEngine]) -> dict[str, list[ExchangeResult]]:
    """Every engine exchanges tags 0 and 1 (two buckets of one step)."""
    handles = {rid: [e.allreduce(grads(10 * i + k), tag=k) for k in (0, 1)] for i, (rid, e) in enumerate(eng.items())}
    return {rid: [h.wait(WAIT_S) for h in hs] for rid, hs in handles.items()}


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y)
                                    for x, y in zip(a, b, strict=True))


def test_a_member_behind_is_served_what_the_holder_committed(epochs: Epochs) -> None:
    eng = engines(epochs, ["a", "b", "c", "j"], hold=True)
    try:
        epochs.set(1, {"a": ACTIVE, "b": ACTIVE, "c": ACTIVE})
        first = step_zero({rid: eng[rid] for rid in "abc"})
        assert all(r.epoch == 1 and r.contributors == 3 for rs in first.values() for r in rs)
        # c died; b lost the step (it redoes it from other gradients), a committed it and asks for tag 2; j joins.
        epochs.set(2, {"a": ACTIVE, "b": ACTIVE, "j": JOINING})
        ahead = eng["a"].allreduce(grads(100), tag=2)
        joiner = eng["j"].allreduce(grads(0), tag=None, contribute=False)
        behind = [eng["b"].allreduce(grads(200 + k), tag=k) for k in (0, 1)]
        served = [h.wait(WAIT_S) for h in behind]
        for k, r in enumerate(served):  # a's results of epoch 1, bitwise, labelled with that epoch
            assert (r.tag, r.epoch, r.contributors) == (k, 1, 3)
            assert same(r.tensors, first["a"][k].tensors)
        nxt = eng["b"].allreduce(grads(300), tag=2)
        results = {"a": ahead.wait(WAIT_S), "b": nxt.wait(WAIT_S), "j": joiner.wait(WAIT_S)}
        assert {(r.tag, r.epoch, r.contributors) for r in results.values()} == {(2, 2, 2)}
        assert same(results["a"].tensors, results["b"].tensors) and same(results["a"].tensors, results["j"].tensors)
        expected = (grads(100)[0] + grads(300)[0]) / 2
        assert torch.equal(results["a"].tensors[0], expected)
    finally:
        for e in eng.values():
            e.close()


def test_without_a_holder_the_member_behind_is_told_it_is_behind(epochs: Epochs) -> None:
    eng = engines(epochs, ["a", "b"])  # hold=False: nobody keeps what it acted on
    try:
        epochs.set(1, {"a": ACTIVE, "b": ACTIVE})
        step_zero(eng)
        epochs.set(2, {"a": ACTIVE, "b": ACTIVE})
        ahead = eng["a"].allreduce(grads(1), tag=2)
        with pytest.raises(Misaligned) as info:
            eng["b"].allreduce(grads(2), tag=0).wait(WAIT_S)
        assert (info.value.tag, info.value.lowest, info.value.highest) == (0, 0, 2)
        with pytest.raises(NoEpoch):  # the one ahead waits for an epoch without the one behind; none comes
            ahead.wait(WAIT_S)
    finally:
        for e in eng.values():
            e.close()


def test_forgotten_results_are_not_served(epochs: Epochs) -> None:
    eng = engines(epochs, ["a", "b"], hold=True)
    try:
        epochs.set(1, {"a": ACTIVE, "b": ACTIVE})
        step_zero(eng)
        eng["a"].forget_before(1)  # a keeps tag 1 only: it cannot serve b from tag 0
        epochs.set(2, {"a": ACTIVE, "b": ACTIVE})
        ahead = eng["a"].allreduce(grads(1), tag=2)
        with pytest.raises(Misaligned):
            eng["b"].allreduce(grads(2), tag=0).wait(WAIT_S)
        with pytest.raises(NoEpoch):
            ahead.wait(WAIT_S)
    finally:
        for e in eng.values():
            e.close()


def test_a_member_served_then_sent_back_by_its_vote_is_served_again_in_that_group(epochs: Epochs) -> None:
    """Seen in a chaos run: lane 0 of replica b was served step S; its other lane lost S, so b's vote failed and
    every lane redid S. Lane 0 still held the group it was served in, and the served results had been used up:
    it ran S's collective against the holder's S+1 ("out of step"), round after round, until a replica was
    evicted and b committed S alone. The served results last as long as their group."""
    eng = engines(epochs, ["a", "b", "c"], hold=True)
    try:
        epochs.set(1, {"a": ACTIVE, "b": ACTIVE, "c": ACTIVE})
        first = step_zero(eng)
        epochs.set(2, {"a": ACTIVE, "b": ACTIVE})
        ahead = eng["a"].allreduce(grads(100), tag=2)
        served = [eng["b"].allreduce(grads(200 + k), tag=k).wait(WAIT_S) for k in (0, 1)]
        again = [eng["b"].allreduce(grads(400 + k), tag=k).wait(WAIT_S) for k in (0, 1)]  # the vote's redo
        for k in (0, 1):
            for r in (served[k], again[k]):
                assert (r.tag, r.epoch, r.contributors) == (k, 1, 3) and same(r.tensors, first["a"][k].tensors)
        nxt = eng["b"].allreduce(grads(300), tag=2)
        a, b = ahead.wait(WAIT_S), nxt.wait(WAIT_S)
        assert (a.tag, a.epoch, b.tag, b.epoch) == (2, 2, 2, 2) and same(a.tensors, b.tensors)
    finally:
        for e in eng.values():
            e.close()
