"""FTAR's NCCL semantics on one real GPU (docs/gpu.md §4): what the CPU tests check against fakes, on the device.

One replica, one lane, NCCL on ``cuda:0`` (a one-member communicator: NCCL refuses two ranks of one communicator
on the same GPU, so a single GPU cannot hold a cross-replica exchange), against a real lighthouse on loopback and
its authenticated rendezvous. Each check delays the producer's stream with ``torch.cuda._sleep`` so that the
ordering is observable:

- ``ordered``: a gradient written on another stream after a delay, handed over with its event (``ready``), is
  what the exchange reduces (never the stale value), and the caller's thread was not held while the device waited;
- ``queued_is_not_done``: the result is not returned while the collective still waits on the device.

Not checked here: a deadline cutting a *collective* that hangs (it needs a peer that stops; one GPU has none). A
delay on the producer's stream cannot stand in for it: the lane's small control copies (the tag proof, the
contributor count) come from pageable host memory, and such a copy waits for the lane's stream, so the lane
enqueues the collective only once the producer is done, and the deadline (which starts at the enqueue) is never
reached. The deadline's abort is covered on the CPU against a fake NCCL group (tests/unit/test_ftar_completion.py).

Prints one JSON object; exits 1 when a check fails, 3 without a CUDA GPU.
    python deploy/gpu/ftar_semantics.py [--out report.json]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

CYCLES = 1 << 30
"""``torch.cuda._sleep`` spins for a number of clock cycles; ``calibrate`` measures what this many take."""


def start_lighthouse(workdir: pathlib.Path) -> tuple[subprocess.Popen[bytes], str]:
    ports = workdir / "lighthouse.ports"
    with open(workdir / "lighthouse.log", "wb") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, "-m", "fthsdp", "lighthouse", "--bind", "127.0.0.1:0", "--http", "",
                                 "--min-replicas", "1", "--heartbeat-timeout", "5", "--confirm-age", "0.3",
                                 "--max-reforms", "0", "--port-file", str(ports)], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = ports.read_text() if ports.exists() else ""
        fields = dict(kv.split("=", 1) for kv in text.split())
        if "grpc" in fields:
            return proc, f"127.0.0.1:{fields['grpc']}"
        if proc.poll() is not None:
            break
        time.sleep(0.05)  # polling the port file with a deadline
    proc.kill()
    raise RuntimeError(f"the lighthouse did not start: {(workdir / 'lighthouse.log').read_text()[-2000:]}")


def calibrate() -> float:
    """Seconds of device time ``torch.cuda._sleep(CYCLES)`` takes (CUDA events around it)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(CYCLES)
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1000.0


def delayed(value: float, stream: Any) -> tuple[torch.Tensor, Any]:
    """A tensor written with ``value`` on ``stream`` after ``CYCLES`` of device time, and the event after it."""
    t = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(CYCLES)
        t.fill_(value)
        ready = torch.cuda.Event()
        ready.record()
    return t, ready


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA GPU"}))
        return 3
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # the repository, run from anywhere
    from ftar import EpochFeed, FTARConfig, LaneEngine, LighthouseMembership
    from lighthouse import membership as m
    from lighthouse.client import LighthouseClient

    torch.cuda.set_device(0)
    report: dict[str, Any] = {"torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                              "gpu": torch.cuda.get_device_name(0), "checks": {}}
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="ftar-semantics-"))
    lh, addr = start_lighthouse(workdir)
    client = None
    engine = None
    try:
        feed = EpochFeed()
        client = LighthouseClient(addr, "default", "r0", shard_count=1, on_epoch=feed.publish)
        reg = client.start()
        if reg is not None and reg.role == m.JOINING:
            client.ready(m.JOINING)
        membership = LighthouseMembership(client, feed)
        engine = LaneEngine(membership, 0,
                            FTARConfig(backend="nccl", device=torch.device("cuda", 0), timeout_s=1.0,
                                       connect_timeout_s=30.0, epoch_wait_s=30.0))
        side = torch.cuda.Stream()
        # Warm up: build the communicator (first exchange of the epoch).
        engine.allreduce([torch.ones(4, device="cuda")], op="sum", tag=0).wait(60)
        checks = report["checks"]

        # ordered + queued_is_not_done: the value is written after CYCLES of device time on another stream.
        delay_s = calibrate()
        t, ready = delayed(7.0, side)
        t0 = time.perf_counter()
        handle = engine.allreduce([t], op="sum", tag=1, ready=ready)
        launched_s = time.perf_counter() - t0
        r = handle.wait(60)
        returned_s = time.perf_counter() - t0
        value = float(r.tensors[0][0].item())  # .item() waits for the result's stream through its event
        uniform = bool((r.tensors[0] == 7.0).all().item())
        checks["ordered"] = {"ok": value == 7.0 and uniform and launched_s < 0.1 * delay_s, "value": value,
                             "launch_s": round(launched_s, 4)}
        checks["queued_is_not_done"] = {"ok": returned_s >= 0.9 * delay_s, "returned_after_s": round(returned_s, 3),
                                        "device_delay_s": round(delay_s, 3)}
        report["ok"] = all(c["ok"] for c in checks.values())
    except Exception as e:
        report["ok"] = False
        report["error"] = f"{type(e).__name__}: {e}"[:1000]
    finally:
        if engine is not None:
            engine.close()
            membership.close()
        if client is not None:
            client.close()
        lh.terminate()
        try:
            lh.wait(10)
        except subprocess.TimeoutExpired:
            lh.kill()
    text = json.dumps(report, indent=2)
    print(text)
    if a.out:
        pathlib.Path(a.out).write_text(text)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
