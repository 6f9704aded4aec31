"""A replica is any parallel layout (issue 36): ``tests/helpers/user/loop_layouts.py`` builds each replica as
tensor parallelism × FSDP2 on a 2-D device mesh (``dp`` × ``tp``) and keeps its own loop under fthsdp. Through a
SIGKILL of one replica, every replica ends at the last step with one state hash (the joiner turned active bitwise
equal to its source), every batch of every slot is trained exactly once by each data-parallel rank and read alike
by its tensor-parallel ranks; without failures its per-rank losses are the ones plain PyTorch HSDP of the same
layout (torchrun alone, a ``(replicate, dp, tp)`` mesh) reaches on the same batches."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
from collections import Counter, defaultdict

import pytest

from fthsdp.launch.procutil import child_env
from fthsdp.runtime.data import SlotSampler
from fthsdp.runtime.loop import indices_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(360)]

USER = pathlib.Path(__file__).resolve().parent.parent / "helpers" / "user"
ACCUM, BATCH, ITEMS = 2, 4, 4096  # as loop_layouts.py has them
LOSS_TOLERANCE = 1e-5
"""Per-rank loss, fthsdp against plain HSDP of the same layout, relative (docs/design.md §14): the cross-replica
sums are taken in another order (FTAR's lane against HSDP's all-reduce), nothing else differs."""


def rows(out: pathlib.Path, pattern: str) -> list[dict]:
    return [json.loads(line) | {"file": p.name} for p in sorted(out.glob(pattern))
            for line in p.read_text().splitlines()]


def fthsdp_run(tmp_path: pathlib.Path, replicas: int, steps: int, extra: list[str], pace: float) -> tuple[dict, list]:
    work, out = tmp_path / "w", tmp_path / "w" / "out"
    out.mkdir(parents=True)
    shutil.copy(USER / "loop_layouts.py", work / "train.py")
    report_path = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "fthsdp", "run", "--replicas", str(replicas), "--ranks", "4", *extra,
         "--collective-timeout", "15", "--restart-delay", "0.5", "--timeout", "300", "--workdir",
         str(tmp_path / "logs"), "--report", str(report_path),
         "train.py", "--steps", str(steps), "--out", str(out), "--pace", str(pace)],
        cwd=work, env=child_env(), capture_output=True, text=True, timeout=340)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(report_path.read_text()), rows(out, "steps-*.jsonl")


def slot_of(row: dict) -> int:
    return int(row["file"].split("-")[1])


def test_tp_x_fsdp_replicas_through_a_kill(tmp_path: pathlib.Path) -> None:
    """2 replicas × (TP 2 × FSDP 2) = 8 ranks, replica 1 SIGKILLed at step 10: it restarts, catches up (every rank
    of it from its peer rank of the source: a TP shard of an FSDP shard) and trains its slot again."""
    steps, slots = 120, 2
    report, got = fthsdp_run(tmp_path, slots, steps, ["--kill", "1@10"], pace=0.1)
    finals = report["final"]
    assert set(finals) == {"0", "1"} and all(f and f["step"] == steps for f in finals.values()), finals
    assert len({f["param_hash"] for f in finals.values()}) == 1, finals  # the joiner is bitwise its source
    assert not report["problems"], report["problems"]
    assert [(e["replica"], e["killed"]) for e in report["events"] if e["event"] == "exit"] == [(1, True)]
    lighthouse = (tmp_path / "logs" / "lighthouse.log").read_text()
    assert "replica replica-1 caught up, now active" in lighthouse
    sampler = SlotSampler(ITEMS, BATCH, seed=0)
    known = {(slot, dp, tuple(i for m in range(ACCUM) for i in indices_of(sampler, slot, c, dp, m, slots=slots,
                                                                         ranks=2, micro_batches=ACCUM))): c
             for slot in range(slots) for dp in range(2) for c in range(steps)}
    trained: dict[tuple[int, int, int], list[int]] = defaultdict(list)  # (slot, dp, tp) -> cursors trained
    for row in got:
        if row["step"] is not None:  # None: a warm-up iteration, nothing consumed
            key = (slot_of(row), row["dp"], tuple(row["ids"]))
            assert key in known, f"slot {key[0]} dp {key[1]}: a batch that is not this data rank's"
            trained[(slot_of(row), row["dp"], row["tp"])].append(known[key])
    assert set(trained) == {(s, dp, tp) for s in range(slots) for dp in range(2) for tp in range(2)}
    for (slot, dp, tp), cursors in trained.items():
        # Both TP ranks of a data rank read the same batches; each data rank trains each of its batches once.
        assert cursors == trained[(slot, dp, 0)], (slot, dp, tp)
        assert not [c for c, n in Counter(cursors).items() if n > 1], f"slot {slot} dp {dp}: trained twice"
        missing = set(range(max(cursors) + 1)) - set(cursors)
        assert len(missing) <= (slot == 1), f"slot {slot} dp {dp}: never trained {sorted(missing)}"
    assert trained[(0, 0, 0)] == list(range(steps))  # the survivor's slot trained every step
    assert max(trained[(1, 0, 0)]) > 20, "the killed replica's slot trained nothing after its catch-up"


def test_tp_x_fsdp_losses_are_plain_hsdps(tmp_path: pathlib.Path) -> None:
    """Without failures, 2 replicas × (TP 2 × FSDP 2) under fthsdp reach, rank by rank and step by step, the
    losses of the same model and batches on plain PyTorch HSDP of the same layout (no fthsdp)."""
    steps = 12
    _, ft = fthsdp_run(tmp_path / "ft", 2, steps, [], pace=0.0)
    plain_out = tmp_path / "plain"
    plain_out.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
         str(USER / "loop_layouts.py"), "--steps", str(steps), "--out", str(plain_out), "--plain-replicas", "2"],
        env=child_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ours = {(slot_of(r), r["dp"], r["tp"], r["step"]): r for r in ft}
    plain = {(r["rank"] // 4, r["dp"], r["tp"], r["step"]): r for r in rows(plain_out, "steps-plain-*.jsonl")}
    assert set(ours) == set(plain) and len(plain) == 2 * 4 * steps, sorted(set(ours) ^ set(plain))[:5]
    for key, base in plain.items():
        assert ours[key]["ids"] == base["ids"], key  # the same batches
        assert ours[key]["loss"] == pytest.approx(base["loss"], rel=LOSS_TOLERANCE), key
