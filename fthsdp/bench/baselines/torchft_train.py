"""The reference workload (docs/design.md §12) trained with torchft 0.2.0: its ``Manager``, its
lighthouse and its reconfigurable ``ProcessGroupGloo``. One replica group = one torchrun:

    TORCHFT_LIGHTHOUSE=http://127.0.0.1:PORT torchrun --standalone --nproc-per-node 1 \\
        -m fthsdp.bench.baselines.torchft_train --replica-index 0 --progress r0.jsonl

With one rank per group the plain module trains (nothing to shard). With several (``--nproc-per-node 2``: the
HSDP shape), the group shards the model with FSDP2 over its ranks (``fthsdp.examples.hsdp.plain_hsdp``, as plain
FSDP2-HSDP and fthsdp do) and each rank has its own ``Manager``, as torchft's HSDP recipe has: FSDP2
reduce-scatters inside the group, and each rank all-reduces its gradient shard with the same rank of the other
groups through its Manager.

torchft's DDP wrapper crashed the survivors on a kill on this stack (docs/design.md §12), so the gradients are averaged
with ``manager.allreduce`` on one flat bucket after the backward pass, and the optimizer steps only when
``manager.should_commit()`` agrees: the loop of torchft's ``train_ddp.py`` without the wrapper. The quorum is
asynchronous (torchft's default: it runs during the forward pass). A restarted group heals from a live one at
its first quorum (torchft's HTTP checkpoint transport) and contributes zero gradients in that step.

Progress rows (JSON lines, as ``fthsdp.examples.train`` writes them): ``{"event": "step", "step", "t",
"incarnation", "joined", "loss", "step_s", "participants"}`` per committed step, ``{"event": "final",
"param_hash"}`` at the end (parameters and AdamW state, bitwise).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import pathlib
import signal
import socket
import sys
import time
from datetime import timedelta
from typing import Any

import torch

from fthsdp.examples.data import batch
from fthsdp.examples.gpt import GPT, GPTConfig
from fthsdp.runtime.state import local_tensor


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="fthsdp.bench.baselines.torchft_train")
    p.add_argument("--replica-index", type=int, required=True, help="this group's index: its data slot")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--model", default="reference")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress", required=True)
    p.add_argument("--incarnation", type=int, default=1)
    p.add_argument("--kill-step", type=int, default=-1, help="SIGKILL this group (agent too) at this step")
    p.add_argument("--timeout", type=float, default=5.0,
                   help="torchft Manager and Gloo timeout (collectives, should_commit, checkpoint transfer), s")
    p.add_argument("--quorum-timeout", type=float, default=60.0)
    p.add_argument("--min-replicas", type=int, default=2, help="Manager min_replica_size")
    p.add_argument("--barrier", default="", help="directory: write ready-INDEX, wait for 'go' before step 0")
    return p.parse_args(argv)


def _loopback_manager_server() -> None:
    """torchft's Manager binds its gRPC server on ``[::]``; keep it on loopback (nothing else changes)."""
    import torchft.manager as tm

    real = tm.ManagerServer

    def on_loopback(**kw: Any) -> Any:
        kw["bind"] = "127.0.0.1:" + kw["bind"].rsplit(":", 1)[1]
        return real(**kw)

    tm.ManagerServer = on_loopback  # type: ignore[assignment,misc]


def _barrier(directory: str, index: int, timeout: float = 600.0) -> None:
    d = pathlib.Path(directory)
    (d / f"ready-{index}").touch()
    end = time.monotonic() + timeout
    while not (d / "go").exists():
        if time.monotonic() > end:
            sys.exit(f"no 'go' in {d} within {timeout}s")
        time.sleep(0.01)  # polling a condition with a deadline


