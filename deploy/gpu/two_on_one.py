"""Can two ranks of one NCCL communicator share one GPU here? (deploy/gpu/nccl_check.sh, one-GPU mode; docs/gpu.md §1)

NCCL refuses two ranks on one GPU ("Duplicate GPU detected") when they have the same host hash and bus id. Each
process given its own ``NCCL_HOSTID`` is a host of its own to NCCL, and the two talk over sockets on loopback.
nccl_check.sh runs this twice: without ``NCCL_HOSTID`` (the control, which must fail: otherwise the trick is not
what made it work) and with one per process (which must work). One rank of two; prints one JSON line.

    NCCL_HOSTID=h0 python deploy/gpu/two_on_one.py 0 PORT & NCCL_HOSTID=h1 python deploy/gpu/two_on_one.py 1 PORT
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist


def main(rank: int, port: int) -> dict[str, object]:
    out: dict[str, object] = {"rank": rank, "NCCL_HOSTID": os.environ.get("NCCL_HOSTID")}
    device = torch.device("cuda", 0)
    try:
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                device_id=device)
        t = torch.full((1 << 22,), float(rank + 1), device=device)  # 16 MiB
        dist.all_reduce(t)
        torch.cuda.synchronize()
        out["ok"] = bool((t == 3.0).all().item())
        t0 = time.perf_counter()
        for _ in range(10):
            dist.all_reduce(t)
        torch.cuda.synchronize()
        out["ms_per_16MiB_allreduce"] = round((time.perf_counter() - t0) * 100, 2)
        dist.destroy_process_group()
    except Exception as e:  # the control's expected end: NCCL refuses the second rank on this GPU
        out.update(ok=False, error=f"{type(e).__name__}: {e}"[:400])
    return out


if __name__ == "__main__":
    result = main(int(sys.argv[1]), int(sys.argv[2]))
    print("TWO_ON_ONE " + json.dumps(result), flush=True)
    os._exit(0)  # a refused communicator can hang its destructor
