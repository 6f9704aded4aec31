"""A trainer whose replica is not a flat FSDP2 group (issue 36): ``--layout tp2xfsdp2`` builds each replica as a
2-D device mesh, tensor parallelism (``torch.distributed.tensor.parallel``, a colwise/rowwise MLP per block) over
``tp`` and FSDP2 over ``dp``. It keeps its loop under fthsdp (``fthsdp run --replicas R --ranks 4 loop_layouts.py
--out DIR``), or with ``--plain-replicas R`` under torchrun alone it is the same training on plain PyTorch HSDP of
the same layout (a ``(replicate, dp, tp)`` mesh, FSDP2 over ``replicate`` × ``dp``): the golden baseline. Both
read exactly the batches ``fthsdp.runtime.loop.indices_of`` names for (slot, step, data rank), so their per-rank
losses compare step by step. Each rank appends one JSON line per iteration to ``steps-...jsonl`` in ``--out``."""

import argparse
import functools
import json
import os
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, Sampler

ACCUM, BATCH, ITEMS, SEED, PP_MICRO = 2, 4, 4096, 0, 4


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


class Stage(nn.Module):
    """The layers of one pipeline stage of a ``depth``-block model, under their names in the whole model (so a
    checkpoint's keys are the same whoever holds them): the embedding on the first, the head on the last."""

    def __init__(self, index: int, stages: int, dim: int = 32) -> None:
        super().__init__()
        torch.manual_seed(SEED)
        whole = [nn.Embedding(64, dim), *(nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
                                          for _ in range(stages)), nn.Linear(dim, 64)]
        self.embed = whole[0] if index == 0 else None
        self.blocks = nn.ModuleDict({str(index): whole[1 + index]})
        self.head = whole[-1] if index == stages - 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks.values():
            x = x + block(x)
        return self.head(x) if self.head is not None else x


def token_loss(logits: torch.Tensor, target: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten()) * scale


class Pipeline:
    """This rank's stages of a ``pp``-rank pipeline with ``virtual`` stages per rank (1: 1F1B; more: interleaved
    1F1B, rank p holding stages p, p + pp, ...), each sharded with FSDP2 over ``mesh[fsdp_dims]``."""

    def __init__(self, mesh: DeviceMesh, fsdp_dims: tuple[str, ...], virtual: int, microbatches: int) -> None:
        pp = mesh["pp"]
        rank, size = pp.get_local_rank(), pp.size()
        total = size * virtual
        self.indices = [rank + v * size for v in range(virtual)]
        self.modules = [Stage(i, total) for i in self.indices]
        for m in self.modules:
            fully_shard(m, mesh=mesh[fsdp_dims])
        stages = [PipelineStage(m, i, total, torch.device("cpu"), group=pp.get_group())
                  for m, i in zip(self.modules, self.indices, strict=True)]
        self.first, self.last = 0 in self.indices, total - 1 in self.indices
        # The loss is scaled for the micro-batches, not the gradients (scale_grads=False): an interleaved schedule
        # scales each stage's gradients as soon as that stage is reduced, before the others' exchange settled.
        loss = functools.partial(token_loss, scale=1 / microbatches)
        self.schedule = (Schedule1F1B(stages[0], microbatches, loss_fn=loss, scale_grads=False) if virtual == 1 else
                         ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss, scale_grads=False))
        self.model = self.modules[0] if virtual == 1 else nn.ModuleList(self.modules)

    def train(self, tokens: torch.Tensor) -> float:
        """One step's forward and backward over the pipeline: the last stage's loss (0 elsewhere)."""
        losses: list[torch.Tensor] = []
        args = (tokens[:, :-1],) if self.first else ()
        if self.last:
            self.schedule.step(*args, target=tokens[:, 1:], losses=losses)
        else:
            self.schedule.step(*args)
        return float(torch.stack(losses).detach().sum()) if losses else 0.0


