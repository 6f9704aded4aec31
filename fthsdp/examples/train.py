"""The example trainer, run by torchrun (one torchrun per replica group):

    torchrun --standalone --nproc-per-node 2 -m fthsdp.examples.train --steps 60

With ``FTHSDP_*`` set (the launcher does it) it trains under fthsdp; with ``--plain`` it is the same training
with plain FSDP2 (``--hsdp-replicas R``: plain FSDP2-HSDP over R×S ranks, torch's replicate dimension), the
baseline of the benchmarks and of the bitwise tests. Rank 0 of each replica appends JSON lines to
``--progress`` (default ``FTHSDP_PROGRESS``): one per committed step, and a final one with the state hash.
``FTHSDP_LOG_LEVEL`` sets the log level (default ``WARNING``) and ``--scheduler`` (default ``FTHSDP_SCHEDULER``)
an LR scheduler, handed to the runtime in one line; ``fthsdp.runtime.config.TrainerSettings`` reads them.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from fthsdp.examples.data import batch
from fthsdp.examples.gpt import GPTConfig
from fthsdp.examples.hsdp import local_param_hash, plain_hsdp, seeded_gpt
from fthsdp.examples.layouts import LAYOUTS, Built, layout_gpt, mesh_for
from fthsdp.launch.progress import ProgressWriter as Progress
from fthsdp.runtime.config import SCHEDULERS, TrainerSettings
from fthsdp.runtime.result import StepResult
from fthsdp.runtime.session import step_row


def _args(argv: list[str] | None, settings: TrainerSettings) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fthsdp.examples.train")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--model", default="reference", help="reference (the benchmark workload) or tiny")
    p.add_argument("--batch", type=int, default=8, help="sequences per replica per step (split over its ranks)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress", default=settings.progress, help="rank 0 appends JSON lines here "
                   "(default: FTHSDP_PROGRESS)")
    p.add_argument("--plain", action="store_true", help="plain FSDP2 (no fault tolerance): the baseline")
    p.add_argument("--hsdp-replicas", type=int, default=1, help="with --plain: replicas of an HSDP mesh")
    p.add_argument("--scheduler", default=settings.scheduler, choices=SCHEDULERS,
                   help="LR scheduler: cosine (CosineAnnealingLR over --steps), lambda (LambdaLR, x0.97 per step), "
                   "none (default: FTHSDP_SCHEDULER)")
    p.add_argument("--layout", default="fsdp", choices=LAYOUTS,
                   help="the replica's layout: fsdp (FSDP2 over its ranks), tp2 (tensor parallel 2 x FSDP2), pp2 (2 "
                   "pipeline stages, 1F1B, FSDP2 inside each): fthsdp.examples.layouts; with --plain too")
    p.add_argument("--api", default="loop", choices=("loop", "closure"),
                   help="fthsdp: the trainer's own loop (zero_grad/backward/step on ft.optimizer's result; default) or "
                   "ft.train_step(closure)")
    p.add_argument("--min-step-s", type=float, default=0.0,
                   help="pace steps that train a batch to take at least this long (stands in for more compute in "
                   "tests; a joiner's zero steps compute nothing and are not paced)")
    p.add_argument("--compute-s", type=float, default=0.0,
                   help="pad each training forward to at least this long: a stand-in for a bigger model's steady "
                   "compute (tests of the fail-slow detector: a tiny model's tens of milliseconds on a shared CPU "
                   "jitter by more than any straggler factor)")
    a = p.parse_args(argv)
    if a.api == "closure" and a.layout != "fsdp":
        p.error(f"--layout {a.layout} trains in the loop (--api loop): its backward is the layout's")
    return a


def _pace(min_step_s: float, t0: float) -> None:
    left = min_step_s - (time.perf_counter() - t0)
    if left > 0:
        time.sleep(left)  # workload pacing, not synchronisation


def _computed(compute_s: float, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``forward()``, padded to at least ``compute_s`` (``--compute-s``)."""
    t0 = time.perf_counter()
    loss = forward()
    _pace(compute_s, t0)
    return loss


def _scheduler(name: str, opt: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LRScheduler | None:
    if name == "cosine":
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(steps, 1))
    if name == "lambda":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.97 ** step)
    return None


