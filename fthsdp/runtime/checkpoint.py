"""Durable checkpoints with torch.distributed.checkpoint (DCP), for the day every replica dies at once.

One replica writes each periodic checkpoint: the lowest-numbered data slot that contributed to the step, which
every replica knows from the step's exchange, so they agree without talking. A replica told to stop (SIGTERM)
writes its own. Layout::

    <dir>/step-00000040-r0/           DCP files (every rank of replica 0 writes its shards)
    <dir>/step-00000040-r0/fthsdp.json  {"step": 40, "cursors": [...], ...}  written last: the commit marker

A directory without ``fthsdp.json`` is an unfinished write and is ignored.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

log = logging.getLogger("fthsdp.runtime.checkpoint")

MARKER = "fthsdp.json"
_NAME = re.compile(r"^step-(\d{8})-r(\d+)$")


@dataclass(frozen=True)
class Checkpoint:
    path: pathlib.Path
    step: int
    """The step to train next (the checkpoint holds the state after committing ``step - 1``)."""
    cursors: tuple[int, ...]
    """Per data slot: batches trained so far."""


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
            ck = Checkpoint(d, int(meta["step"]), tuple(int(c) for c in meta["cursors"]))
        except (ValueError, KeyError, TypeError, OSError) as e:
            log.warning("fthsdp checkpoint %s: unreadable marker (%s); skipped", d, e)
            continue
        if best is None or ck.step > best.step:
            best = ck
    return best


def save(directory: str | os.PathLike[str], step: int, slot: int, model: nn.Module, opt: torch.optim.Optimizer,
         cursors: torch.Tensor, rank: int) -> pathlib.Path:
    """Write the replica's state (a collective over the replica's ranks: call it on every rank)."""
    path = pathlib.Path(directory) / f"step-{step:08d}-r{slot}"
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path))
    dist.barrier()
    if rank == 0:
        tmp = path / (MARKER + ".tmp")
        tmp.write_text(json.dumps({"step": step, "cursors": [int(c) for c in cursors.tolist()], "slot": slot,
                                   "world_size": dist.get_world_size()}))
        os.replace(tmp, path / MARKER)
    dist.barrier()
    return path


def load(ck: Checkpoint, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """Read a checkpoint into the (already sharded) model and its optimizer, on every rank of the replica."""
    model_sd, optim_sd = get_state_dict(model, opt)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(ck.path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
