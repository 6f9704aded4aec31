"""Durable checkpoints with torch.distributed.checkpoint (DCP), for the day every replica dies at once.

The replicas hold the same state, so a periodic checkpoint is written in **shares**, one per replica that
contributed to the step (every replica knows them from the step's exchange, so they agree without talking): the
share of the ``k``-th contributing slot holds a ``1/n`` of the parameters by size (``split``) with their optimizer
state, and the first share the optimizer's param groups and the trainer state. Each replica then pays a ``1/n`` of
the write, where one replica writing it all kept the others waiting for it at the next exchange. A replica told to
stop (SIGTERM), one contributing alone, and the end of the job write whole checkpoints. Layout::

    <dir>/step-00000040-r0/           a whole checkpoint of replica 0: DCP files (every rank of the replica writes
                                      its shards, and the optimizer's param groups)
    <dir>/step-00000040-r0/fthsdp-rank0.json  rank 0's trainer state (param groups, registered objects) and RNG
    <dir>/step-00000040-r0/fthsdp.json  {"step": 40, "cursors": [...], "files": {...}, "seal": ...}  written
                                      last: the commit marker, with every other file's SHA-256 and their seal
    <dir>/step-00000050-p1of3/        share 1 of 3 of a checkpoint of step 50, laid out the same

A directory without ``fthsdp.json`` is an unfinished write and is ignored, and so is a checkpoint missing a share
(its writer died): a resume takes the newest complete one. Nothing of a checkpoint is read before the seal and
digests of every share are checked (``fthsdp.runtime.checkpoint_seal``: loading one runs pickle).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import pathlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
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
_NAME = re.compile(r"^step-(\d{8})-(?:r\d+|p(\d+)of(\d+))$")
WHOLE = (0, 1)
"""The share of a whole checkpoint: (index, shares)."""


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
    rest: tuple[Checkpoint, ...] = ()
    """The other shares of a checkpoint written in shares, in order (this one is share 0: it holds the trainer
    state); () for a whole one."""


def latest(directory: str | os.PathLike[str]) -> Checkpoint | None:
    """The newest complete checkpoint under ``directory`` (None if there is none)."""
    root = pathlib.Path(directory)
    if not root.is_dir():
        return None
    found: list[Checkpoint] = []
    shares: dict[tuple[int, int], dict[int, Checkpoint]] = {}  # (step, shares) -> index -> that share
    for d in root.iterdir():
        if not (name := _NAME.match(d.name)) or not (d / MARKER).is_file():
            continue
        try:
            meta = json.loads((d / MARKER).read_text())
            ck = Checkpoint(d, int(meta["step"]), tuple(int(c) for c in meta["cursors"]),
                            {str(k): str(v) for k, v in (meta.get("files") or {}).items()}, str(meta.get("seal", "")))
        except (ValueError, KeyError, TypeError, OSError) as e:
            log.warning("fthsdp checkpoint %s: unreadable marker (%s); skipped", d, e)
            continue
        if name.group(2) is None:
            found.append(ck)
        else:
            shares.setdefault((ck.step, int(name.group(3))), {})[int(name.group(2))] = ck
    for (_, n), got in shares.items():
        parts = [got.get(k) for k in range(n)]
        if all(parts) and len({p.cursors for p in got.values()}) == 1:  # a share missing: its writer died
            first, *rest = (p for p in parts if p is not None)
            found.append(replace(first, rest=tuple(rest)))
    return max(found, key=lambda ck: ck.step, default=None)


def split(sizes: Mapping[str, int], n: int) -> list[frozenset[str]]:
    """``n`` shares of the names of ``sizes`` (name -> size), each name in exactly one, their sizes as even as a
    greedy fill gets them (the largest first, each to the share with the least so far; ties by name and index):
    the same on every rank of every replica, which hold the same parameters."""
    if n < 1:
        raise ValueError(f"a checkpoint is written in at least 1 share, got {n}")
    load, out = [0] * n, [set[str]() for _ in range(n)]
    for name in sorted(sizes, key=lambda x: (-sizes[x], x)):
        k = load.index(min(load))
        load[k] += sizes[name]
        out[k].add(name)
    return [frozenset(x) for x in out]


def share_of(state: dict[str, Any], index: int, shares: int) -> dict[str, Any]:
    """Share ``index`` of ``shares`` of ``state`` (``state_of``'s): the parameters ``split`` gives it, with their
    optimizer state; share 0 also what is not a parameter's (the param groups, a module's extra state). Its leaves
    are ``state``'s own objects, so a load into it fills ``state``'s tensors in place (``_take`` the rest)."""
    if (index, shares) == WHOLE:
        return state
    model, optim = state["model"], state["optim"]
    mine = split({k: v.numel() for k, v in model.items() if isinstance(v, torch.Tensor)}, shares)[index]

    def ours(name: str, value: object) -> bool:  # a parameter's (a tensor of the model's): by the split
        return name in mine if isinstance(value, torch.Tensor) else index == 0

    return {"model": {k: v for k, v in model.items() if ours(k, v)},
            "optim": {"state": {k: v for k, v in optim.get("state", {}).items() if ours(k, model.get(k))},
                      **{k: v for k, v in optim.items() if k != "state" and index == 0}}}


def _take(state: dict[str, Any], loaded: dict[str, Any]) -> None:
    """Put into ``state`` what a load replaced in its share ``loaded`` (values that are not tensors)."""
    for k, v in loaded.items():
        if isinstance(v, dict) and isinstance(state.get(k), dict):
            if v is not state[k]:
                _take(state[k], v)
        elif v is not state.get(k):
            state[k] = v


def _side_path(path: pathlib.Path, rank: int) -> pathlib.Path:
    return path / f"fthsdp-rank{rank}.json"


def _shared(names: list[str], rank: int, work: Callable[[list[str]], list[T]],
            group: dist.ProcessGroup | None = None) -> list[T]:
    """``work`` over ``names`` split among the replica's ranks (this rank takes every world-th from ``rank``), and
    every rank's results gathered on every rank (a collective over ``group``, default: the replica's)."""
    shares: list[list[T] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(shares, work(names[rank::len(shares)]), group=group)
    return [x for share in shares for x in (share or [])]


def path_of(directory: str | os.PathLike[str], step: int, index: int, share: tuple[int, int] = WHOLE) -> pathlib.Path:
    """Where replica ``index``'s checkpoint of ``step`` goes; a ``share`` (index, shares) of one in shares goes
    under the share's name (any replica may write it)."""
    k, n = share
    if not 0 <= k < n:
        raise ValueError(f"share {k} of {n}")
    return pathlib.Path(directory) / (f"step-{step:08d}-r{index}" if n == 1 else f"step-{step:08d}-p{k}of{n}")


