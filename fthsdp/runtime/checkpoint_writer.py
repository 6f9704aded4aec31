"""Periodic checkpoints off the training thread (docs/design.md §7, "Durability").

At a commit boundary the replica's state is *staged* — copied by DCP's own stager (``dcp.async_save``) on the
training thread, the only part the step pays — and written by DCP's upload thread; a thread of ours then writes
this rank's trainer state, seals the files and writes the commit marker (``checkpoint.seal_written``). Both run
their collectives on a Gloo process group of their own over the replica's ranks, built once at start-up, so they
never meet the step's collectives on the replica's group. Every rank begins the same checkpoints in the same order
(the choice is the replica's: ``StepCore.after_commit``), so the groups' collectives pair up.

One checkpoint is in flight at a time: the next one waits for it at its own boundary, and so does a checkpoint
written now (``now``: a SIGTERM's, the end of the job's). A write that failed raises there, on the training
thread: nothing is lost silently. A checkpoint whose marker was not written (the process died mid-write) is
ignored by a resume, as any unfinished one.
"""

from __future__ import annotations

import logging
import pathlib
import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse

from ftar.devices import start_thread
from fthsdp.runtime import checkpoint
from fthsdp.runtime.errors import CheckpointFailed

GROUP_TIMEOUT_S = 600.0
"""How long a rank's writer waits for its siblings' in the writers' own collectives (a sibling whose write failed
never comes)."""


class CheckpointWriter:
    """One rank's checkpoints of its replica under ``directory`` (``FTHSDP_CHECKPOINT_DIR``), as replica ``index``,
    sealed under ``key``. With ``asynchronous`` (a collective at construction: every rank builds its writer, in the
    same order) periodic ones are written off the training thread."""

    def __init__(self, directory: str, index: int, rank: int, key: str, *, asynchronous: bool,
                 log_line: Callable[..., None]) -> None:
        self.directory, self.index, self.rank, self.key, self.log = directory, index, rank, key, log_line
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S)) \
            if asynchronous else None
        self._pending: Future[pathlib.Path] | None = None

    def periodic(self, step: int, model: nn.Module, opt: torch.optim.Optimizer, cursors: torch.Tensor,
                 side: bytes, share: tuple[int, int] = checkpoint.WHOLE) -> None:
        """Begin this replica's ``share`` (index, shares: ``checkpoint.share_of``) of the checkpoint of committed
        ``step`` (its state staged now, written behind the next steps); without ``asynchronous``, write it now."""
        if self.group is None:
            self.now(step, model, opt, cursors, side, share)
            return
        self.wait()
        t0 = time.perf_counter()
        path = checkpoint.path_of(self.directory, step, self.index, share)
        staged = dcp.async_save(checkpoint.share_of(checkpoint.state_of(model, opt), *share), checkpoint_id=str(path),
                                process_group=self.group)
        upload = staged.upload_completion if isinstance(staged, AsyncSaveResponse) else staged
        done: Future[pathlib.Path] = Future()
        start_thread(self._seal, name="fthsdp-checkpoint", device=None,
                     args=(done, upload, path, step, cursors.clone(), side))
        self._pending = done
        self.log(logging.INFO, "checkpoint %s staged in %.3fs, writing behind the steps", path,
                 time.perf_counter() - t0)

    def _seal(self, done: Future[pathlib.Path], upload: Future[object], path: pathlib.Path, step: int,
              cursors: torch.Tensor, side: bytes) -> None:
        t0 = time.perf_counter()
        try:
            upload.result()
            checkpoint.seal_written(path, step, self.index, cursors, self.rank, side, self.key, self.group)
        except BaseException as e:  # DCP's CheckpointException is a BaseException: handed over, typed, whatever it is
            failed = CheckpointFailed(f"checkpoint {path} of step {step} was not written: {type(e).__name__}: {e}")
            failed.__cause__ = e
            done.set_exception(failed)
            return
        self.log(logging.INFO, "checkpoint %s written in %.3fs off the step", path, time.perf_counter() - t0)
        done.set_result(path)

    def wait(self) -> pathlib.Path | None:
        """Wait for the checkpoint in flight, if any; its path. ``CheckpointFailed`` if its write failed."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def now(self, step: int, model: nn.Module, opt: torch.optim.Optimizer, cursors: torch.Tensor,
            side: bytes, share: tuple[int, int] = checkpoint.WHOLE) -> pathlib.Path:
        """Write this replica's ``share`` of the checkpoint of committed ``step`` before returning (after the one in
        flight)."""
        self.wait()
        t0 = time.perf_counter()
        path = checkpoint.save(self.directory, step, self.index, model, opt, cursors, self.rank, side, self.key,
                               share)
        self.log(logging.INFO, "checkpoint %s written in %.3fs", path, time.perf_counter() - t0)
        return path

    def close(self) -> None:
        """Wait for the checkpoint in flight (a failure is logged: the replica is closing anyway)."""
        try:
            self.wait()
        except CheckpointFailed as e:  # logged: a resume ignores a checkpoint without its marker
            self.log(logging.ERROR, "the checkpoint in flight failed: %s", e)
