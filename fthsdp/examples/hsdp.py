"""Plain FSDP2-HSDP over every rank of one job (torch's replicate x shard mesh, no fault tolerance): the model
setup and the final hash of the baselines that run without fthsdp (the example trainer's ``--plain`` mode and the
whole-job-restart baseline), written once."""

from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from fthsdp.examples.gpt import GPT, GPTConfig
from fthsdp.runtime.state import local_tensor


@dataclass(frozen=True)
class PlainHSDP:
    """This rank's place in the job and its sharded model."""

    model: GPT
    slot: int
    """The replica (row of the mesh) this rank belongs to: its data slot."""
    shard_rank: int
    shards: int
    """Ranks per replica."""


def seeded_gpt(cfg: GPTConfig, seed: int) -> GPT:
    """The model every replica starts from: the same weights everywhere."""
    torch.manual_seed(seed)
    return GPT(cfg)


def plain_hsdp(cfg: GPTConfig, seed: int, replicas: int) -> PlainHSDP:
    """Join the job's Gloo group and shard a freshly seeded model over ``replicas`` x (world / replicas) ranks (one
    replica: plain FSDP2 over every rank)."""
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % replicas:
        sys.exit(f"world size {world} is not a multiple of --hsdp-replicas {replicas}")
    shards = world // replicas
    if replicas > 1:
        mesh = init_device_mesh("cpu", (replicas, shards), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (shards,))
    model = seeded_gpt(cfg, seed)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return PlainHSDP(model, rank // shards, rank % shards, shards)


def local_param_hash(model: torch.nn.Module) -> str:
    """SHA-256 of this rank's parameter shards, byte for byte."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(local_tensor(p.detach()).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
