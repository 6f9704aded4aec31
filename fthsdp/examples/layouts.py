"""The example GPT as a replica that is not a flat FSDP2 group (docs/design.md §3b), built the same way under
fthsdp and for the plain HSDP baseline (``fthsdp bench overhead --layout``):

- ``tp2``: tensor parallelism over 2 ranks (every block's MLP colwise then rowwise; attention, embeddings and head
  replicated over them) and FSDP2 over the rest, on a ``(dp, tp)`` mesh;
- ``pp2``: 2 pipeline stages (the first half of the blocks with the embeddings, the second with the head), 1F1B over
  4 micro-batches, FSDP2 inside each stage over the rest, on a ``(pp, dp)`` mesh.

The model-parallel ranks of one data-parallel rank read the same batch. A stage keeps the whole model's names
(``blocks.3.qkv.weight`` wherever it lives), so checkpoints of every stage share one namespace."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fthsdp.examples.gpt import GPT, GPTConfig

LAYOUTS = ("fsdp", "tp2", "pp2")
"""``fsdp``: FSDP2 over the replica's ranks (the example's default, ``Replica.shard``); the others above."""
PP_MICRO = 4
"""Micro-batches of a pipeline step."""


def dims(layout: str) -> tuple[str, str]:
    """The replica mesh's dimension names, outer first."""
    return ("pp", "dp") if layout == "pp2" else ("dp", "tp")


def mesh_for(layout: str, ranks: int, replicas: int = 0) -> DeviceMesh:
    """The mesh of a replica of ``ranks`` ranks (``replicas`` > 0: the plain baseline's whole job, a ``replicate``
    dimension first). Raises ``ValueError`` when the ranks do not split in 2."""
    if layout not in LAYOUTS[1:]:
        raise ValueError(f"layout must be one of {', '.join(LAYOUTS[1:])} here, got {layout!r}")
    if ranks % 2:
        raise ValueError(f"layout {layout} needs an even number of ranks per replica, got {ranks}")
    shape = (2, ranks // 2) if layout == "pp2" else (ranks // 2, 2)
    if replicas:
        return init_device_mesh("cpu", (replicas, *shape), mesh_dim_names=("replicate", *dims(layout)))
    return init_device_mesh("cpu", shape, mesh_dim_names=dims(layout))


class Stage(nn.Module):
    """Blocks ``[lo, hi)`` of ``gpt``, with the embeddings on the first stage and the final norm and head on the last,
    under their names in the whole model."""

    def __init__(self, gpt: GPT, lo: int, hi: int) -> None:
        super().__init__()
        first, last = lo == 0, hi == len(gpt.blocks)
        self.tok: nn.Embedding | None = gpt.tok if first else None
        self.pos: nn.Embedding | None = gpt.pos if first else None
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in range(lo, hi)})
        self.ln: nn.LayerNorm | None = gpt.ln if last else None
        self.head: nn.Linear | None = gpt.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok is not None and self.pos is not None:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln(x)) if self.head is not None and self.ln is not None else x


def _loss(logits: torch.Tensor, target: torch.Tensor, scale: float) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1)) * scale


@dataclass
class Built:
    """This rank's part of a replica of a layout."""

    model: nn.Module
    """The modules this rank holds, sharded: what the optimizer and ``ft.optimizer(model=...)`` take."""
    data_rank: int
    data_ranks: int
    """This rank's place among the replica's data-parallel ranks (the batch is split over those)."""
    train: Callable[[torch.Tensor], torch.Tensor]
    """Forward and backward of a batch of sequences: the loss (a pipeline's last stage's, on every stage)."""


def build(gpt: GPT, layout: str, mesh: DeviceMesh, shard_dims: tuple[str, ...]) -> Built:
    """``gpt`` laid out on ``mesh`` (``mesh_for``), sharded with FSDP2 over ``mesh[shard_dims]``."""
    shard = mesh[shard_dims]
    dp = mesh["dp"]
    rank, ranks = dp.get_local_rank(), dp.size()
    assert isinstance(rank, int)
    if layout == "tp2":
        for block in gpt.blocks:
            parallelize_module(block, mesh["tp"], {"mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()})
            fully_shard(block, mesh=shard)
        fully_shard(gpt, mesh=shard)

        def train_tp(tokens: torch.Tensor) -> torch.Tensor:
            loss = gpt.loss(tokens)
            loss.backward()
            return loss.detach()

        return Built(gpt, rank, ranks, train_tp)
    pp = mesh["pp"]
    index, half = pp.get_local_rank(), len(gpt.blocks) // 2
    assert isinstance(index, int)
    stage = Stage(gpt, 0, half) if index == 0 else Stage(gpt, half, len(gpt.blocks))
    for block in stage.blocks.values():
        fully_shard(block, mesh=shard)
    fully_shard(stage, mesh=shard)
    # The loss is scaled for the micro-batches (scale_grads=False): docs/design.md §3b.
    schedule = Schedule1F1B(PipelineStage(stage, index, 2, torch.device("cpu"), group=pp.get_group()), PP_MICRO,
                            loss_fn=functools.partial(_loss, scale=1 / PP_MICRO), scale_grads=False)

    def train_pp(tokens: torch.Tensor) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        if index == 0:
            schedule.step(tokens[:, :-1])
        else:
            schedule.step(target=tokens[:, 1:], losses=losses)
        loss = torch.stack(losses).detach().sum() if losses else torch.zeros(())
        dist.all_reduce(loss, group=pp.get_group())  # the last stage's, on every stage (for the log)
        return loss

    return Built(stage, rank, ranks, train_pp)


def layout_gpt(cfg: GPTConfig, seed: int, layout: str, mesh: DeviceMesh, shard_dims: tuple[str, ...]) -> Built:
    """The seeded example GPT (the same weights on every replica) laid out on ``mesh``."""
    torch.manual_seed(seed)
    return build(GPT(cfg), layout, mesh, shard_dims)
