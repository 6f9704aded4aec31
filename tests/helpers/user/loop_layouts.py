"""A trainer whose replica is not a flat FSDP2 group (issue 36): ``--layout tp2xfsdp2`` builds each replica as a
2-D device mesh, tensor parallelism (``torch.distributed.tensor.parallel``, a colwise/rowwise MLP per block) over
``tp`` and FSDP2 over ``dp``. It keeps its loop under fthsdp (``fthsdp run --replicas R --ranks 4 loop_layouts.py
--out DIR``), or with ``--plain-replicas R`` under torchrun alone it is the same training on plain PyTorch HSDP of
the same layout (a ``(replicate, dp, tp)`` mesh, FSDP2 over ``replicate`` × ``dp``): the golden baseline. Both
read exactly the batches ``fthsdp.runtime.loop.indices_of`` names for (slot, step, data rank), so their per-rank
losses compare step by step. Each rank appends one JSON line per iteration to ``steps-...jsonl`` in ``--out``."""

import argparse
import json
import os
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, Sampler

ACCUM, BATCH, ITEMS, SEED = 2, 4, 4096, 0


class Tokens(Dataset):
    """Item i: (i, a sequence of tokens seeded by i) — the index lets a test check what was trained."""

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        return i, torch.randint(0, 64, (17,), generator=g)


class Net(nn.Module):
    def __init__(self, dim: int = 32, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                                    for _ in range(depth))
        self.head = nn.Linear(dim, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        for block in self.blocks:
            x = x + block(x)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), tokens[:, 1:].flatten())


def build(mesh: DeviceMesh, fsdp_dims: tuple[str, ...]) -> Net:
    """The model, tensor-parallel over ``mesh["tp"]`` and sharded with FSDP2 over ``mesh[fsdp_dims]``."""
    torch.manual_seed(SEED)
    model = Net()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    shard_mesh = mesh[fsdp_dims]
    for block in model.blocks:
        fully_shard(block, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    return model


class StepBatches(Sampler[list[int]]):
    """Plain training's batches: the ones the slot loader names for (slot, step, data rank, micro)."""

    def __init__(self, slot: int, slots: int, rank: int, ranks: int, steps: int) -> None:
        from fthsdp.runtime.data import SlotSampler
        from fthsdp.runtime.loop import indices_of
        sampler = SlotSampler(ITEMS, BATCH, seed=SEED)
        self.batches = [list(indices_of(sampler, slot, step, rank, micro, slots=slots, ranks=ranks,
                                        micro_batches=ACCUM)) for step in range(steps) for micro in range(ACCUM)]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", required=True)
    p.add_argument("--layout", default="tp2xfsdp2", choices=("tp2xfsdp2",))
    p.add_argument("--plain-replicas", type=int, default=0, help="plain PyTorch HSDP over this many replicas")
    p.add_argument("--pace", type=float, default=0.0, help="seconds of sleep per step")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.plain_replicas:
        mesh = init_device_mesh("cpu", (args.plain_replicas, world // args.plain_replicas // 2, 2),
                                mesh_dim_names=("replicate", "dp", "tp"))
        model = build(mesh, ("replicate", "dp"))
        slot, slots = mesh["replicate"].get_local_rank(), args.plain_replicas
        batches: Iterator = iter(DataLoader(Tokens(), batch_sampler=StepBatches(
            slot, slots, mesh["dp"].get_local_rank(), mesh["dp"].size(), args.steps)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        name, steps, ft = f"steps-plain-{rank}.jsonl", iter(range(args.steps)), None
    else:
        import fthsdp.runtime
        ft = fthsdp.runtime.init()
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        model = build(mesh, ("dp",))
        opt = ft.optimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), model=model)
        batches = ft.dataloader(Tokens(), batch_size=BATCH, micro_batches=ACCUM, mesh=mesh["dp"], seed=SEED)
        name, steps = f"steps-{ft.slot}-{ft.incarnation}-{rank}.jsonl", ft.steps(args.steps)
    log = open(os.path.join(args.out, name), "a")  # noqa: SIM115 - the run's lifetime
    for step in steps:
        opt.zero_grad()
        trained, total = [], 0.0
        for micro in range(ACCUM):
            ids, tokens = next(batches)
            model.set_requires_gradient_sync(micro == ACCUM - 1)
            loss = model(tokens) / ACCUM
            loss.backward()
            trained, total = trained + ids.tolist(), total + loss.item()
        r = opt.step()
        done = step if ft is None else r and r.step
        log.write(json.dumps({"step": done, "ids": trained, "loss": total, "rank": rank,
                              "dp": mesh["dp"].get_local_rank(), "tp": mesh["tp"].get_local_rank()}) + "\n")
        log.flush()
        time.sleep(args.pace)  # stands in for more compute per step
    if ft is None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
