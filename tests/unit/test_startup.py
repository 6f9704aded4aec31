"""Where a replica's state comes from when it starts (``fthsdp.runtime.startup.start_from``): the role the
lighthouse gave it and the checkpoints on disk. A job completes once: a replica back after the end takes the
final checkpoint or trains nothing."""

from __future__ import annotations

import json
import pathlib
import threading

import pytest
import torch

from fthsdp.runtime.config import ConfigError
from fthsdp.runtime.errors import JobFinished, NoStateToResume
from fthsdp.runtime.startup import Role, hold_as_standby, register, start_from
from lighthouse.errors import AtCapacity, InvalidRequest


def checkpoint(root: pathlib.Path, step: int, slot: int = 0) -> pathlib.Path:
    d = root / f"step-{step:08d}-r{slot}"
    d.mkdir(parents=True)
    (d / "fthsdp.json").write_text(json.dumps({"step": step, "cursors": [step, step], "slot": slot}))
    return d


def test_a_replica_back_after_the_job_finished_takes_the_final_checkpoint(tmp_path: pathlib.Path) -> None:
    checkpoint(tmp_path, 20)
    final = checkpoint(tmp_path, 30, slot=1)
    ck = start_from(Role.FINISHED, 30, "job", str(tmp_path))
    assert ck is not None and ck.path == final and ck.step == 30


@pytest.mark.parametrize("steps", [(), (20,)])
def test_without_the_final_checkpoint_it_trains_nothing(tmp_path: pathlib.Path, steps: tuple[int, ...]) -> None:
    for s in steps:
        checkpoint(tmp_path, s)  # an older checkpoint is no final state: resuming from it would fork the model
    with pytest.raises(JobFinished, match="finished at step 30") as info:
        start_from(Role.FINISHED, 30, "job", str(tmp_path))
    assert info.value.step == 30
    with pytest.raises(JobFinished):
        start_from(Role.FINISHED, 30, "job", "")  # no checkpoint directory at all


def test_resume_needs_a_checkpoint_and_a_joiner_never_reads_one(tmp_path: pathlib.Path) -> None:
    with pytest.raises(NoStateToResume):
        start_from(Role.RESUME, 0, "job", str(tmp_path))
    checkpoint(tmp_path, 20)
    ck = start_from(Role.RESUME, 0, "job", str(tmp_path))
    assert ck is not None and ck.step == 20
    assert start_from(Role.JOINING, 0, "job", str(tmp_path)) is None
    assert start_from(Role.ACTIVE, 0, "job", "") is None  # a fresh start without a directory


def test_a_standby_is_held_until_its_gate_file_exists(tmp_path: pathlib.Path) -> None:
    gate = tmp_path / "standby.gate"
    opened = threading.Event()

    def release() -> None:
        opened.wait(30)
        gate.write_text("go\n")

    t = threading.Thread(target=release)
    t.start()
    held: list[float] = []
    existed: list[bool] = []
    waiter = threading.Thread(target=lambda: (held.append(hold_as_standby(str(gate))),
                                              existed.append(gate.exists())))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive() and not held, "released before its gate existed"
    opened.set()
    waiter.join(30)
    t.join(30)
    assert held and held[0] > 0 and existed == [True]  # its own clock, not the test's: the order is the check


class Refused:
    """A session whose registration the lighthouse refuses with ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def start(self, wait_s: float) -> None:
        raise self.error


def test_a_refused_registration_is_a_configuration_error_unless_the_job_is_only_full() -> None:
    """A malformed or mismatched registration (a layout or slot count that differs from the job's) would be
    refused again after a restart: a ConfigError, which stops the job. A job at its members' limit may have room
    later: that error is left to the launcher's restarts."""
    cpu = torch.device("cpu")
    with pytest.raises(ConfigError, match="refused to register this replica: replica layout"):
        register(Refused(InvalidRequest("replica layout dp4 differs")), 0, 1.0, cpu)  # type: ignore[arg-type]
    with pytest.raises(AtCapacity):
        register(Refused(AtCapacity("the job is at its limit")), 0, 1.0, cpu)  # type: ignore[arg-type]