def state_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """What DCP writes: the model's and the optimizer's state dicts (this rank's shards)."""
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def save(directory: str | os.PathLike[str], step: int, index: int, model: nn.Module, opt: torch.optim.Optimizer,
         cursors: torch.Tensor, rank: int, side: bytes, key: str = "", share: tuple[int, int] = WHOLE) -> pathlib.Path:
    """Write the replica's state (a collective over the replica's ranks: call it on every rank) under its
    ``FTHSDP_REPLICA_INDEX`` ``index`` (unique, where its data slot may be none: a spare), or its ``share``
    (``share_of``); ``side`` is this rank's trainer state and RNG (``ShardState.side_state``, JSON); sealed under
    ``key`` (the job's catch-up key)."""
    path = path_of(directory, step, index, share)
    dcp.save(share_of(state_of(model, opt), *share), checkpoint_id=str(path))
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
    for part in (ck, *ck.rest):
        checkpoint_seal.check_seal(part.path, MARKER, part.files, part.seal, key)
        check = functools.partial(checkpoint_seal.check_digests, part.path, part.files)
        if changed := sorted(_shared(sorted(part.files), rank, check)):
            raise CheckpointRejected(f"checkpoint {part.path}: {changed} differ from what was sealed: refusing to "
                                     "read it")


def load(ck: Checkpoint, model: nn.Module, opt: torch.optim.Optimizer, rank: int, key: str = "") -> bytes:
    """Read a checkpoint into the (already sharded) model and its optimizer, on every rank of the replica, once its
    seal holds (``verify``); returns this rank's side state (what ``save`` got as ``side``)."""
    verify(ck, rank, key)
    state = state_of(model, opt)
    for k, part in enumerate(parts := (ck, *ck.rest)):
        share = share_of(state, k, len(parts))
        dcp.load(share, checkpoint_id=str(part.path))
        _take(state, share)
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
