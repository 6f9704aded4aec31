"""This rank's share of the state that every replica holds bitwise equal at a commit: its parameter shards and
optimizer-state tensors (their layout and names), the data cursors, and the trainer state (the optimizer's
param groups and the registered objects' state, ``fthsdp.runtime.trainer_state``), plus the RNG that travels
with them. A snapshot for joiners, loading one (creating the optimizer state it needs), the optimizer step, and
the digest that tells whether two replicas are equal."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ftar.devices import record, side_stream, wait_for
from fthsdp.runtime import trainer_state
from fthsdp.runtime.errors import StateMismatch
from fthsdp.runtime.trainer_state import TrainerState

DIGEST = "state/digest"
"""The snapshot entry holding the source's digest of the snapshot (RNG included)."""


@dataclass(frozen=True)
class Boundary:
    """What ``ShardState.boundary`` takes at a commit boundary for a snapshot of the coming step."""

    pairs: list[tuple[str, torch.Tensor]]
    """The data cursors, the trainer state (JSON bytes) and the RNG state, in ``ShardState.pairs`` order."""
    ready: Any = None
    """On a GPU: recorded on the training thread's stream at the boundary, after the update that made the state."""


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (``t`` itself when it is not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def bind_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    """Make ``g`` (shaped like ``p``'s local shard) ``p``'s gradient, without a copy. FSDP2's gradient DTensor is
    kept and its local tensor swapped, as FSDP2 itself accumulates into it (``DTensor.from_local`` per parameter
    would cost more CPU than the copy it saves)."""
    grad = p.grad
    if isinstance(grad, DTensor):
        local = grad._local_tensor
        if (local.shape, local.stride(), local.dtype, local.device) == (g.shape, g.stride(), g.dtype, g.device):
            grad._local_tensor = g
            return
    with torch.no_grad():
        p.grad = DTensor.from_local(g, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                    stride=p.stride()) if isinstance(p, DTensor) else g.view_as(p)


class ShardState:
    """The sharded parameters (captured once sharded: FSDP2 swaps unsharded ones in during forward and backward,
    but these objects, which the optimizer holds, only change in the optimizer step) and their optimizer."""

    def __init__(self, params: Sequence[nn.Parameter], opt: torch.optim.Optimizer, device: torch.device,
                 state: TrainerState) -> None:
        self.params = list(params)
        self.opt = opt
        self.device = device
        self.state = state
        self.marked = Boundary([])
        """The side state of the coming step's snapshot, taken at its commit boundary (``mark``)."""

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

    def layout(self) -> tuple[list[tuple[str, str, tuple[int, ...]]], int]:
        """What a snapshot for this rank may be: its parameter entries exactly as here (name, dtype, shape), and
        at most this many bytes (the parameters eight times over, for the optimizer's state, plus 64 MiB for the
        rest): a joiner refuses a bigger or different one before it allocates anything."""
        params = [(n, str(t.dtype), tuple(t.shape)) for n, t in self.tensors() if n.startswith("param/")]
        size = sum(local_tensor(p.detach()).numel() * p.element_size() for p in self.params)
        return params, 8 * size + (64 << 20)

    def rng(self) -> list[tuple[str, torch.Tensor]]:
        """This process's RNG state (CPU, and CUDA on a GPU)."""
        out = [("rng/cpu", torch.get_rng_state())]
        if self.device.type == "cuda":
            out.append(("rng/cuda", torch.cuda.get_rng_state()))
        return out

    def pairs(self, cursors: torch.Tensor, rng: bool) -> list[tuple[str, torch.Tensor]]:
        """Everything the digest covers, in order: the tensors, the data cursors, the trainer state (JSON bytes),
        and with ``rng`` the RNG state."""
        doc = bytearray(self.state.encode(self.opt))
        out = [*self.tensors(), ("data/cursors", cursors),
               ("state/json", torch.frombuffer(doc, dtype=torch.uint8))]
        return out + self.rng() if rng else out

    def boundary(self, cursors: torch.Tensor) -> Boundary:
        """What a snapshot of the coming step takes as of its commit boundary (the training thread calls this
        there): the data cursors, the trainer state and the RNG state, which the step's forward may move; on a GPU,
        an event after the work queued so far (the update that made the state). The parameter and
        optimizer-state shards stand still until the step's optimizer update."""
        ready = record(self.device)
        doc = bytearray(self.state.encode(self.opt))
        return Boundary([("data/cursors", cursors.clone()), ("state/json", torch.frombuffer(doc, dtype=torch.uint8)),
                         *self.rng()], ready)

    def mark(self, cursors: torch.Tensor) -> None:
        """At an active replica's commit boundary: keep ``boundary(cursors)`` for a snapshot of the coming step."""
        self.marked = self.boundary(cursors)

    def snapshot(self, boundary: Boundary | None = None) -> list[tuple[str, torch.Tensor]]:
        """A copy of everything a joiner needs, on the CPU, in ``pairs`` order: the shards copied now, the rest as
        ``boundary`` took it (by default the last ``mark``). Runs on a snapshot thread
        (``fthsdp.catchup.server``) between that boundary and the step's optimizer update; on a GPU, on a stream
        of that thread's own, after ``boundary.ready``, so the training thread's kernels go on meanwhile.
        ``seal`` adds the digest, once the update may run."""
        boundary = boundary if boundary is not None else self.marked
        if boundary.ready is not None:  # this thread's copies on a stream of its own, after the update's kernels
            side_stream(self.device)
            wait_for(boundary.ready)
        # Into pageable host memory: each copy returns once it is done.
        return [(name, t.detach().to("cpu", copy=True).contiguous()) for name, t in [*self.tensors(), *boundary.pairs]]

    @staticmethod
    def seal(copies: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """``copies`` with their digest (``DIGEST``, RNG included), which a joiner checks once it loaded them."""
        return [*copies, (DIGEST, torch.frombuffer(bytearray(digest_of(copies)), dtype=torch.uint8))]

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
        (shaped like ``cursors``, this job's). The trainer state and cursors are checked before anything changes."""
        if "state/json" not in tensors:
            raise StateMismatch("the source's snapshot has no trainer state (param groups, registered objects)")
        doc = self.state.parse(self.opt, tensors["state/json"].numpy().tobytes())
        theirs_cursors = tensors.get("data/cursors")
        if theirs_cursors is None or theirs_cursors.shape != cursors.shape:
            raise StateMismatch(f"the source has data cursors "
                                f"{None if theirs_cursors is None else list(theirs_cursors.shape)}, this job "
                                f"{list(cursors.shape)} (FTHSDP_NUM_REPLICAS must match)")
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
        self.state.apply(self.opt, doc)
        self.load_rng(tensors)
        return theirs_cursors.clone()

    def load_rng(self, tensors: Mapping[str, torch.Tensor]) -> None:
        if "rng/cpu" in tensors:
            torch.set_rng_state(tensors["rng/cpu"])
        if "rng/cuda" in tensors and self.device.type == "cuda":
            torch.cuda.set_rng_state(tensors["rng/cuda"])

    def side_state(self) -> bytes:
        """What a checkpoint keeps beside DCP's tensors, per rank: the trainer state and the RNG (JSON)."""
        return trainer_state.encode({"state": self.state.encode(self.opt), "rng": dict(self.rng())})

    def load_side_state(self, data: bytes) -> None:
        """Apply ``side_state`` read back from a checkpoint."""
        doc = trainer_state.decode(data)
        if not isinstance(doc, dict) or not isinstance(doc.get("state"), bytes) or not isinstance(doc.get("rng"),
                                                                                                dict):
            raise StateMismatch("the checkpoint's trainer state lacks 'state' or 'rng'")
        self.state.apply(self.opt, self.state.parse(self.opt, doc["state"]))
        self.load_rng(doc["rng"])

    def optimizer_step(self, lr_factor: float) -> None:
        """The optimizer step with every group's learning rate scaled by ``lr_factor`` (then restored: a
        scheduler may own them), then the registered on-commit hooks (a scheduler's ``step``)."""
        base = [group["lr"] for group in self.opt.param_groups]
        for group, lr in zip(self.opt.param_groups, base, strict=True):
            group["lr"] = lr * lr_factor
        try:
            self.opt.step()
        finally:
            for group, lr in zip(self.opt.param_groups, base, strict=True):
                group["lr"] = lr
        self.state.on_commit()

    def flip_bit(self) -> None:
        """Test hook (``FTHSDP_FAULT_CORRUPT``): flip the lowest bit of the first byte of the first parameter
        shard, silently, as corrupted memory would."""
        with torch.no_grad():
            raw = local_tensor(self.params[0].detach()).view(-1).view(torch.uint8)
            raw[0] = raw[0] ^ 1

    def digest(self, cursors: torch.Tensor, rng: bool = False) -> bytes:
        """SHA-256 over this rank's parameter and optimizer-state shards, the data cursors and the trainer state
        (with ``rng``, the RNG state too: only a snapshot's digest covers it, see docs/design.md §7)."""
        return digest_of(self.pairs(cursors, rng))


def digest_of(pairs: Iterable[tuple[str, torch.Tensor]]) -> bytes:
    """SHA-256 over names and raw bytes, in order (every byte: a sample would miss most corruption)."""
    h = hashlib.sha256()
    for name, t in pairs:
        h.update(name.encode())
        t = t.detach().cpu().contiguous()
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.digest()


def replica_hash(digest: bytes, world_size: int, device: torch.device) -> str:
    """SHA-256 over every rank's ``digest`` (a collective over the replica's ranks): equal across replicas
    exactly when their states are bitwise equal."""
    mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(device)
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    return hashlib.sha256(b"".join(bytes(g.cpu().tolist()) for g in gathered)).hexdigest()