def run_plain(a: argparse.Namespace, cfg: GPTConfig) -> None:
    built: Built | None = None
    model: torch.nn.Module
    if a.layout == "fsdp":
        job = plain_hsdp(cfg, a.seed, a.hsdp_replicas)
        model, slot, srank, shards, first = job.model, job.slot, job.shard_rank, job.shards, job.shard_rank == 0
    else:  # the layout's mesh with a replicate dimension: plain HSDP of that layout
        dist.init_process_group("gloo")
        ranks = dist.get_world_size() // a.hsdp_replicas
        mesh = mesh_for(a.layout, ranks, a.hsdp_replicas)
        built = layout_gpt(cfg, a.seed, a.layout, mesh, ("replicate", "dp"))
        model, srank, shards = built.model, built.data_rank, built.data_ranks
        slot, first = dist.get_rank() // ranks, dist.get_rank() % ranks == 0
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    scheduler = _scheduler(a.scheduler, opt, a.steps)
    progress = Progress(a.progress, first, replica=slot, mode="plain")
    per_rank = a.batch // shards
    for step in range(a.steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        data = batch(a.seed, step, slot, srank, per_rank, cfg.seq_len, cfg.vocab)
        if built is None:
            loss = _computed(a.compute_s, lambda: job.model.loss(data))  # noqa: B023 - called within this iteration
            loss.backward()
        else:
            loss = _computed(a.compute_s, lambda: built.train(data))  # noqa: B023 - called within this iteration
        opt.step()
        if scheduler is not None:
            scheduler.step()
        progress.write(event="step", step=step, loss=float(loss.item()), step_s=time.perf_counter() - t0)
    progress.write(event="final", step=a.steps, local_param_hash=local_param_hash(model))
    dist.destroy_process_group()


def run_fthsdp(a: argparse.Namespace, cfg: GPTConfig, settings: TrainerSettings) -> None:
    from fthsdp.runtime import (
        EXIT_REJOIN,
        DigestMismatch,
        JobFinished,
        NoStateToResume,
        RejoinRequired,
        Replica,
        SlotConflict,
        StateMismatch,
        Terminated,
        Unhealthy,
    )
    from fthsdp.runtime.config import ConfigError
    from fthsdp.runtime.session import exit_unhealthy

    mesh = None
    if a.layout != "fsdp":  # the replica's mesh first: its layout is registered (CPU, Gloo: the examples' layouts)
        dist.init_process_group("gloo")
        mesh = mesh_for(a.layout, dist.get_world_size())
    try:
        ft = Replica(mesh=mesh)
    except JobFinished as e:  # back after the job completed, with no final checkpoint: nothing to do
        Progress(a.progress, settings.rank0).write(event="job_finished", step=e.step, error=str(e))
        return
    except (NoStateToResume, ConfigError, StateMismatch) as e:
        # Restarting would not help: tell the launcher (a "fatal" line) and stop.
        Progress(a.progress, settings.rank0).write(event="fatal", error=str(e))
        raise
    except Unhealthy as e:  # the self-check failed: this host is reported, the group kept out
        exit_unhealthy(e)
    built: Built | None = None
    model: torch.nn.Module
    if mesh is None:
        model = gpt = seeded_gpt(cfg, a.seed)
        ft.shard(gpt, blocks=gpt.blocks)
        data_rank, data_ranks = ft.rank, ft.world_size
    else:
        built = layout_gpt(cfg, a.seed, a.layout, mesh, ("dp",))
        model, data_rank, data_ranks = built.model, built.data_rank, built.data_ranks
    inner = torch.optim.AdamW(model.parameters(), lr=a.lr)
    opt = ft.optimizer(inner, scheduler=_scheduler(a.scheduler, inner, a.steps),  # stepped by the runtime per commit
                       model=None if built is None else model)
    slot, rank = ft.config.replica_index, ft.rank
    progress = Progress(a.progress, rank == 0, replica=slot, incarnation=ft.incarnation, mode="fthsdp")
    # Once registered: at once, or for a warm standby once released (in its first train_step).
    ft.when_registered(lambda: progress.write(event="start", joining=ft.joining, resumed_from=ft.resumed_from,
                                              step=ft.step))
    micros = ft.config.micro_batches  # gradient accumulation (FTHSDP_MICRO_BATCHES): a rank's batch in that many parts
    per_rank = a.batch // data_ranks // micros
    if per_rank < 1:
        sys.exit(f"--batch {a.batch} is smaller than {data_ranks} ranks x FTHSDP_MICRO_BATCHES={micros}")

    def tokens(slot: int | None = None, cursor: int | None = None, micro: int = 0) -> torch.Tensor:
        # Data by the slot's cursor, not by step: a batch is trained once, even across failures. The slot is the one
        # the lighthouse gives this replica now (a spare's is taken over from a dead replica), or one dealt to it.
        slot, cursor = (ft.slot, ft.cursor) if slot is None or cursor is None else (slot, cursor)
        part = data_rank * micros + micro
        return batch(a.seed, cursor, slot, part, per_rank, cfg.seq_len, cfg.vocab).to(ft.device)

    def forward(slot: int | None = None, cursor: int | None = None, micro: int = 0) -> torch.Tensor:
        return _computed(a.compute_s, lambda: gpt.loss(tokens(slot, cursor, micro)) / micros)

    def write(r: StepResult, loss: float | None, step_s: float,
              samples: list[tuple[int, int, int, torch.Tensor]] | None = None) -> None:
        """The launcher's row, with our loss and time (and the step's micro-batches, when trained in our loop: their
        losses read once the step is done, not one device sync per micro-batch)."""
        done = {"samples": [[s, c, m, float(x.item())] for s, c, m, x in samples]} if samples is not None else {}
        progress.write(**{**step_row(r), "loss": loss, "step_s": step_s, **done})

    def write_final() -> None:
        """The launcher's final line: this replica's state hash and cursors (``late``: back too late, it holds the
        job's final checkpoint)."""
        progress.write(event="final", step=ft.step, param_hash=ft.state_hash(), cursors=ft.cursors.tolist(),
                       **({"late": True} if ft.finished else {}))

    try:
        if a.api == "closure":  # train_step: the runtime runs forward and backward
            while ft.step < a.steps:
                t0 = time.perf_counter()
                r = ft.train_step(forward)
                write(r, r.loss, time.perf_counter() - t0)
                if r.contributed:  # the pause stands in for compute: a zero step (no batch) would have none
                    _pace(a.min_step_s, t0)
        # The steps committed inside zero_grad (a joiner's catch-up, a spare's zero steps) are logged as they commit.
        ft.on_result = lambda r: None if r.contributed else write(r, None, r.exchange_s)
        for _ in ft.steps(a.steps):  # the trainer's own loop (zero_grad begins a step, step commits)
            t0 = time.perf_counter()
            opt.zero_grad()  # a joiner catches up here, a spare shadows the others
            samples = []  # what this iteration trains, (slot, cursor, micro-batch, this rank's loss): the row's record
            if built is None:
                for slot, cursor, micro in ft.dealt():  # its slot's batch, and its share of orphan slots' (carrying)
                    loss = forward(slot, cursor, micro)
                    loss.backward()  # on the last, the exchange runs as FSDP2 produces each gradient shard
                    samples.append((slot, cursor, micro, loss.detach()))
            else:  # the layout's forward and backward (a pipeline's schedule: the exchange settles inside it)
                loss = _computed(a.compute_s, lambda: built.train(tokens()))  # noqa: B023 - called within this iteration
            trained = opt.step()  # commits (None: a warm-up, which trained nothing)
            if trained is not None:
                write(trained, float(loss.item()), time.perf_counter() - t0, samples)
                _pace(a.min_step_s, t0)  # the pause stands in for compute: a zero step (no batch) would have none
        write_final()
    except DigestMismatch as e:  # loud, whether this replica rejoins (in the minority) or the job must stop
        progress.write(event="digest_mismatch", step=e.step, replicas=list(e.replicas), error=str(e))
        if isinstance(e, RejoinRequired):
            sys.exit(EXIT_REJOIN)
        progress.write(event="fatal", error=str(e))
        raise
    except RejoinRequired as e:
        logging.getLogger("fthsdp").error("fthsdp replica=%s rank=%d: %s; exiting to rejoin", ft.config.replica_id,
                                          rank, e)
        sys.exit(EXIT_REJOIN)
    except Terminated as e:
        progress.write(event="terminated", step=e.step, checkpoint=e.path)
        raise
    except JobFinished as e:  # a warm standby released after the job finished, or a joiner told in train_step
        if ft.finished:  # it holds the final checkpoint: the job's final state
            write_final()
        else:
            progress.write(event="job_finished", step=e.step, error=str(e))
        ft.close(leave=False)
        return
    except SlotConflict as e:
        progress.write(event="fatal", error=str(e))
        raise
    ft.close()


def main(argv: list[str] | None = None) -> None:
    settings = TrainerSettings.from_env()
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    torch.set_num_threads(1)
    # FSDP2 warns that the root returns a view (the logits); nothing here changes it in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    a = _args(argv, settings)
    cfg = GPTConfig.named(a.model)
    if a.plain:
        run_plain(a, cfg)
    else:
        run_fthsdp(a, cfg, settings)


if __name__ == "__main__":
    main()
