"""A user's own FSDP2 script made fault-tolerant (issue 19): ``tests/helpers/user/train_plain.py`` is the plain
trainer (residual MLP, AdamW, ``CosineAnnealingLR``), ``train_fthsdp.py`` the same under fthsdp. The change stays
small, and ``fthsdp run`` runs the script from outside the repository with its own arguments, through a SIGKILL (and
with a spare group, which takes the killed replica's slot): one final state, and the scheduler's learning rate equal
across replicas at every step after the rejoin."""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from fthsdp.launch.procutil import child_env
from tests.helpers.diffs import changed_lines

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

USER = pathlib.Path(__file__).resolve().parent.parent / "helpers" / "user"


def test_the_fthsdp_version_of_a_plain_script_changes_few_lines() -> None:
    n = changed_lines((USER / "train_plain.py").read_text(), (USER / "train_fthsdp.py").read_text())
    assert 0 < n <= 12, f"{n} changed lines"
    assert changed_lines("a\nb\n", "a\nc\nd\n") == 2  # the measure counts what it should


def _lr(path: pathlib.Path) -> dict[int, float]:
    out: dict[int, float] = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        out[row["step"]] = row["lr"]  # a later incarnation's entry for a step replaces an earlier one's
    return out


@pytest.mark.parametrize("spares", [0, 1], ids=["no-spare", "a-spare"])
def test_fthsdp_run_trains_a_user_script_through_a_kill(tmp_path: pathlib.Path, spares: int) -> None:
    """With a spare group (``--spares 1``), the spare takes the killed replica's data slot (the script reads its
    batch through ``next_batch`` inside the closure) and the killed replica comes back as a spare: every group
    ends with one state and the scheduler's learning rate is the same on all."""
    work = tmp_path / "elsewhere"  # outside the repository, as a user's project
    work.mkdir()
    shutil.copy(USER / "train_fthsdp.py", work / "train.py")
    out, report_path = work / "out", tmp_path / "report.json"
    out.mkdir()
    steps = 200
    proc = subprocess.run(
        [sys.executable, "-m", "fthsdp", "run", "--replicas", "2", "--spares", str(spares), "--ranks", "2",
         "--kill", "1@10", "--restart-delay", "0.5", "--timeout", "240", "--workdir", str(tmp_path / "logs"),
         "--report", str(report_path), "train.py", "--steps", str(steps), "--out", str(out), "--pace", "0.1"],
        # The groups that train hold before step 170 until the killed one is back in the job (a cold restart on
        # a busy machine), so that it trains after its catch-up however slow the machine.
        cwd=work, env=child_env(FTHSDP_FAULT_HOLD_UNTIL=f"170:{2 + spares}"), capture_output=True, text=True,
        timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["command"] == ["train.py", "--steps", str(steps), "--out", str(out), "--pace", "0.1"]
    finals = report["final"]
    groups = {str(g) for g in range(2 + spares)}
    assert set(finals) == groups and all(f is not None and f["step"] == steps for f in finals.values())
    assert len({f["param_hash"] for f in finals.values()}) == 1, finals
    assert not report["problems"]
    exits = [(e["replica"], e["killed"]) for e in report["events"] if e["event"] == "exit"]
    assert exits == [(1, True)], exits  # only the killed group paid
    assert any(e["event"] == "start" and e["replica"] == 1 and e["incarnation"] == 2 for e in report["events"])
    lr0, lr1 = _lr(out / "lr-0.jsonl"), _lr(out / "lr-1.jsonl")
    assert sorted(lr0) == list(range(steps))
    after = [s for s in lr1 if s > 10]  # the restarted replica's steps, from its catch-up on
    assert len(after) > 20, f"the restarted replica logged {len(after)} steps after the kill"
    assert all(lr1[s] == lr0[s] for s in after), {s: (lr0[s], lr1[s]) for s in after if lr1[s] != lr0[s]}
    if spares:
        assert _lr(out / "lr-2.jsonl") == lr0  # the spare stepped the scheduler at every step, before and after
        # The lighthouse's epochs, as it logs them: "... members=replica-0:active:slot0,... reason=...".
        epochs = [(m.group(1).split(","), line) for line in (tmp_path / "logs" / "lighthouse.log").read_text()
                  .splitlines() if (m := re.search(r" members=(\S+) reason=", line))]
        handed = [members for members, line in epochs if "replica-1 dead" in line]
        assert handed and "replica-2:active:slot1" in handed[0], handed  # the spare took the dead one's slot
        back = [members for members, line in epochs if "replica-1 caught up" in line]
        assert back and "replica-1:active" in back[0], back  # back as a spare: no slot
    assert "replica-1: step" in proc.stdout  # live progress from the lighthouse
    assert "state: agree at step" in proc.stdout and "differ" not in proc.stdout  # the digests, as it sees them
    # Who trained which slot, from the runtime's own step rows (the script writes none for the launcher): slot 0
    # by replica 0 at every step; slot 1 by replica 1 and, with a spare, by the spare after the kill, each of its
    # batches once (the counts add up to the slot's cursor).
    by, cursors = report["trained_by"], report["cursors"]
    assert by["0"] == {"0": steps} and cursors[0] == steps, (by, cursors)
    assert sum(by["1"].values()) == cursors[1] and set(by["1"]) == ({"1", "2"} if spares else {"1"}), (by, cursors)
    assert f"fthsdp run: trained by: slot 0: replica 0 ({steps}); slot 1: replica 1 (" in proc.stdout


def test_fthsdp_run_one_group_per_host_against_a_shared_lighthouse(tmp_path: pathlib.Path) -> None:
    """The multi-host shape on loopback: a lighthouse started on its own, and one ``fthsdp run --group I`` per
    replica group (as each host would run), group 1 SIGKILLed: each launcher restarts only its own group, both end
    with the same final state, and group 0 never exits."""
    from fthsdp.launch.lighthouse_process import start_lighthouse_process
    from fthsdp.launch.procutil import stop_process

    work = tmp_path / "elsewhere"
    work.mkdir()
    shutil.copy(USER / "train_fthsdp.py", work / "train.py")
    out = work / "out"
    out.mkdir()
    steps = 120
    lighthouse, grpc_addr, http_addr = start_lighthouse_process(
        ["--expected-replicas", "2", "--min-replicas", "1", "--heartbeat-timeout", "3"],
        tmp_path)
    procs: list[subprocess.Popen[str]] = []
    try:
        for group in (0, 1):
            kill = ["--kill", "1@10"] if group == 1 else []
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "fthsdp", "run", "--replicas", "2", "--ranks", "1", "--group", str(group),
                 "--lighthouse", grpc_addr, "--lighthouse-http", http_addr, *kill, "--restart-delay", "0.5",
                 "--timeout", "200", "--workdir", str(tmp_path / f"host{group}"),
                 "--checkpoint-dir", str(tmp_path / "shared-checkpoints"),
                 "--report", str(tmp_path / f"report{group}.json"),
                 "train.py", "--steps", str(steps), "--out", str(out), "--pace", "0.1"],
                cwd=work, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate(timeout=260)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        stop_process(lighthouse)
    for p, text in zip(procs, outputs, strict=True):
        assert p.returncode == 0, text[-4000:]
    reports = [json.loads((tmp_path / f"report{g}.json").read_text()) for g in (0, 1)]
    assert [r["groups"] for r in reports] == [[0], [1]]
    assert all(r["lighthouse"] == grpc_addr and not r["problems"] for r in reports)
    finals = [r["final"][str(g)] for g, r in enumerate(reports)]
    assert all(f is not None and f["step"] == steps for f in finals), finals
    assert finals[0]["param_hash"] == finals[1]["param_hash"]
    assert not any(e["event"] == "exit" for e in reports[0]["events"])  # only the failed group paid
    assert any(e["event"] == "exit" and e["replica"] == 1 and e["killed"] for e in reports[1]["events"])
    assert any(e["event"] == "start" and e["replica"] == 1 and e["incarnation"] == 2 for e in reports[1]["events"])
    assert "state: agree at step" in outputs[0] and "differ" not in outputs[0] + outputs[1]