def _state_hash(params: list[torch.nn.Parameter], opt: torch.optim.Optimizer) -> str:
    """SHA-256 of this rank's parameters and AdamW state (its shards under FSDP2), byte for byte."""
    h = hashlib.sha256()
    for p in params:
        h.update(local_tensor(p.detach()).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        for v in opt.state.get(p, {}).values():
            if isinstance(v, torch.Tensor):
                h.update(local_tensor(v.detach()).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class _LocalState:
    """What a healing rank fetches from the same rank of a live group: its parameter shards and their AdamW
    state as plain tensors. Read from the sharded parameters captured after ``fully_shard`` (FSDP2 swaps
    unsharded ones into the module during forward, when torchft's asynchronous quorum may serve them; these only
    change in the optimizer step), never from ``model.state_dict()`` (docs/design.md §10)."""

    def __init__(self, params: list[torch.nn.Parameter], opt: torch.optim.Optimizer) -> None:
        self.params, self.opt = params, opt

    def state_dict(self) -> dict[str, Any]:
        return {"params": [local_tensor(p.detach()) for p in self.params],
                "optim": [{k: local_tensor(v) if isinstance(v, torch.Tensor) else v
                           for k, v in self.opt.state.get(p, {}).items()} for p in self.params]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            for p, t, st in zip(self.params, sd["params"], sd["optim"], strict=True):
                local_tensor(p.detach()).copy_(t)
                mine = self.opt.state[p]
                for k, v in st.items():
                    if not isinstance(v, torch.Tensor):
                        mine[k] = v
                    elif k in mine:
                        local_tensor(mine[k]).copy_(v)
                    elif isinstance(p, DTensor) and v.dim() > 0:  # shaped like the parameter's shard
                        mine[k] = DTensor.from_local(v.clone(), p.device_mesh, p.placements, run_check=False,
                                                     shape=p.shape, stride=p.stride())
                    else:
                        mine[k] = v.clone()


def _model(cfg: GPTConfig, seed: int) -> tuple[GPT, int, int]:
    """The group's model, this rank's index in the group and the group's size: the plain module on one rank,
    FSDP2 over the group's ranks on several (every group starts from the same weights, so ``init_sync=False``)."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        torch.manual_seed(seed)
        return GPT(cfg), 0, 1
    from fthsdp.examples.hsdp import plain_hsdp

    job = plain_hsdp(cfg, seed, 1)  # one replica per torchrun: FSDP2 over this group's ranks
    return job.model, job.shard_rank, job.shards


def _group_hash(mine: str, shards: int) -> str:
    """One hash for the group's whole state: its ranks' hashes in rank order, hashed."""
    if shards == 1:
        return mine
    import torch.distributed as dist

    every: list[str] = [""] * shards
    dist.all_gather_object(every, mine)
    return hashlib.sha256("".join(every).encode()).hexdigest()


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=os.environ.get("FTHSDP_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    torch.set_num_threads(1)
    a = _args(argv)
    from torchft import Manager, ProcessGroupGloo

    _loopback_manager_server()
    cfg = GPTConfig.named(a.model)
    model, srank, shards = _model(cfg, a.seed)
    params = list(model.parameters())  # the sharded parameters under FSDP2 (see _LocalState)
    opt = torch.optim.AdamW(params, lr=a.lr)
    local = _LocalState(params, opt)
    timeout = timedelta(seconds=a.timeout)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=local.load_state_dict,
                      state_dict=local.state_dict, min_replica_size=a.min_replicas,
                      replica_id=f"torchft_{a.replica_index}", timeout=timeout,
                      quorum_timeout=timedelta(seconds=a.quorum_timeout), init_sync=False, hostname="127.0.0.1")
    progress = open(a.progress, "a", buffering=1) if srank == 0 else None  # noqa: SIM115 (written to until exit)

    def write(**kv: Any) -> None:
        if progress is not None:
            progress.write(json.dumps({"replica": a.replica_index, "incarnation": a.incarnation, "mode": "torchft",
                                       **kv, "t": time.time()}) + "\n")

    write(event="start", pid=os.getpid(), host=socket.gethostname())
    if a.barrier:
        _barrier(a.barrier, a.replica_index)
    sizes = [local_tensor(p.detach()).numel() for p in params]
    while manager.current_step() < a.steps:
        t0 = time.perf_counter()
        manager.start_quorum()
        step = manager.current_step()  # a healing group learns its real step at the quorum: it trains nothing
        if 0 <= a.kill_step <= step:
            write(event="kill", step=step)
            if "TORCHELASTIC_RUN_ID" in os.environ:
                os.kill(os.getppid(), signal.SIGKILL)  # the agent: the whole group dies, as a lost host would
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad(set_to_none=False)
        loss = model.loss(batch(a.seed, step, a.replica_index, srank, a.batch // shards, cfg.seq_len, cfg.vocab))
        loss.backward()  # under FSDP2: reduce-scattered over the group's ranks, each keeps its shard
        grads = [local_tensor(p.grad) for p in params]  # type: ignore[arg-type]
        flat = torch.cat([g.reshape(-1) for g in grads])
        manager.allreduce(flat).wait()  # averaged over participants; zeros from a healing group
        healing = manager._healing  # torchft has no public accessor; True in the step a group heals
        participants = manager.num_participants()
        if manager.should_commit():  # applies a healing group's received state first
            for g, avg in zip(grads, flat.split(sizes), strict=True):
                g.copy_(avg.view_as(g))
            opt.step()
            write(event="step", step=manager.current_step() - 1, joined=healing, participants=participants,
                  loss=None if healing else float(loss.item()), step_s=time.perf_counter() - t0)
    write(event="final", step=manager.current_step(), param_hash=_group_hash(_state_hash(params, opt), shards))
    if progress is not None:
        progress.close()
    manager.shutdown(wait=False)
    if shards > 1:
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main()
