"""A replica process for the FTAR tests: registers with the lighthouse, runs ``--lanes`` lane engines and does
``--steps`` exchanges, writing one JSON line per step and lane to ``--out``.

Replica ``--index`` i contributes ``(i + 1) * (step + 1)`` (float64, so sums are exact), or zeros with
``--zero``. Before each step it writes ``{"entering": step}`` so a test can kill it mid-exchange.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

import torch

from ftar import EpochFeed, FTARConfig, FTARError, Handle, InputsConsumed, LaneEngine, LighthouseMembership
from lighthouse import membership as m
from lighthouse.client import LighthouseClient


def inputs(a: argparse.Namespace, step: int, lane: int) -> list[torch.Tensor]:
    """What replica ``a.index`` exchanges on ``lane`` at ``step``."""
    t = torch.full((a.numel,), float((a.index + 1) * (step + 1) + 1000 * lane), dtype=torch.float64)
    return [t] if a.direct else [t, t[:10].to(torch.int64)]


def start(a: argparse.Namespace, step: int, lane: int, eng: LaneEngine) -> Handle:
    if a.direct:
        return eng.allreduce(inputs(a, step, lane), op=a.op, tag=step, inplace=True, keep_inputs=False)
    return eng.allreduce(inputs(a, step, lane), contribute=not a.zero, op=a.op, tag=step)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--lanes", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--numel", type=int, default=1000)
    p.add_argument("--zero", action="store_true")
    p.add_argument("--op", default="sum")
    p.add_argument("--direct", action="store_true",
                   help="reduce in place without a private copy (keep_inputs=False); recompute after a failure")
    p.add_argument("--timeout", type=float, default=2.0)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    rid = f"r{a.index}"
    feed = EpochFeed()
    client = LighthouseClient(a.lighthouse, "default", rid, shard_count=a.lanes, on_epoch=feed.publish)
    reg = client.start()
    with open(a.out, "a", buffering=1) as out:
        if reg is not None and reg.role == m.JOINING:
            client.ready(m.JOINING)
        membership = LighthouseMembership(client, feed)
        # hold=True as the replica runtime does: a collective can complete at some members and fail at others (a
        # member hung mid-ring), and the members left behind are then served the results by one that holds them.
        cfg = FTARConfig(timeout_s=a.timeout, connect_timeout_s=5.0, epoch_wait_s=20.0, hold=True)
        engines = [LaneEngine(membership, lane, cfg) for lane in range(a.lanes)]
        code = 0
        try:
            for step in range(a.steps):
                out.write(json.dumps({"entering": step}) + "\n")
                handles = [start(a, step, lane, eng) for lane, eng in enumerate(engines)]
                for lane, h in enumerate(handles):
                    try:
                        r = h.wait(timeout=60)
                    except InputsConsumed:
                        out.write(json.dumps({"recomputed": step, "lane": lane}) + "\n")
                        r = start(a, step, lane, engines[lane]).wait(timeout=60)
                    out.write(json.dumps({"step": step, "lane": lane, "epoch": r.epoch,
                                          "contributors": r.contributors, "attempts": r.attempts,
                                          "value": r.tensors[0][0].item(),
                                          "uniform": bool((r.tensors[0] == r.tensors[0][0]).all()),
                                          "int_value": int(r.tensors[-1][0].item())}) + "\n")
        except FTARError as e:
            out.write(json.dumps({"error": type(e).__name__, "detail": str(e)}) + "\n")
            code = 3
        finally:
            for eng in engines:
                eng.close()
            membership.close()
            client.close()
        # Threads still running (by their kernel task): a foreign thread that once called into Python (a Gloo
        # worker reading the store for a lazy connect) stays listed by ``threading`` after it ended.
        left = [t.name for t in threading.enumerate() if t is not threading.main_thread()
                and os.path.exists(f"/proc/self/task/{t.native_id}")]
        out.write(json.dumps({"done": True, "threads_left": left}) + "\n")
    sys.exit(code)


if __name__ == "__main__":
    main()
