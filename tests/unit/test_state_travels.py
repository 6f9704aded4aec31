"""The trainer state that travels with the tensors (fthsdp/runtime/trainer_state.py, fthsdp/runtime/state.py): the
JSON encoding round-trips what schedulers and param groups hold (tuples, int keys, tensors), refuses what it
cannot carry at registration, and a snapshot loaded into a fresh replica (optimizer, scheduler, RNG) hashes like
its source's and steps on identically. No processes."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from fthsdp.runtime.errors import StateMismatch
from fthsdp.runtime.state import DIGEST, ShardState, digest_of
from fthsdp.runtime.trainer_state import TrainerState, UnencodableState, decode, encode

CPU = torch.device("cpu")


@pytest.mark.parametrize("value", [
    {"lr": 0.1, "betas": (0.9, 0.999), "eps": 1e-8, "foreach": None, "flag": True},
    {"state": {0: {"step": 3}, 1: [1, 2]}, "tags": ["a", "b"]},
    {"t": torch.arange(6, dtype=torch.float32).reshape(2, 3), "empty": torch.empty(0, dtype=torch.int64)},
    {"b": b"\x00\xff", "nested": [(1, (2, 3)), {"__fthsdp__": "not a tag"}], "big": 2 ** 70, "neg0": -0.0},
    {"inf": math.inf, "tiny": 5e-324},
])
def test_encoding_round_trips_types_json_lacks(value: dict[str, Any]) -> None:
    back = decode(encode(value))
    assert encode(back) == encode(value)
    assert type(back) is dict and set(back) == set(value)
    for k, v in value.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(back[k], v) and back[k].dtype == v.dtype
        else:
            assert back[k] == v and type(back[k]) is type(v)


def test_encoding_is_canonical() -> None:
    assert encode({"b": 1, "a": (2.5,)}) == encode({"a": (2.5,), "b": 1})
    assert encode({"a": 0.1}) != encode({"a": 0.1 + 1e-17 * 10})


def test_unencodable_state_is_refused_at_registration_naming_where() -> None:
    class Bad:
        def state_dict(self) -> dict[str, Any]:
            return {"fn": {"inner": [object()]}}

        def load_state_dict(self, sd: dict[str, Any]) -> None: ...

    state = TrainerState()
    with pytest.raises(UnencodableState, match=r"bad\.state_dict\(\)\['fn'\]\['inner'\]\[0\] is a object"):
        state.register("bad", Bad())
    assert state.objects == {}
    with pytest.raises(TypeError, match="no state_dict"):
        state.register("x", object())  # type: ignore[arg-type]
    state.register("ok", torch.optim.lr_scheduler.StepLR(torch.optim.SGD([nn.Parameter(torch.ones(1))]), 2))
    with pytest.raises(ValueError, match="registered"):
        state.register("ok", torch.optim.lr_scheduler.StepLR(torch.optim.SGD([nn.Parameter(torch.ones(1))]), 2))


def _replica(seed: int, scheduler: str) -> tuple[nn.Linear, ShardState, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.99))
    sched: torch.optim.lr_scheduler.LRScheduler
    if scheduler == "cosine":
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=7)
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    state = TrainerState()
    state.register("scheduler", sched, on_commit=sched.step)
    torch.manual_seed(seed)
    return model, ShardState(list(model.parameters()), opt, CPU, state), sched


def _train(model: nn.Linear, shards: ShardState, steps: int, factor: float = 1.0) -> None:
    for i in range(steps):
        shards.opt.zero_grad()
        g = torch.Generator().manual_seed(i)
        model(torch.randn(4, 3, generator=g)).pow(2).sum().backward()
        shards.optimizer_step(factor)


@pytest.mark.parametrize("scheduler", ["cosine", "lambda"])
def test_a_loaded_snapshot_hashes_like_its_source_and_trains_on_identically(scheduler: str) -> None:
    cursors = torch.tensor([5, 4], dtype=torch.int64)
    model, source, sched = _replica(1, scheduler)
    _train(model, source, 3, factor=0.5)
    assert source.opt.param_groups[0]["lr"] != 0.1  # the scheduler moved it; the degraded factor was restored
    snap = dict(source.seal(source.snapshot(source.boundary(cursors))))
    j_model, joiner, j_sched = _replica(2, scheduler)  # fresh: no optimizer state, other RNG, lr at its start
    assert joiner.digest(cursors, rng=True) != snap[DIGEST].numpy().tobytes()
    loaded = joiner.load(snap, torch.zeros(2, dtype=torch.int64))
    assert torch.equal(loaded, cursors)
    assert joiner.digest(loaded, rng=True) == snap[DIGEST].numpy().tobytes()
    assert j_sched.state_dict() == sched.state_dict()
    assert joiner.opt.param_groups[0]["betas"] == (0.8, 0.99)  # a tuple again, not a list
    assert torch.equal(torch.get_rng_state(), snap["rng/cpu"])
    _train(model, source, 4)
    _train(j_model, joiner, 4)
    assert joiner.digest(cursors) == source.digest(cursors)
    assert j_sched.get_last_lr() == sched.get_last_lr()


def test_the_digest_covers_param_groups_and_registered_state_but_not_the_rng() -> None:
    cursors = torch.zeros(2, dtype=torch.int64)
    _, shards, sched = _replica(1, "cosine")
    before = shards.digest(cursors)
    torch.rand(3)
    assert shards.digest(cursors) == before  # RNG is left out of the cross-replica digest ...
    assert shards.digest(cursors, rng=True) != digest_of([])  # ... and in the snapshot's
    shards.opt.param_groups[0]["weight_decay"] = 0.5
    assert shards.digest(cursors) != before
    shards.opt.param_groups[0]["weight_decay"] = 0.01
    assert shards.digest(cursors) == before
    shards.opt.step()  # no gradients: parameters unchanged (and the scheduler does not warn)
    assert shards.digest(cursors) == before
    sched.step()
    assert shards.digest(cursors) != before
    assert shards.digest(cursors + 1) != shards.digest(cursors)


def test_side_state_round_trips_through_a_checkpoint_file() -> None:
    _, source, sched = _replica(1, "cosine")
    source.opt.step()  # no gradients: a no-op but for the scheduler's order check
    for _ in range(3):
        sched.step()
    rng = torch.get_rng_state()
    data = source.side_state()
    _, fresh, f_sched = _replica(7, "cosine")
    fresh.load_side_state(data)
    assert f_sched.state_dict() == sched.state_dict()
    assert fresh.opt.param_groups[0]["lr"] == source.opt.param_groups[0]["lr"]
    assert torch.equal(torch.get_rng_state(), rng)


def test_a_source_with_other_registered_objects_is_refused_unchanged() -> None:
    cursors = torch.zeros(2, dtype=torch.int64)
    _, source, _ = _replica(1, "cosine")
    snap = dict(source.seal(source.snapshot(source.boundary(cursors))))
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    joiner = ShardState(list(model.parameters()), torch.optim.AdamW(model.parameters(), lr=0.1), CPU,
                        TrainerState())
    torch.manual_seed(3)
    model.weight.data.normal_()
    before = joiner.digest(cursors, rng=True)
    with pytest.raises(StateMismatch, match="registered state"):
        joiner.load(snap, cursors)
    with pytest.raises(StateMismatch, match="trainer state"):
        joiner.load({k: v for k, v in snap.items() if k != "state/json"}, cursors)
    assert joiner.digest(cursors, rng=True) == before
