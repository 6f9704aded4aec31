"""The lanes' part of ``fthsdp bench lighthouse`` (issue 39) at a tiny size: the emulated lanes rebuild after each
death on the members' stores with no call to the lighthouse, and on the lighthouse (the baseline) with some, every
emulated rank without an error. What it measures is in ``docs/benchmarks.md``; this keeps it working."""

from __future__ import annotations

import math

import pytest

from fthsdp.bench.lane_rebuild import bench_lanes, sample_size

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class _Recorder:
    """A store that records the calls made on it (every key present)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def set(self, key: str, value: object) -> None:
        self.calls.append(("set", key))

    def get(self, key: str) -> bytes:
        self.calls.append(("get", key))
        return b"x"

    def wait(self, keys: list[str]) -> None:
        self.calls.extend(("wait", k) for k in keys)


def test_the_emulated_backends_make_their_backends_store_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Per member of 8: Gloo's lazy pairs read its 2 ring neighbours' addresses, a full mesh every other member's,
    NCCL's non-zero ranks the unique id rank 0 set."""
    import fthsdp.bench.lanes as lanes

    monkeypatch.setattr(lanes.dist, "PrefixStore", lambda prefix, store: store)
    seen = {}
    for backend in ("lazy", "mesh", "nccl"):
        rec = _Recorder()
        lanes.backend_calls(rec, 3, 8, backend)
        seen[backend] = rec.calls
    assert seen["lazy"] == [("set", "0/3"), ("wait", "0/2"), ("get", "0/2"), ("wait", "0/4"), ("get", "0/4")]
    assert len(seen["mesh"]) == 1 + 2 * 7 and ("get", "0/3") not in seen["mesh"]
    assert seen["nccl"] == [("get", "nccl_unique_id")]
    assert sample_size(12, 8192) == 20 and sample_size(1000, 8) == 1 and sample_size(3, 2) == 2


def test_lanes_rebuild_on_the_members_without_the_lighthouse() -> None:
    out = bench_lanes(3, 2, deaths=1)
    members, baseline = out["members"], out["lighthouse"]
    assert members["errors"] == [] and baseline["errors"] == [], (members["errors"], baseline["errors"])
    assert members["lighthouse_calls_per_change"] == 0, members
    assert baseline["lighthouse_calls_per_change"] > 0, baseline
    assert math.isfinite(out["lane_rebuild_p99_s"]) and math.isfinite(out["baseline_lane_rebuild_p99_s"]), out
