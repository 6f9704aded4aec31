"""Durable checkpoints with torch.distributed.checkpoint (DCP), for the day every replica dies at once.

One replica writes each periodic checkpoint: the lowest-numbered data slot that contributed to the step, which
every replica knows from the step's exchange, so they agree without talking. A replica told to stop (SIGTERM)
writes its own. Layout::

    <dir>/step-00000040-r0/           DCP files (every rank of replica 0 writes its shards, and the optimizer's
                                      param groups)
    <dir>/step-00000040-r0/fthsdp-rank0.json  rank 0's trainer state (param groups, registered objects) and RNG
    <dir>/step-00000040-r0/fthsdp.json  {"step": 40, "cursors": [...], "files": {...}, "seal": ...}  written
                                      last: the commit marker, with every other file's SHA-256 and their seal

A directory without ``fthsdp.json`` is an unfinished write and is ignored. Nothing of a checkpoint is read before
its seal and digests are checked (``fthsdp.runtime.checkpoint_seal``: loading one runs pickle).
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fthsdp.runtime import checkpoint_seal
from fthsdp.runtime.errors import CheckpointRejected, StateMismatch
from fthsdp.runtime.state import ShardState

log = logging.getLogger("fthsdp.runtime.checkpoint")

T = TypeVar("T")
MARKER = "fthsdp.json"
_NAME = re.compile(r"^step-(\d{8})-r(\d+)$")


@dataclass(frozen=True)
class Checkpoint:
    path: pathlib.Path
    step: int
    """The step to train next (the checkpoint holds the state after committing ``step - 1``)."""
    cursors: tuple[int, ...]
    """Per data slot: batches trained so far."""
    files: Mapping[str, str] = field(default_factory=dict)
    """Every other file of the checkpoint -> its SHA-256, as its writer hashed them."""
    seal: str = ""
    """The writer's MAC over ``files`` under the job's catch-up key ('' without one)."""


def latest(directory: str | os.PathLike[str]) -> Checkpoint | None:
    """The newest complete checkpoint under ``directory`` (None if there is none)."""
    root = pathlib.Path(directory)
    if not root.is_dir():
        return None
    best: Checkpoint | None = None
    for d in root.iterdir():
        if not _NAME.match(d.name) or not (d / MARKER).is_file():
            continue
        try:
            meta = json.loads((d / MARKER).read_text())
            ck = Checkpoint(d, int(meta["step"]), tuple(int(c) for c in meta["cursors"]),
                            {str(k): str(v) for k, v in (meta.get("files") or {}).items()}, str(meta.get("seal", "")))
        except (ValueError, KeyError, TypeError, OSError) as e:
            log.warning("fthsdp checkpoint %s: unreadable marker (%s); skipped", d, e)
            continue
        if best is None or ck.step > best.step:
            best = ck
    return best


def _side_path(path: pathlib.Path, rank: int) -> pathlib.Path:
    return path / f"fthsdp-rank{rank}.json"


def _shared(names: list[str], rank: int, work: Callable[[list[str]], list[T]],
            group: dist.ProcessGroup | None = None) -> list[T]:
    """``work`` over ``names`` split among the replica's ranks (this rank takes every world-th from ``rank``), and
    every rank's results gathered on every rank (a collective over ``group``, default: the replica's)."""
    shares: list[list[T] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(shares, work(names[rank::len(shares)]), group=group)
    return [x for share in shares for x in (share or [])]


def path_of(directory: str | os.PathLike[str], step: int, index: int) -> pathlib.Path:
    """Where replica ``index``'s checkpoint of ``step`` goes."""
    return pathlib.Path(directory) / f"step-{step:08d}-r{index}"


def state_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What DCP writes: the model's and the optimizer's state dicts (this rank's shards)."""
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def save(directory: str | os.PathLike[str], step: int, index: int, model: nn.Module, opt: torch.optim.Optimizer,
         cursors: torch.Tensor, rank: int, side: bytes, key: str = "") -> pathlib.Path:
    """Write the replica's state (a collective over the replica's ranks: call it on every rank) under its
    ``FTHSDP_REPLICA_INDEX`` ``index`` (unique, where its data slot may be none: a spare); ``side`` is this rank's
    trainer state and RNG (``ShardState.side_state``, JSON); sealed under ``key`` (the job's catch-up key)."""
    path = path_of(directory, step, index)
    dcp.save(state_of(model, opt), checkpoint_id=str(path))
    return seal_written(path, step, index, cursors, rank, side, key)


def seal_written(path: pathlib.Path, step: int, index: int, cursors: torch.Tensor, rank: int, side: bytes,
                 key: str = "", group: dist.ProcessGroup | None = None) -> pathlib.Path:
    """Once DCP wrote ``path`` on every rank: this rank's trainer state, then (the ranks sharing the hashing) the
    commit marker with every file's digest and their seal. A collective over ``group`` (default: the replica's)."""
    tmp = _side_path(path, rank).with_suffix(".tmp")
    tmp.write_bytes(side)
    os.replace(tmp, _side_path(path, rank))
    dist.barrier(group=group)
    files = dict(_shared(checkpoint_seal.sealed_files(path, MARKER), rank,
                         lambda names: [(n, checkpoint_seal.digest(path / n)) for n in names], group))
    if rank == 0:
        tmp = path / (MARKER + ".tmp")
        tmp.write_text(json.dumps({"step": step, "cursors": [int(c) for c in cursors.tolist()], "replica_index": index,
                                   "world_size": dist.get_world_size(group), "files": files,
                                   "seal": checkpoint_seal.seal(key, files)}))
        os.replace(tmp, path / MARKER)
    dist.barrier(group=group)
    return path


def verify(ck: Checkpoint, rank: int, key: str) -> None:
    """Check ``ck``'s seal and, sharing the files among the replica's ranks, every file's digest (a collective);
    ``CheckpointRejected`` on every rank if anything differs. Reads no file with pickle."""
    checkpoint_seal.check_seal(ck.path, MARKER, ck.files, ck.seal, key)
    if changed := sorted(_shared(sorted(ck.files), rank,
                                 lambda names: checkpoint_seal.check_digests(ck.path, ck.files, names))):
        raise CheckpointRejected(f"checkpoint {ck.path}: {changed} differ from what was sealed: refusing to read it")


def load(ck: Checkpoint, model: nn.Module, opt: torch.optim.Optimizer, rank: int, key: str = "") -> bytes:
    """Read a checkpoint into the (already sharded) model and its optimizer, on every rank of the replica, once its
    seal holds (``verify``); returns this rank's side state (what ``save`` got as ``side``)."""
    verify(ck, rank, key)
    state = state_of(model, opt)
    dcp.load(state, checkpoint_id=str(ck.path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    try:
        return _side_path(ck.path, rank).read_bytes()
    except OSError as e:
        raise StateMismatch(f"checkpoint {ck.path} has no trainer state for rank {rank} ({e}): it was written with "
                            "a different number of ranks per replica") from None


def resume(ck: Checkpoint, model: nn.Module, shards: ShardState, slots: int, rank: int, key: str = "") -> torch.Tensor:
    """Load ``ck`` into the model, its optimizer, the trainer state and this rank's RNG; returns its data cursors
    (the job must have ``slots`` data slots, as the checkpoint's)."""
    if len(ck.cursors) != slots:
        raise StateMismatch(f"checkpoint {ck.path} has {len(ck.cursors)} data slots, the job {slots}")
    shards.load_side_state(load(ck, model, shards.opt, rank, key))
    return torch.tensor(ck.cursors, dtype=torch.int64)
