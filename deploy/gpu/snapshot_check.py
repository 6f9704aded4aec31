"""The catch-up snapshot of CUDA state, taken off the training thread, on one real GPU (docs/gpu.md §5).

A source trains the reference GPT on ``cuda:0`` (AdamW) and serves catch-up snapshots (``fthsdp.catchup.server``)
as a replica does: ``at_commit(S)`` at each commit boundary, ``before_update(S)`` before the optimizer step, the
snapshot copied by the server's snapshot thread (``ShardState.snapshot``: on a stream of its own, after an event
recorded at the boundary) while the training thread runs step S's forward and backward. The
training thread delays the device before each optimizer step (``torch.cuda._sleep``), so that at the next
boundary the update is still queued on the device when a copy may start: a copy that does not wait for it reads
the parameters of the step before. A joiner thread fetches the snapshot of the step being trained, again and
again; each must be bitwise the state of its step: its digest (recomputed from the received bytes, and the
source's own) equal to the digest the training thread takes of that state just before its update (after it
synchronised the device).

``--control``: the same run with a snapshot that copies on a side stream without waiting for the work queued
before it, the defect the check is there to catch: it must report mismatches (else the check shows nothing).

Prints one JSON object; exits 1 when a check fails, 3 without a CUDA GPU.
    python deploy/gpu/snapshot_check.py [--steps 200] [--control] [--out report.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import threading
import time
from typing import Any

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from fthsdp.catchup.client import Fetch, Source  # noqa: E402
from fthsdp.catchup.server import CatchupServer  # noqa: E402
from fthsdp.catchup.wire import FetchFailed  # noqa: E402
from fthsdp.examples.gpt import GPT, GPTConfig  # noqa: E402
from fthsdp.runtime.state import DIGEST, Boundary, ShardState, digest_of  # noqa: E402
from fthsdp.runtime.trainer_state import TrainerState  # noqa: E402
from lighthouse.epoch_view import EpochView  # noqa: E402
from lighthouse.model import JOINING, Endpoints, EpochMember  # noqa: E402

JOB, INC, TOKEN = "gpu-check", "inc-1", "gpu-check-token"
DELAY_CYCLES = 50_000_000
"""``torch.cuda._sleep`` before each optimizer step: tens of milliseconds with the update queued behind it."""


def run(steps: int, control: bool) -> dict[str, Any]:
    dev = torch.device("cuda:0")
    torch.manual_seed(0)
    cfg = GPTConfig.named("reference")
    net = GPT(cfg).to(dev)
    opt = torch.optim.AdamW(net.parameters(), lr=3e-4)
    shards = ShardState(list(net.parameters()), opt, dev, TrainerState())
    cursors = torch.zeros(1, dtype=torch.int64)
    at = [Boundary([])]
    side = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]

    def wrong_snapshot() -> list[tuple[str, torch.Tensor]]:
        with torch.cuda.stream(side):  # does not wait for the training thread's queued update
            return [(n, t.detach().to("cpu", copy=True).contiguous()) for n, t in [*shards.tensors(), *at[0].pairs]]

    epoch = EpochView(JOB, 1, (EpochMember("joiner", INC, JOINING, 1, Endpoints()),), "", 0.0, "gpu-check")
    srv = CatchupServer(job=JOB, replica_id="source", rank=0, world_size=1, token=TOKEN, epoch=lambda: epoch,
                        snapshot=wrong_snapshot if control else (lambda: shards.snapshot(at[0])), seal=ShardState.seal,
                        device=dev)
    refs: dict[int, bytes] = {}
    current = [0]
    done = threading.Event()
    checked: list[dict[str, Any]] = []
    errors: list[str] = []

    def joiner() -> None:
        while not done.is_set():
            # Alternately the step being trained (copied at once, its update waiting) and the next one (copied at
            # its boundary, the update before it still queued on the device).
            step = current[0] + len(checked) % 2
            try:
                got = Fetch([Source("source", srv.address)], job=JOB, replica_id="joiner", rank=0, step=step,
                            incarnation=INC, token=TOKEN, wait_s=30.0).start().result(timeout=60)
            except FetchFailed as e:  # the run ended, or the step's update began before the request came
                if not done.is_set():
                    errors.append(str(e))
                continue
            mine = digest_of([(n, t) for n, t in got.tensors.items() if n != DIGEST])
            theirs = got.tensors[DIGEST].numpy().tobytes()
            deadline = time.monotonic() + 60
            while got.step not in refs and time.monotonic() < deadline:
                time.sleep(0.005)  # the training thread records the reference before that step's update
            ref = refs.get(got.step)
            checked.append({"step": got.step, "bytes": got.bytes, "received_matches": mine == ref,
                            "source_digest_matches": theirs == ref})

    tokens = torch.randint(0, cfg.vocab, (8, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1)).to(dev)
    fetcher = threading.Thread(target=joiner, daemon=True)
    step_s: list[float] = []
    t0 = time.perf_counter()
    try:
        for s in range(steps):
            t_step = time.perf_counter()
            at[0] = shards.boundary(cursors)
            srv.at_commit(s, active=True)
            current[0] = s
            if s == 1:
                fetcher.start()
            logits = net(tokens[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1))
            loss.backward()
            torch.cuda.synchronize()
            refs[s] = digest_of([*shards.tensors(), *at[0].pairs])  # the state of step s, before its update
            srv.before_update(s)
            torch.cuda._sleep(DELAY_CYCLES)  # the update stays queued on the device past the next boundary
            opt.step()
            opt.zero_grad()
            step_s.append(time.perf_counter() - t_step)
        done.set()
        fetcher.join(120)
    finally:
        done.set()
        srv.close(drain_s=5)
    bad = [c for c in checked if not (c["received_matches"] and c["source_digest_matches"])]
    return {"control": control, "steps": steps, "fetches_checked": len(checked), "mismatches": len(bad),
            "first_mismatch": bad[0] if bad else None, "fetch_errors": len(errors), "fetch_error_samples": errors[:3],
            "wall_s": round(time.perf_counter() - t0, 2), "median_step_s": round(statistics.median(step_s), 4),
            "snapshot_mb": round(checked[0]["bytes"] / 1e6, 1) if checked else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--control", action="store_true")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA GPU"}))
        return 3
    report = run(a.steps, a.control)
    report.update(torch=torch.__version__, gpu=torch.cuda.get_device_name(0))
    enough = report["fetches_checked"] >= max(10, a.steps // 20)
    report["ok"] = enough and (report["mismatches"] > 0 if a.control else report["mismatches"] == 0)
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        pathlib.Path(a.out).write_text(text + "\n")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
