"""The start-up self-check (``fthsdp.runtime.selfcheck``): a healthy host passes, a wrong all-reduce, a wrong or
slow matmul and the fault hook fail it with a clear reason; the session writes the host to the blocklist and exits
``EXIT_UNHEALTHY``; the launcher keeps such a group out and still calls the others' end converged."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from fthsdp.launch.cluster import converged
from fthsdp.runtime import selfcheck
from fthsdp.runtime.config import RuntimeConfig
from fthsdp.runtime.errors import EXIT_UNHEALTHY, Unhealthy
from fthsdp.runtime.faults import FaultInjector, FaultSettings

CPU = torch.device("cpu")


def test_a_healthy_host_passes(one_rank_group: None) -> None:
    v = selfcheck.run(0, 1, CPU)
    assert v.ok and v.gflops > 0 and v.allreduce_s >= 0


def test_the_fault_hook_and_a_throughput_floor_fail_it_with_the_reason(one_rank_group: None) -> None:
    with pytest.raises(Unhealthy, match="made to fail") as e:
        selfcheck.run(0, 1, CPU, fail=True)
    assert e.value.own
    with pytest.raises(Unhealthy, match="under FTHSDP_SELFCHECK_MIN_GFLOPS=1e"):
        selfcheck.run(0, 1, CPU, min_gflops=1e9)


def test_a_wrong_all_reduce_or_matmul_is_named(one_rank_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    assert selfcheck.network(0, 2, CPU, 5.0)[0] is not None  # expected 1 + 2 from two ranks, got 1 from one
    real = torch.Tensor.__matmul__
    monkeypatch.setattr(torch.Tensor, "__matmul__", lambda a, b: real(a, b) + 1e-3)  # a device that computes wrong
    assert "came out wrong" in str(selfcheck.compute(CPU, 0.0)[0])


def test_the_settings_and_the_fault_phase_are_read() -> None:
    base = {"FTHSDP_LIGHTHOUSE": "127.0.0.1:1", "FTHSDP_REPLICA_INDEX": "0", "FTHSDP_NUM_REPLICAS": "1"}
    cfg = RuntimeConfig.from_env(base)
    assert cfg.selfcheck and cfg.selfcheck_min_gflops == 0.0 and cfg.blocklist == ""
    cfg = RuntimeConfig.from_env({**base, "FTHSDP_SELFCHECK": "0", "FTHSDP_SELFCHECK_MIN_GFLOPS": "5",
                                  "FTHSDP_BLOCKLIST": "/b"})
    assert not cfg.selfcheck and cfg.selfcheck_min_gflops == 5.0 and cfg.blocklist == "/b"
    assert FaultInjector.for_rank(FaultSettings(spec="0:selfcheck"), 0).fails_selfcheck
    assert not FaultInjector.for_rank(FaultSettings(spec="0:selfcheck"), 1).fails_selfcheck  # rank 0's fault
    assert not FaultInjector.for_rank(FaultSettings(spec="3:forward"), 0).fails_selfcheck


def test_the_blocklist_gets_the_host_and_the_reason(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "blocklist.jsonl"
    selfcheck.blocklist(str(path), "replica-1", "rank 0: device: wrong")
    selfcheck.blocklist("", "replica-1", "nowhere")  # no file configured: nothing written
    (line,) = path.read_text().splitlines()
    row = json.loads(line)
    assert row["replica"] == "replica-1" and row["reason"] == "rank 0: device: wrong" and row["host"]
    assert EXIT_UNHEALTHY not in (0, 1, 75, 76)


def test_a_group_kept_out_by_its_self_check_does_not_count_against_the_end() -> None:
    final = {"step": 10, "param_hash": "aa"}
    report = {"final": {"0": final, "1": None, "2": final}, "unhealthy": {"1": "rank 0: device: wrong"}}
    assert converged(report, 10) == []
    assert converged({**report, "unhealthy": {}}, 10)  # without the verdict a missing state is a failure
    assert converged({"final": {"1": None}, "unhealthy": {"1": "x"}}, 10) == [
        "no replica ended: every one failed its self-check"]
