"""A replica's self-check before it registers (docs/design.md §4, "A host that fails its self-check"): a short test of
its devices and its network, so that a host that came back broken is reported and kept out instead of let back to
slow everyone down or corrupt the state.

Every rank of the group, right after the replica's process group exists: an all-reduce over the group of known
values whose sum must come back exact, within ``timeout_s`` (the network, and every sibling alive); a matmul whose
result is known exactly (a device that computes wrong); and the matmul's throughput against
``FTHSDP_SELFCHECK_MIN_GFLOPS`` (a slow device; 0: not checked). The ranks agree on the verdict (one MAX
all-reduce), so all of them register or none does. A failed check raises ``Unhealthy``: the trainer exits with
``EXIT_UNHEALTHY`` (``fthsdp.runtime.session``) after writing the host and the reason to ``FTHSDP_BLOCKLIST`` (one
JSON line each), for a cluster's supervisor to keep the host out. The local launcher gives the group up on its
``unhealthy`` line (``fthsdp.launch.cluster``: not restarted, the others train on); it does not read the file.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from fthsdp.runtime.errors import Unhealthy

log = logging.getLogger("fthsdp.runtime")

SIZE = 256
"""The matmul's side."""
MATMUL_S = 0.05
"""How long the throughput is measured."""


@dataclass(frozen=True)
class Verdict:
    """What one rank's self-check found."""

    problems: tuple[str, ...]
    gflops: float
    """The matmul's throughput."""
    allreduce_s: float
    """The group's all-reduce round trip."""

    @property
    def ok(self) -> bool:
        return not self.problems


def _all_reduce(x: torch.Tensor, op: dist.ReduceOp.RedOpType, timeout_s: float) -> None:
    """``dist.all_reduce`` over the group, waited for at most ``timeout_s`` (``RuntimeError`` past it)."""
    work = dist.all_reduce(x, op=op, async_op=True)
    assert work is not None
    work.wait(timedelta(seconds=timeout_s))


def network(rank: int, world_size: int, device: torch.device, timeout_s: float) -> tuple[str | None, float]:
    """All-reduce ``rank + 1`` over the group: the sum must be exact within ``timeout_s``. (the problem, seconds)"""
    t0 = time.perf_counter()
    x = torch.full((1024,), float(rank + 1), device=device)
    try:
        _all_reduce(x, dist.ReduceOp.SUM, timeout_s)
    except RuntimeError as e:
        return f"network: the group's all-reduce failed: {str(e)[:200]}", time.perf_counter() - t0
    want = world_size * (world_size + 1) / 2
    if not bool((x == want).all()):
        return f"network: the group's all-reduce gave {x.min().item()}..{x.max().item()}, not {want}", \
            time.perf_counter() - t0
    return None, time.perf_counter() - t0


def compute(device: torch.device, min_gflops: float) -> tuple[str | None, float]:
    """A matmul with a known exact result, then its throughput for ``MATMUL_S``. (the problem, GFLOP/s)"""
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randint(-8, 8, (SIZE, SIZE), generator=g).to(device=device, dtype=torch.float32)
    if not torch.equal(torch.eye(SIZE, device=device) * 2 @ a, a * 2):
        return "device: a matmul with a known result came out wrong", 0.0
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < MATMUL_S or n < 2:
        b = a @ a
        n += 1
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # a start-up check, before the replica trains: no step waits for it
        elapsed = time.perf_counter() - t0
    del b
    gflops = n * 2 * SIZE**3 / max(elapsed, 1e-9) / 1e9
    if min_gflops and gflops < min_gflops:
        return f"device: {gflops:.1f} GFLOP/s, under FTHSDP_SELFCHECK_MIN_GFLOPS={min_gflops:g}", gflops
    return None, gflops


def run(rank: int, world_size: int, device: torch.device, *, min_gflops: float = 0.0, timeout_s: float = 30.0,
        fail: bool = False) -> Verdict:
    """This rank's self-check, agreed with the group's other ranks: raises ``Unhealthy`` when any rank found a
    problem (``fail``: the fault hook, ``FTHSDP_FAULT=STEP:selfcheck``)."""
    problems = []
    net, allreduce_s = network(rank, world_size, device, timeout_s)
    if net is not None:  # the group itself may be broken: no agreement to wait for
        raise Unhealthy(f"rank {rank}: {net}")
    dev, gflops = compute(device, min_gflops)
    problems += [dev] if dev else []
    problems += ["FTHSDP_FAULT: a self-check made to fail"] if fail else []
    verdict = torch.tensor([1 if problems else 0], dtype=torch.int64, device=device)
    try:
        _all_reduce(verdict, dist.ReduceOp.MAX, timeout_s)
    except RuntimeError as e:  # a sibling that passed its network check and then went away
        raise Unhealthy(f"rank {rank}: the group's verdict did not come: {str(e)[:200]}") from e
    if problems:
        raise Unhealthy(f"rank {rank} on {socket.gethostname()}: " + "; ".join(problems))
    if int(verdict.item()):
        raise Unhealthy(f"rank {rank}: another rank of this group failed its self-check", own=False)
    return Verdict((), gflops, allreduce_s)


def blocklist(path: str, replica_id: str, reason: str) -> None:
    """Append this host and ``reason`` to the blocklist file at ``path`` (one JSON line; nothing without a path)."""
    if path:
        with Path(path).open("a") as f:
            f.write(json.dumps({"host": socket.gethostname(), "replica": replica_id, "reason": reason,
                                "t": time.time()}) + "\n")
