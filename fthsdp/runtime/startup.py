"""How a training process takes its place: it ends with its torchrun agent, agrees with the other ranks of its
replica on the replica's incarnation and every rank's catch-up address, and learns the replica's role (rank 0
registers with the lighthouse and tells the others). Every function but ``die_with_parent`` is a collective
over the replica's ranks (torchrun's process group): call it on every rank, in the same order."""

from __future__ import annotations

import ctypes
import enum
import os
import secrets
import signal
import sys
import time
import uuid

import torch
import torch.distributed as dist

from fthsdp.runtime import checkpoint
from fthsdp.runtime.config import ConfigError
from fthsdp.runtime.epoch_relay import GroupEpochs
from fthsdp.runtime.errors import JobFinished, NoStateToResume
from fthsdp.runtime.filewait import wait_until_exists
from lighthouse import membership as m
from lighthouse.errors import AtCapacity, InvalidRequest

TEXT_BYTES = 256
"""Longest text a rank may share with ``gather_strings`` (a catch-up address ``host:port``, a ``host pid``)."""


class Role(enum.IntEnum):
    """How a replica starts (an int: it is broadcast over the replica's ranks)."""

    ACTIVE = 0
    """It trains: the job starts, or the others are gone (it resumes from a checkpoint if there is one)."""
    JOINING = 1
    """The others are training: it catches up with them."""
    RESUME = 2
    """The job trained before and no replica is left to catch up from: it must resume from a checkpoint."""
    FINISHED = 3
    """The job completed before this replica came back: it must not train (it was not registered)."""


def die_with_parent(under_torchrun: bool) -> None:
    """Under torchrun, end with the agent: a SIGKILLed replica group then leaves no worker behind."""
    if not under_torchrun or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the agent died before prctl took effect
        os._exit(1)


def agree_incarnation(rank: int, device: torch.device) -> str:
    """A fresh id for this run of the replica, drawn by rank 0."""
    raw = torch.zeros(16, dtype=torch.uint8, device=device)
    if rank == 0:
        raw.copy_(torch.frombuffer(bytearray(uuid.uuid4().bytes), dtype=torch.uint8))
    dist.broadcast(raw, 0)
    return bytes(raw.cpu().tolist()).hex()


def group_secret(rank: int, device: torch.device) -> bytes:
    """32 random bytes drawn by rank 0 and shared over the replica's own process group: the key that seals the
    epochs rank 0 relays through torchrun's unauthenticated store (``fthsdp.runtime.epoch_relay``)."""
    raw = torch.zeros(32, dtype=torch.uint8, device=device)
    if rank == 0:
        raw.copy_(torch.frombuffer(bytearray(secrets.token_bytes(32)), dtype=torch.uint8))
    dist.broadcast(raw, 0)
    return bytes(raw.cpu().tolist())


def gather_strings(mine: str, world_size: int, device: torch.device) -> list[str]:
    """Every rank's ``mine`` (index = rank), at most ``TEXT_BYTES`` bytes each: the catch-up addresses (the lighthouse
    only carries rank 0's; it redirects joiners), the ranks' processes (``fthsdp.runtime.siblings``)."""
    raw = mine.encode()
    if len(raw) > TEXT_BYTES:
        raise ValueError(f"{mine!r} is longer than the {TEXT_BYTES} bytes a rank may share")
    buf = torch.zeros(TEXT_BYTES, dtype=torch.uint8, device=device)
    buf[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    out = [torch.empty_like(buf) for _ in range(world_size)]
    dist.all_gather(out, buf)
    return [bytes(t.cpu().tolist()).rstrip(b"\0").decode() for t in out]


def hold_as_standby(gate: str) -> float:
    """A warm standby (``FTHSDP_STANDBY_GATE``): wait, unregistered, until the launcher creates ``gate``; returns the
    seconds held. Every rank waits for the file itself (no collective: a standby may wait longer than any process
    group timeout). No deadline: a standby ends with its torchrun agent, which the launcher stops when the job
    ends (``die_with_parent``). The wait sleeps until the file's folder changes (``filewait``), not polling."""
    t0 = time.monotonic()
    wait_until_exists(gate)
    return time.monotonic() - t0


def register(epochs: GroupEpochs, rank: int, wait_s: float, device: torch.device) -> tuple[Role, int]:
    """Start the lighthouse session (rank 0 registers the replica and relays the epochs to the others) and agree
    on the role the lighthouse gave the replica. Returns (the role, the step the job finished at: 0 unless
    ``Role.FINISHED``)."""
    role, finished_step = Role.ACTIVE, 0
    try:
        reg = epochs.start(wait_s)
    except AtCapacity:
        raise  # the job is full now: a restart may find room
    except InvalidRequest as e:  # a restart would be refused again: a setting or layout that differs from the job's
        raise ConfigError(f"the lighthouse refused to register this replica: {e}") from e
    if rank == 0:
        assert reg is not None
        role = Role.JOINING if reg.role == m.JOINING else Role.ACTIVE
        if reg.resume:
            role = Role.RESUME
        if reg.finished:
            role, finished_step = Role.FINISHED, reg.finished_step
    agreed, step = from_rank0([int(role), finished_step], device)
    return Role(agreed), step


def from_rank0(values: list[int], device: torch.device) -> list[int]:
    """Rank 0's ``values`` on every rank (the others pass placeholders of the same length)."""
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.broadcast(t, 0)
    return [int(v) for v in t.tolist()]


def all_ranks(flag: bool, device: torch.device) -> bool:
    """True on every rank if ``flag`` is true on every rank."""
    t = torch.tensor([int(flag)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if ``flag`` is true on any rank."""
    return not all_ranks(not flag, device)


def start_from(role: Role, finished_step: int, job_id: str, checkpoint_dir: str) -> checkpoint.Checkpoint | None:
    """The checkpoint a replica starts from: none for a joiner (it catches up); for an active one the newest in
    ``checkpoint_dir`` (the whole job was restarted, or every replica had died: ``Role.RESUME``, which needs one);
    for ``Role.FINISHED`` the final checkpoint of ``finished_step``. Raises ``NoStateToResume`` or ``JobFinished``
    when the state the role needs is not there."""
    ck = checkpoint.latest(checkpoint_dir) if role != Role.JOINING and checkpoint_dir else None
    if role == Role.FINISHED and (ck is None or ck.step != finished_step):
        raise JobFinished(f"job {job_id!r} finished at step {finished_step} before this replica came back, and "
                          f"there is no final checkpoint of that step (FTHSDP_CHECKPOINT_DIR={checkpoint_dir!r}): "
                          "nothing to train, no final state", finished_step)
    if role == Role.RESUME and ck is None:
        raise NoStateToResume(f"job {job_id!r} trained before but no replica is alive to catch up from and there is "
                              f"no checkpoint to resume from (FTHSDP_CHECKPOINT_DIR={checkpoint_dir!r})")
    return ck
