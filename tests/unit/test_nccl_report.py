"""deploy/gpu/nccl_check.sh's decisions, without GPUs (``fthsdp.testing.nccl_report``): the GPU layout never puts
two ranks of one NCCL communicator (a group's, or a lane's) on one GPU, and the verdict fails a run whose final
state hashes differ or are missing, that stopped short, whose kill never fired, or whose killed group came back too
late to be checked; that a survivor that restarted fails it; and that a run that did less than was asked (the
one-GPU smoke instead of groups with a kill) never passes."""

from __future__ import annotations

import json
import pathlib

import pytest

from fthsdp.testing.nccl_report import DEDICATED, ONE_GPU, SHARED, SINGLE, layout, main, report, summary


@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
@pytest.mark.parametrize("ranks", [1, 2, 4, 8])
@pytest.mark.parametrize("gpus", [1, 2, 3, 4, 8, 16])
def test_no_gpu_twice_in_a_communicator(replicas: int, ranks: int, gpus: int) -> None:
    mode, grid = layout(replicas, ranks, gpus)
    if mode == ONE_GPU:  # every rank on GPU 0 as a host of its own (NCCL_HOSTID): only when nothing else fits
        assert grid == [[0] * ranks for _ in range(replicas)]
        assert gpus < replicas * ranks and (gpus < 2 or gpus < max(replicas, ranks))
        return
    assert mode != SINGLE  # the smoke only when asked
    assert len(grid) == replicas and all(len(g) == ranks for g in grid)
    assert all(0 <= x < gpus for g in grid for x in g)
    for group in grid:  # FSDP2's communicator: the group's ranks
        assert len(set(group)) == ranks, grid
    for k in range(ranks):  # FTAR's lane k: rank k of every group
        assert len({g[k] for g in grid}) == replicas, grid
    if mode == DEDICATED:
        assert len({x for g in grid for x in g}) == replicas * ranks


def test_two_by_two_fits_two_gpus_and_one_gpu_shares_it() -> None:
    assert layout(2, 2, 2) == (SHARED, [[0, 1], [1, 0]])
    assert layout(2, 2, 4) == (DEDICATED, [[0, 1], [2, 3]])
    assert layout(2, 2, 1) == (ONE_GPU, [[0, 0], [0, 0]])
    assert layout(2, 2, 8, single=True) == (SINGLE, [[0]])
    assert layout(3, 2, 2)[0] == ONE_GPU  # a lane of 3 ranks needs 3 GPUs, or one shared