class StepBatches(Sampler[list[int]]):
    """Plain training's batches: the ones the slot loader names for (slot, step, data rank, micro)."""

    def __init__(self, slot: int, slots: int, rank: int, ranks: int, steps: int, batch: int, accum: int) -> None:
        from fthsdp.runtime.data import SlotSampler
        from fthsdp.runtime.loop import indices_of
        sampler = SlotSampler(ITEMS, batch, seed=SEED)
        self.batches = [list(indices_of(sampler, slot, step, rank, micro, slots=slots, ranks=ranks,
                                        micro_batches=accum)) for step in range(steps) for micro in range(accum)]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", required=True)
    p.add_argument("--layout", default="tp2xfsdp2", choices=("tp2xfsdp2", "pp2", "pp2v2"),
                   help="tp2xfsdp2: TP 2 x FSDP2; pp2: 2 pipeline stages, 1F1B; pp2v2: 2 ranks x 2 virtual stages, "
                   "interleaved 1F1B (FSDP2 inside every stage)")
    p.add_argument("--plain-replicas", type=int, default=0, help="plain PyTorch HSDP over this many replicas")
    p.add_argument("--pace", type=float, default=0.0, help="seconds of sleep per step")
    p.add_argument("--odd-layout", action="store_true", help="replica 1 builds another mesh (a test of the refusal)")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    pipelined = args.layout.startswith("pp")
    mp_dim = "pp" if pipelined else "tp"
    # Per step: ACCUM micro-batches of BATCH through a TP replica, one batch of ACCUM x BATCH split in PP_MICRO
    # micro-batches by the pipeline schedule.
    batch, accum = (BATCH * ACCUM, 1) if pipelined else (BATCH, ACCUM)
    dims = (mp_dim, "dp") if pipelined else ("dp", mp_dim)
    replicas = max(args.plain_replicas, 1)
    shape = (2, world // replicas // 2) if pipelined else (world // replicas // 2, 2)
    ft = None
    if args.plain_replicas:
        mesh = init_device_mesh("cpu", (replicas, *shape), mesh_dim_names=("replicate", *dims))
        shard_dims: tuple[str, ...] = ("replicate", "dp")
    else:
        import fthsdp.runtime
        if args.odd_layout and os.environ.get("FTHSDP_REPLICA_INDEX") == "1":
            shape = (world, 1)  # a test's mistake: this replica's mesh differs from the others'
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
        ft = fthsdp.runtime.init(mesh=mesh)  # the layout is registered: the job's replicas must all have it
        shard_dims = ("dp",)
    pipe = Pipeline(mesh, shard_dims, 2 if args.layout == "pp2v2" else 1, PP_MICRO) if pipelined else None
    model = pipe.model if pipe is not None else build(mesh, shard_dims)
    # SGD, whose step is as large as the gradient: a gradient scaled wrong would show in the losses (AdamW hides it)
    inner = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    if ft is None:
        slot = mesh["replicate"].get_local_rank()
        batches: Iterator = iter(DataLoader(Tokens(), batch_sampler=StepBatches(
            slot, replicas, mesh["dp"].get_local_rank(), mesh["dp"].size(), args.steps, batch, accum)))
        opt, name, steps = inner, f"steps-plain-{rank}.jsonl", iter(range(args.steps))
    else:
        opt = ft.optimizer(inner, model=model)
        batches = ft.dataloader(Tokens(), batch_size=batch, micro_batches=accum, mesh=mesh["dp"], seed=SEED)
        name, steps = f"steps-{ft.slot}-{ft.incarnation}-{rank}.jsonl", ft.steps(args.steps)
    log = open(os.path.join(args.out, name), "a")  # noqa: SIM115 - the run's lifetime
    for step in steps:
        opt.zero_grad()
        trained, total = [], 0.0
        for micro in range(accum):
            ids, tokens = next(batches)
            if pipe is not None:
                total = pipe.train(tokens)
            else:
                model.set_requires_gradient_sync(micro == accum - 1)
                loss = model(tokens) / accum
                loss.backward()
                total += loss.item()
            trained += ids.tolist()
        r = opt.step()
        done = step if ft is None else r and r.step
        log.write(json.dumps({"step": done, "ids": trained, "loss": total, "rank": rank,
                              "dp": mesh["dp"].get_local_rank(), "mp": mesh[mp_dim].get_local_rank()}) + "\n")
        log.flush()
        time.sleep(args.pace)  # stands in for more compute per step
    if ft is None:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
