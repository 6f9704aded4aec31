"""The whole-job-restart baseline's trainer: plain FSDP2-HSDP (torch's replicate x shard mesh over every rank of
every replica, one torchrun, no fault tolerance) with a torch.distributed.checkpoint (DCP) every
``--checkpoint-every`` steps, resuming from the newest checkpoint when torchrun restarts the workers (as a
torchrun-elastic job does after a failure):

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 3 --max-restarts 1 \\
        -m fthsdp.bench.baselines.restart_train --hsdp-replicas 3 --checkpoint-dir ckpt --progress-dir out

The reference workload (docs/design.md §12): same model, data (slot = replica index), optimizer as
``fthsdp.examples.train --plain``. ``--kill REPLICA@STEP``: in the first incarnation, rank 0 of that replica
SIGKILLs itself when it reaches STEP (the agent then stops and restarts every worker). Rank 0 of each replica
appends JSON lines to ``PROGRESS_DIR/replica{R}.progress.jsonl``: ``start`` (with the step it resumed at),
``step`` per step (``incarnation`` = torchrun's restart count + 1), ``kill``, ``checkpoint`` and ``final``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fthsdp.bench.baselines.restart_train")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--model", default="reference")
    p.add_argument("--batch", type=int, default=8, help="sequences per replica per step")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hsdp-replicas", type=int, required=True)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--checkpoint-every", type=int, default=5, help="0: never")
    p.add_argument("--progress-dir", required=True)
    p.add_argument("--kill", default="", help="REPLICA@STEP: SIGKILL that replica's rank 0 at STEP (first run only)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    warnings.filterwarnings("ignore", category=FutureWarning)
    a = _args(argv)
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from fthsdp.examples.data import batch
    from fthsdp.examples.gpt import GPTConfig
    from fthsdp.examples.hsdp import local_param_hash, plain_hsdp
    from fthsdp.launch.procutil import write_atomic
    from fthsdp.launch.progress import ProgressWriter, progress_path

    cfg = GPTConfig.named(a.model)
    job = plain_hsdp(cfg, a.seed, a.hsdp_replicas)
    model, slot, srank, shards = job.model, job.slot, job.shard_rank, job.shards
    rank = dist.get_rank()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) + 1
    kill_replica, kill_step = (int(x) for x in a.kill.split("@")) if a.kill else (-1, -1)

    path = progress_path(pathlib.Path(a.progress_dir), slot)
    write = ProgressWriter(path, srank == 0, replica=slot, incarnation=incarnation, mode="restart").write

    ckpt = pathlib.Path(a.checkpoint_dir)
    latest = ckpt / "latest"
    start = 0
    if latest.exists():
        t0 = time.perf_counter()
        start = int(latest.read_text())
        model_sd, optim_sd = get_state_dict(model, opt)
        state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(ckpt / f"step-{start}"))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        write(event="restored", step=start, load_s=time.perf_counter() - t0)
    write(event="start", step=start)
    per_rank = a.batch // shards
    for step in range(start, a.steps):
        t0 = time.perf_counter()
        if incarnation == 1 and slot == kill_replica and srank == 0 and step == kill_step:
            write(event="kill", step=step)
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad(set_to_none=True)
        loss = model.loss(batch(a.seed, step, slot, srank, per_rank, cfg.seq_len, cfg.vocab))
        loss.backward()
        opt.step()
        write(event="step", step=step, loss=float(loss.item()), step_s=time.perf_counter() - t0)
        if a.checkpoint_every and (step + 1) % a.checkpoint_every == 0 and step + 1 < a.steps:
            t1 = time.perf_counter()
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(ckpt / f"step-{step + 1}"))
            dist.barrier()
            if rank == 0:
                write_atomic(latest, str(step + 1))
            write(event="checkpoint", step=step + 1, save_s=time.perf_counter() - t1)
    write(event="final", step=a.steps, local_param_hash=local_param_hash(model))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
