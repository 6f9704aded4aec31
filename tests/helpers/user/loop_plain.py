"""An ordinary FSDP2 trainer, the "before" of docs/trainer-guide.md: a map-style dataset behind a DataLoader with
a DistributedSampler and worker processes, gradient accumulation over micro-batches, gradient clipping, warm-up +
cosine through LambdaLR, bf16 autocast, an eval every 10 steps and a loss all-reduced for the log. Run it with
``torchrun --nproc-per-node 2 loop_plain.py --out DIR``; ``loop_fthsdp.py`` is the same trainer under fthsdp."""

import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, Dataset, DistributedSampler

ACCUM = 2  # micro-batches per step


class Tokens(Dataset):
    """Item i: (i, a sequence of tokens seeded by i) — the index lets a test check what was trained."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return i, torch.randint(0, 64, (17,), generator=g)


class Net(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(depth))
        self.head = nn.Linear(dim, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        for block in self.blocks:
            x = x + block(x)
        return nn.functional.cross_entropy(self.head(x).float().flatten(0, 1), tokens[:, 1:].flatten())


def warmup_cosine(total: int, warmup: int = 5):
    return lambda s: (s + 1) / warmup if s < warmup else 0.5 * (1 + math.cos(math.pi * (s - warmup) / total))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", required=True)
    p.add_argument("--pace", type=float, default=0.0, help="seconds of sleep per step")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (world,))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.steps))
    data = Tokens()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=0)
    batches = iter(DataLoader(data, batch_size=4, sampler=sampler, num_workers=2, persistent_workers=True))
    log = open(os.path.join(args.out, f"steps-{rank}.jsonl"), "a")  # noqa: SIM115 - the run's lifetime
    for step in range(args.steps):
        opt.zero_grad()
        trained, total = [], torch.zeros(())
        for micro in range(ACCUM):
            ids, tokens = next(batches)
            model.set_requires_gradient_sync(micro == ACCUM - 1)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(tokens) / ACCUM
            loss.backward()
            trained, total = trained + ids.tolist(), total + loss.detach()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        sched.step()
        if step % 10 == 0:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                model(torch.stack([data[i][1] for i in range(8)]))  # an eval on held-out batches
        dist.all_reduce(total)
        log.write(json.dumps({"step": step, "ids": trained, "loss": total.item() / world, "norm": norm.item(),
                              "lr": sched.get_last_lr()[0]}) + "\n")
        log.flush()
        time.sleep(args.pace)  # stands in for more compute per step
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
