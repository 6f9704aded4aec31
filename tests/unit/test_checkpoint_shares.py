"""A periodic checkpoint written in shares (``fthsdp.runtime.checkpoint``, issue 40): the replicas hold the same state,
so each replica that contributed to the step writes a share of it, a ``1/n`` of the parameters by size with their
optimizer state. The shares together load as the whole state, a missing share makes the checkpoint incomplete (the
newest complete one is taken), and every share's seal and digests are checked before anything is read."""

from __future__ import annotations

import json
import pathlib
import random

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.fsdp import fully_shard

from fthsdp.runtime import checkpoint
from fthsdp.runtime.checkpoint_writer import CheckpointWriter
from fthsdp.runtime.errors import CheckpointRejected

KEY = "0f" * 32


def _sharded(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: nn.Module, opt: torch.optim.Optimizer, seed: int, steps: int = 2) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8, generator=g)).square().mean().backward()
        opt.step()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().full_tensor().clone() for p in model.parameters()]  # type: ignore[attr-defined]


def _write(root: pathlib.Path, model: nn.Module, opt: torch.optim.Optimizer, step: int,
           shares: range | list[int], of: int) -> None:
    """Each share ``k`` of ``of`` as replica ``k`` writes it behind the step (each replica holds the same state)."""
    for k in shares:
        writer = CheckpointWriter(str(root), k, 0, KEY, asynchronous=True, log_line=lambda *a: None)
        writer.periodic(step, model, opt, torch.tensor([step] * of), json.dumps({"share": k}).encode(), (k, of))
        assert writer.wait() == root / f"step-{step:08d}-p{k}of{of}"
        writer.close()


def test_split_puts_every_name_in_exactly_one_share_evenly_and_the_same_whatever_the_order() -> None:
    sizes = {f"p{i}": random.Random(i).randint(1, 1000) for i in range(40)}
    shares = checkpoint.split(sizes, 3)
    assert len(shares) == 3 and set().union(*shares) == set(sizes) and sum(map(len, shares)) == len(sizes)
    loads = [sum(sizes[n] for n in s) for s in shares]
    assert max(loads) - min(loads) <= max(sizes.values())  # a greedy fill: within the largest item
    shuffled = dict(random.Random(7).sample(sorted(sizes.items()), len(sizes)))
    assert checkpoint.split(shuffled, 3) == shares  # every rank of every replica splits alike
    assert checkpoint.split(sizes, 1) == [frozenset(sizes)]
    assert checkpoint.split({"a": 1}, 2) == [frozenset({"a"}), frozenset()]
    with pytest.raises(ValueError, match="at least 1 share"):
        checkpoint.split(sizes, 0)


def test_share_paths_and_a_whole_checkpoints_path() -> None:
    assert checkpoint.path_of("/c", 40, 2) == pathlib.Path("/c/step-00000040-r2")
    assert checkpoint.path_of("/c", 40, 2, (1, 3)) == pathlib.Path("/c/step-00000040-p1of3")
    with pytest.raises(ValueError, match="share 3 of 3"):
        checkpoint.path_of("/c", 40, 2, (3, 3))


def test_three_shares_load_as_the_whole_state(tmp_path: pathlib.Path, one_rank_group: None) -> None:
    model, opt = _sharded(0)
    _train(model, opt, seed=1)
    _write(tmp_path, model, opt, 10, range(3), 3)
    # Each share holds its own parameters and their optimizer state, none twice; the first the param groups too.
    keys = [set(FileSystemReader(str(tmp_path / f"step-00000010-p{k}of3")).read_metadata().state_dict_metadata)
            for k in range(3)]
    assert all(keys) and not (keys[0] & keys[1] or keys[0] & keys[2] or keys[1] & keys[2]), keys
    params = {k for s in keys for k in s if k.startswith("model.")}
    assert params == {f"model.{n}" for n, _ in model.named_parameters()}
    assert any(k.startswith("optim.param_groups") for k in keys[0])
    assert not any(k.startswith("optim.param_groups") for k in keys[1] | keys[2])

    ck = checkpoint.latest(tmp_path)
    assert ck is not None and (ck.step, ck.cursors, len(ck.rest)) == (10, (10, 10, 10), 2)
    fresh, fresh_opt = _sharded(5)
    assert checkpoint.load(ck, fresh, fresh_opt, 0, KEY) == b'{"share": 0}'  # the trainer state: share 0's
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(fresh), strict=True))
    # The optimizer's state came back too: the next steps are bitwise the same.
    _train(model, opt, seed=2)
    _train(fresh, fresh_opt, seed=2)
    assert all(torch.equal(a, b) for a, b in zip(_params(model), _params(fresh), strict=True))


def test_a_missing_share_leaves_the_newest_complete_checkpoint(tmp_path: pathlib.Path,
                                                               one_rank_group: None) -> None:
    model, opt = _sharded(0)
    _write(tmp_path, model, opt, 10, range(2), 2)
    _write(tmp_path, model, opt, 20, [0, 2], 3)  # share 1's writer died
    ck = checkpoint.latest(tmp_path)
    assert ck is not None and ck.step == 10 and len(ck.rest) == 1
    _write(tmp_path, model, opt, 30, [1], 2)  # and share 0's
    ck = checkpoint.latest(tmp_path)
    assert ck is not None and ck.step == 10


def test_a_changed_share_is_refused_before_anything_is_read(tmp_path: pathlib.Path, one_rank_group: None) -> None:
    model, opt = _sharded(0)
    _train(model, opt, seed=1)
    _write(tmp_path, model, opt, 10, range(3), 3)
    data = next(p for p in (tmp_path / "step-00000010-p2of3").iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    fresh, fresh_opt = _sharded(5)
    before = _params(fresh)
    ck = checkpoint.latest(tmp_path)
    assert ck is not None
    with pytest.raises(CheckpointRejected, match="p2of3"):
        checkpoint.load(ck, fresh, fresh_opt, 0, KEY)
    assert all(torch.equal(a, b) for a, b in zip(before, _params(fresh), strict=True))
