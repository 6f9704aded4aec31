"""Periodic checkpoints written off the training thread (``fthsdp.runtime.checkpoint_writer``): the state is taken
at the commit boundary (training that goes on meanwhile does not reach the checkpoint), the checkpoint is sealed
and loads like a synchronous one, one is in flight at a time, and a failed write raises on the training thread."""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from fthsdp.runtime import checkpoint
from fthsdp.runtime.checkpoint_writer import CheckpointWriter
from fthsdp.runtime.errors import CheckpointFailed

KEY = "0f" * 32


def _sharded(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int = 1) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        opt.step()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().full_tensor().clone() for p in model.parameters()]  # type: ignore[attr-defined]


def _lines() -> tuple[list[str], Callable[..., None]]:
    lines: list[str] = []

    def log_line(level: int, msg: str, *args: object) -> None:
        lines.append(f"{logging.getLevelName(level)} {msg % args}")

    return lines, log_line


def test_a_checkpoint_written_behind_holds_the_state_of_its_boundary(tmp_path: pathlib.Path,
                                                                      one_rank_group: None) -> None:
    model, opt = _sharded(0)
    _train(model, opt)
    at_boundary = _params(model)
    lines, log_line = _lines()
    writer = CheckpointWriter(str(tmp_path), 0, 0, KEY, asynchronous=True, log_line=log_line)
    writer.periodic(5, model, opt, torch.tensor([5, 5]), b'{"side": 5}')
    _train(model, opt, 3)  # training goes on while it is written
    assert not all(torch.equal(a, b) for a, b in zip(at_boundary, _params(model), strict=True))
    path = writer.wait()
    assert path == tmp_path / "step-00000005-r0"
    ck = checkpoint.latest(tmp_path)
    assert ck is not None and (ck.step, ck.cursors) == (5, (5, 5)) and ck.seal
    fresh, fresh_opt = _sharded(1)
    assert checkpoint.load(ck, fresh, fresh_opt, 0, KEY) == b'{"side": 5}'
    assert all(torch.equal(a, b) for a, b in zip(at_boundary, _params(fresh), strict=True))
    assert any("staged" in x for x in lines) and any("off the step" in x for x in lines)
    writer.close()


def test_one_checkpoint_is_in_flight_at_a_time_and_now_waits_for_it(tmp_path: pathlib.Path,
                                                                     one_rank_group: None) -> None:
    model, opt = _sharded(0)
    _, log_line = _lines()
    writer = CheckpointWriter(str(tmp_path), 2, 0, KEY, asynchronous=True, log_line=log_line)
    writer.periodic(10, model, opt, torch.tensor([1, 1]), b"{}")
    writer.periodic(20, model, opt, torch.tensor([2, 2]), b"{}")  # waits for step 10's first
    assert (tmp_path / "step-00000010-r2" / checkpoint.MARKER).is_file()
    assert writer.now(30, model, opt, torch.tensor([3, 3]), b"{}") == tmp_path / "step-00000030-r2"
    assert (tmp_path / "step-00000020-r2" / checkpoint.MARKER).is_file()
    assert writer.wait() is None
    ck = checkpoint.latest(tmp_path)
    assert ck is not None and ck.step == 30


def test_a_write_that_fails_raises_on_the_training_thread_and_leaves_no_marker(tmp_path: pathlib.Path,
                                                                               one_rank_group: None) -> None:
    model, opt = _sharded(0)
    blocked = tmp_path / "step-00000005-r0"
    blocked.write_text("a file where the checkpoint's folder goes")
    lines, log_line = _lines()
    writer = CheckpointWriter(str(tmp_path), 0, 0, KEY, asynchronous=True, log_line=log_line)
    writer.periodic(5, model, opt, torch.tensor([0]), b"{}")
    with pytest.raises(CheckpointFailed, match="step-00000005-r0 of step 5 was not written") as err:
        writer.wait()
    assert err.value.__cause__ is not None
    assert checkpoint.latest(tmp_path) is None
    writer.periodic(6, model, opt, torch.tensor([0]), b"{}")  # the writer goes on with the next one
    writer.close()
    ck = checkpoint.latest(tmp_path)
    assert ck is not None and ck.step == 6


def test_without_asynchronous_a_periodic_checkpoint_is_written_before_it_returns(tmp_path: pathlib.Path,
                                                                                  one_rank_group: None) -> None:
    model, opt = _sharded(0)
    _, log_line = _lines()
    writer = CheckpointWriter(str(tmp_path), 0, 0, "", asynchronous=False, log_line=log_line)
    assert writer.group is None
    writer.periodic(3, model, opt, torch.tensor([3]), b"{}")
    assert (tmp_path / "step-00000003-r0" / checkpoint.MARKER).is_file() and writer.wait() is None