def _run_dir(tmp_path: pathlib.Path, groups: dict[int, list[dict[str, object]]], restarted: list[int]) -> pathlib.Path:
    (tmp_path / "run").mkdir()
    for i, rows in groups.items():
        (tmp_path / "run" / f"replica{i}.progress.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "run.txt").write_text("".join(f"group {i}: exit status 137 (incarnation 1)\n" for i in restarted))
    return tmp_path


def _group(final_hash: str | None, steps: int = 4, incarnations: int = 1) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    for n in range(incarnations):
        rows.append({"event": "start", "t": 10.0 * n})
        rows += [{"event": "step", "t": 10.0 * n + s, "step": s + 1, "step_s": 0.1, "exchange_s": 0.05,
                  "joined": n > 0 and s == 2} for s in range(2 if n + 1 < incarnations else steps)]
    if final_hash is not None:
        rows.append({"event": "final", "t": 99.0, "step": steps, "param_hash": final_hash})
    return rows


def test_equal_hashes_after_a_kill_and_rejoin_pass(tmp_path: pathlib.Path) -> None:
    out = _run_dir(tmp_path, {0: _group("aa"), 1: _group("aa", incarnations=2)}, restarted=[1])
    r = report(out, SHARED, 2, 2, 4, "tiny", "1@2:exchange", 0, 12.0, "0,1;1,0")
    assert r["ok"] and r["problems"] == [] and r["kill_fired"] and r["all_final_hashes_equal"]
    assert r["replica"]["1"]["restarts"] == 1 and "registered_to_joined_step_s" in r["replica"]["1"]
    assert main(["report", str(out), SHARED, "2", "2", "4", "tiny", "1@2:exchange", "0", "12", "0,1;1,0"]) == 0


@pytest.mark.parametrize("case,expect", [
    ("hash-differs", "hashes differ"),
    ("hash-missing", "hashes differ or are missing"),
    ("short", "did not reach step 4"),
    ("kill-never-fired", "never fired"),
    ("back-too-late", "came back after the others had finished"),
    ("group-failed", "a group failed"),
    ("survivor-restarted", "group 0 was not killed but ran 2 times"),
])
def test_a_bad_run_fails_with_the_reason(tmp_path: pathlib.Path, case: str, expect: str) -> None:
    groups = {0: _group("aa"), 1: _group("aa", incarnations=2)}
    restarted, status = [1], 0
    if case == "hash-differs":
        groups[1] = _group("bb", incarnations=2)
    elif case == "hash-missing":
        groups[1] = _group(None, incarnations=2)
    elif case == "short":
        groups[0][-1]["step"] = 3
    elif case == "kill-never-fired":
        restarted = []
    elif case == "back-too-late":
        groups[1] = _group(None, steps=2) + [{"event": "job_finished", "t": 50.0, "step": 4}]
    elif case == "group-failed":
        status = 1
    elif case == "survivor-restarted":  # its torchrun was restarted too: the survivor did not survive
        groups[0] = _group("aa", incarnations=2)
    out = _run_dir(tmp_path, groups, restarted)
    r = report(out, SHARED, 2, 2, 4, "tiny", "1@2:exchange", status, 12.0, "0,1;1,0")
    assert not r["ok"] and any(expect in p for p in r["problems"]), r["problems"]
    assert main(["report", str(out), SHARED, "2", "2", "4", "tiny", "1@2:exchange", str(status), "12",
                 "0,1;1,0"]) == 1


def test_a_run_that_did_less_than_asked_never_passes(tmp_path: pathlib.Path) -> None:
    """One GPU where the trick does not work: the smoke ran (1 x 1, no kill) in place of 2 x 2 with a kill."""
    out = _run_dir(tmp_path, {0: _group("aa")}, restarted=[])
    r = report(out, SINGLE, 1, 1, 4, "tiny", "", 0, 12.0, "0", asked=(2, 2, "1@2:exchange"))
    assert not r["ok"] and any("was not checked" in p for p in r["problems"]), r["problems"]
    assert main(["report", str(out), SINGLE, "1", "1", "4", "tiny", "", "0", "12", "0",
                 "--asked", "2,2,1@2:exchange"]) == 1
    asked_for_the_smoke = report(out, SINGLE, 1, 1, 4, "tiny", "", 0, 12.0, "0", asked=(1, 1, ""))
    assert asked_for_the_smoke["ok"], asked_for_the_smoke["problems"]


def _one_gpu_out(tmp_path: pathlib.Path, works: bool, refused: bool, fixed_ok: bool | None,
                 run_ok: bool = True) -> pathlib.Path:
    run = tmp_path / "runs" / "2x2"
    run.mkdir(parents=True)
    (run / "report.json").write_text(json.dumps({"problems": [] if run_ok else ["a group failed"]}))
    (tmp_path / "two_on_one.json").write_text(json.dumps({"works": works, "control_refused": refused}))
    if fixed_ok is not None:
        (tmp_path / "peer_kill.fixed.json").write_text(json.dumps({"ok": fixed_ok, "last_event": {"event": "x"}}))
        (tmp_path / "peer_kill.shipped.json").write_text(json.dumps({"ok": False, "survived": False,
                                                                     "survivor_exit": -6}))
    return tmp_path


@pytest.mark.parametrize("case,problem", [
    ("good", None),
    ("trick-fails", "do not work on one GPU here"),
    ("survivor-died", "the survivor did not live"),
    ("peer-kill-missing", "no result"),
    ("run-failed", "2x2: a group failed"),
])
def test_the_one_gpu_summary_passes_only_when_every_part_did(tmp_path: pathlib.Path, case: str,
                                                             problem: str | None) -> None:
    out = _one_gpu_out(tmp_path, works=case != "trick-fails", refused=True,
                       fixed_ok=None if case == "peer-kill-missing" else case != "survivor-died",
                       run_ok=case != "run-failed")
    r = summary(out)
    assert r["ok"] is (problem is None), r["problems"]
    if problem:
        assert any(problem in p for p in r["problems"]), r["problems"]
    else:
        assert any("c10d's defaults" in n and "died" in n for n in r["notes"])
    assert main(["summary", str(out)]) == (0 if problem is None else 1)


def test_a_control_that_works_is_noted(tmp_path: pathlib.Path) -> None:
    r = summary(_one_gpu_out(tmp_path, works=True, refused=False, fixed_ok=True))
    assert r["ok"] and any("without NCCL_HOSTID" in n for n in r["notes"])
