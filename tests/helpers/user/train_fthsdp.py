"""``train_plain.py`` under fthsdp, changed as the README says (the "after"; run it with ``fthsdp run``): each
replica group trains its own data slot and survives the others' deaths; the runtime steps the scheduler."""

import argparse
import json
import os
import time

import torch
from torch import nn

import fthsdp.runtime


class MLP(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def loss_on(model: nn.Module, index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(index)
    x = torch.randn(8, 32, generator=g)
    return nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))


def train(args: argparse.Namespace, ft: fthsdp.runtime.Replica) -> None:
    torch.manual_seed(0)
    model = MLP()
    model = ft.shard(model, blocks=model.blocks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    ft.optimizer(opt, scheduler=sched)
    log = open(os.path.join(args.out, f"lr-{os.environ.get('FTHSDP_REPLICA_INDEX', '0')}.jsonl"), "a")  # noqa: SIM115 - the run's lifetime
    while ft.step < args.steps:
        step = ft.train_step(lambda: loss_on(model, fthsdp.runtime.next_batch(ft))).step
        if ft.rank == 0:
            log.write(json.dumps({"step": step, "lr": sched.get_last_lr()[0]}) + "\n")
            log.flush()
        time.sleep(args.pace)  # stands in for more compute per step


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--out", required=True)
    p.add_argument("--pace", type=float, default=0.0, help="seconds of sleep per step")
    args = p.parse_args()
    torch.set_num_threads(1)
    with fthsdp.runtime.training() as ft:
        train(args, ft)


if __name__ == "__main__":
    main()
