"""This rank's share of the state that every replica holds bitwise equal at a commit: its parameter shards and
optimizer-state tensors (their layout and names), plus the data cursors and RNG that travel with them. A
snapshot for joiners, loading one (creating the optimizer state it needs), the optimizer step, and the hash
that tells whether two replicas are equal."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fthsdp.runtime.errors import StateMismatch


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (``t`` itself when it is not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


class ShardState:
    """The sharded parameters (captured once sharded: FSDP2 swaps unsharded ones in during forward and backward,
    but these objects, which the optimizer holds, only change in the optimizer step) and their optimizer."""

    def __init__(self, params: Sequence[nn.Parameter], opt: torch.optim.Optimizer, device: torch.device) -> None:
        self.params = list(params)
        self.opt = opt
        self.device = device

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, local tensor) of every parameter shard and optimizer-state tensor, in order. Optimizer-state
        names say whether the tensor is sharded like its parameter, so that a joiner can create it."""
        out = [(f"param/{i}", local_tensor(p.detach())) for i, p in enumerate(self.params)]
        for i, p in enumerate(self.params):
            for key, value in sorted(self.opt.state.get(p, {}).items()):
                if isinstance(value, torch.Tensor):
                    kind = "sharded" if isinstance(value, DTensor) else "plain"
                    out.append((f"optim/{i}/{key}/{kind}", local_tensor(value)))
        return out

    def snapshot(self, cursors: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """A copy of everything a joiner needs, on the CPU: taken by the training thread at a commit boundary."""
        out = [(name, t.detach().to("cpu", copy=True).contiguous()) for name, t in self.tensors()]
        out.append(("data/cursors", cursors.clone()))
        out.append(("rng/cpu", torch.get_rng_state()))
        if self.device.type == "cuda":
            out.append(("rng/cuda", torch.cuda.get_rng_state()))
        return out

    def _make_optimizer_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """On a joiner: create the optimizer-state tensors the source has and this rank lacks (zeros, same
        layout), so that loading can copy into them."""
        for name, t in tensors.items():
            parts = name.split("/")
            if parts[0] != "optim" or len(parts) != 4:
                continue
            try:
                p = self.params[int(parts[1])]
            except (ValueError, IndexError):
                raise StateMismatch(f"the source's optimizer state {name!r} has no parameter here") from None
            state = self.opt.state[p]
            if parts[2] not in state:
                if parts[3] == "sharded":
                    state[parts[2]] = torch.zeros_like(p.detach(), dtype=t.dtype)
                else:
                    state[parts[2]] = torch.zeros(t.shape, dtype=t.dtype)

    def load(self, tensors: Mapping[str, torch.Tensor], cursors: torch.Tensor) -> torch.Tensor:
        """Put a fetched snapshot into this rank's shards, optimizer state and RNG; returns its data cursors
        (shaped like ``cursors``, this job's)."""
        self._make_optimizer_state(tensors)
        mine = [(name, tuple(t.shape), str(t.dtype)) for name, t in self.tensors()]
        theirs = [(name, tuple(t.shape), str(t.dtype)) for name, t in tensors.items()
                  if name.startswith(("param/", "optim/"))]
        if mine != theirs:
            diff = next((f"{a} vs {b}" for a, b in zip(mine, theirs, strict=False) if a != b),
                        f"{len(mine)} vs {len(theirs)}")
            raise StateMismatch(f"joiner state layout differs from the source's (mine vs source: {diff}): same "
                                "model, shard count and optimizer needed")
        with torch.no_grad():
            for name, t in self.tensors():
                t.copy_(tensors[name])
        theirs_cursors = tensors.get("data/cursors")
        if theirs_cursors is None or theirs_cursors.shape != cursors.shape:
            raise StateMismatch(f"the source has data cursors "
                                f"{None if theirs_cursors is None else list(theirs_cursors.shape)}, this job "
                                f"{list(cursors.shape)} (FTHSDP_NUM_REPLICAS must match)")
        if "rng/cpu" in tensors:
            torch.set_rng_state(tensors["rng/cpu"])
        if "rng/cuda" in tensors and self.device.type == "cuda":
            torch.cuda.set_rng_state(tensors["rng/cuda"])
        return theirs_cursors.clone()

    def optimizer_step(self, lr_factor: float) -> None:
        """The optimizer step with every group's learning rate scaled by ``lr_factor`` (then restored: a
        scheduler may own them)."""
        base = [group["lr"] for group in self.opt.param_groups]
        for group, lr in zip(self.opt.param_groups, base, strict=True):
            group["lr"] = lr * lr_factor
        try:
            self.opt.step()
        finally:
            for group, lr in zip(self.opt.param_groups, base, strict=True):
                group["lr"] = lr

    def digest(self, cursors: torch.Tensor) -> bytes:
        """SHA-256 over this rank's parameter and optimizer-state shards and the data cursors."""
        h = hashlib.sha256()
        for name, t in [*self.tensors(), ("data/cursors", cursors)]:
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return h.digest()


def replica_hash(digest: bytes, world_size: int, device: torch.device) -> str:
    """SHA-256 over every rank's ``digest`` (a collective over the replica's ranks): equal across replicas
    exactly when their states are bitwise equal."""
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    return hashlib.sha256(b"".join(bytes(g.cpu().tolist()) for g in gathered)).hexdigest()
