"""The trainer-facing helpers without processes: the data helpers (``fthsdp.runtime.data``) and the exits of
``fthsdp.runtime.training()`` (``fthsdp.runtime.session``), with a stand-in for ``Replica``."""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from fthsdp.launch.progress import read_progress, steps_of, trained_by
from fthsdp.runtime import session
from fthsdp.runtime.data import SlotSampler, batch_index, next_batch
from fthsdp.runtime.errors import EXIT_REJOIN, Diverged, JobFinished, RejoinRequired, SlotConflict
from fthsdp.runtime.result import StepResult


def test_every_rank_of_every_slot_gets_its_own_batch_at_every_cursor() -> None:
    slots, ranks = 3, 2
    seen = [batch_index(s, c, r, slots, ranks) for c in range(5) for s in range(slots) for r in range(ranks)]
    assert sorted(seen) == list(range(5 * slots * ranks))  # distinct, and no gap
    assert batch_index(1, 0, 1, slots, ranks) == 3 and batch_index(0, 1, 0, slots, ranks) == 6
    for bad in [(3, 0, 0), (0, 0, 2), (0, -1, 0), (-1, 0, 0)]:
        with pytest.raises(ValueError, match="out of range"):
            batch_index(bad[0], bad[1], bad[2], slots, ranks)


@dataclass
class FakeReplica:
    slot: int = 1
    rank: int = 1
    world_size: int = 2
    slots: int = 3
    cursor: int = 4
    config: Any = field(default_factory=lambda: type("C", (), {"replica_id": "replica-1", "replica_index": 1})())
    step: int = 7
    incarnation: str = "abc"
    joining: bool = False
    finished: bool = False
    job_over_at: int | None = None
    cursors: Any = field(default_factory=lambda: torch.tensor([7, 7, 7]))
    closed: list[bool] = field(default_factory=list)

    def close(self, leave: bool = True) -> None:
        self.closed.append(leave)

    def state_hash(self) -> str:
        return "f00d"

    def when_registered(self, fn: Any) -> None:
        fn()  # registered in its constructor, as a replica that is not a warm standby


def test_the_sampler_visits_the_dataset_once_per_pass_in_a_seeded_order() -> None:
    sampler = SlotSampler(10, 4, seed=3)
    stream = [i for b in range(5) for i in sampler.indices(b)]  # 20 items: two passes
    assert sorted(stream[:10]) == list(range(10)) and sorted(stream[10:]) == list(range(10))
    assert stream[:10] != stream[10:]  # each pass its own permutation
    assert SlotSampler(10, 4, seed=3).indices(2) == sampler.indices(2)  # the same on every replica, after restarts
    assert SlotSampler(10, 4, seed=4).indices(0) != sampler.indices(0)
    assert SlotSampler(5, 2, shuffle=False).indices(3) == [1, 2]
    ft = FakeReplica()
    assert next_batch(ft) == batch_index(1, 4, 1, 3, 2) and sampler.next(ft) == sampler.indices(next_batch(ft))
    with pytest.raises(ValueError):
        SlotSampler(0, 4)
    with pytest.raises(ValueError):
        sampler.indices(-1)


def run(monkeypatch: pytest.MonkeyPatch, body_error: BaseException | None = None,
        start_error: BaseException | None = None, rank: int = 1,
        body: Callable[[Any], None] = lambda ft: None) -> tuple[FakeReplica, int | None]:
    made = FakeReplica(rank=rank)

    def make(config: object = None, mesh: object = None) -> FakeReplica:
        if start_error is not None:
            raise start_error
        return made

    monkeypatch.setattr(session, "Replica", make)
    code: int | None = None
    try:
        with session.training() as ft:
            assert ft is made
            body(ft)
            if body_error is not None:
                raise body_error
    except SystemExit as e:
        code = int(e.code or 0)
    return made, code


def test_the_block_ends_and_the_replica_closes_leaving_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    ft, code = run(monkeypatch)
    assert code is None and ft.closed == [True]


@pytest.mark.parametrize("error", [RejoinRequired("state lost"), Diverged("digest differs", 10, (1,))])
def test_a_rejoin_exits_with_its_status_at_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                                error: RejoinRequired) -> None:
    with caplog.at_level(logging.ERROR, logger="fthsdp.runtime"):
        ft, code = run(monkeypatch, body_error=error)
    assert code == EXIT_REJOIN and ft.closed == []  # no close: it would wait for abandoned collectives
    assert "exiting to rejoin" in caplog.text and "step=7" in caplog.text


def test_a_finished_job_exits_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    ft, code = run(monkeypatch, body_error=JobFinished("finished at step 60", 60))
    assert code == 0 and ft.closed == [False]
    _, code = run(monkeypatch, start_error=JobFinished("finished at step 60", 60))
    assert code == 0


def test_a_replica_told_in_train_step_that_the_job_ended_reports_the_final_state_it_took(
        monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    """Seen in CI: a joiner refused because the job ended took the final checkpoint inside ``train_step``, whose next
    turn raised ``JobFinished``, and the launcher found no final line ("replica 1 wrote no final state")."""
    path = tmp_path / "progress.jsonl"
    monkeypatch.setenv("FTHSDP_PROGRESS", str(path))
    monkeypatch.setenv("RANK", "0")

    def finished_in_place(ft: Any) -> None:
        ft.finished, ft.step = True, 60  # as ``roles.finished_meanwhile`` leaves it

    ft, code = run(monkeypatch, rank=0, body=finished_in_place, body_error=JobFinished("finished at step 60", 60))
    assert code == 0 and ft.closed == [True]  # closed as at the loop's end (a finished replica leaves nothing)
    rows = [x for x in read_progress(path) if x.event == "final"]
    assert len(rows) == 1 and rows[0].step == 60 and rows[0].extra.get("late") is True, rows


def test_a_replica_dropped_because_the_job_finished_takes_the_final_state_in_place(
        monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    """Seen in CI (``test_a_real_trainer_with_warm_standbys_replaced_twice``): a warm standby released late entered
    the data plane as the others finished; the lighthouse ended its session with "the job finished at step 200",
    its exchanges failed, and it exited to rejoin (one more exit, a cold restart) where the job's final checkpoint
    was there to take. Dropped so, it takes it in place, writes its final line and exits 0; dropped for anything
    else, it still exits to rejoin."""
    from fthsdp.runtime import roles

    path = tmp_path / "progress.jsonl"
    monkeypatch.setenv("FTHSDP_PROGRESS", str(path))
    monkeypatch.setenv("RANK", "0")
    taken: list[tuple[int, str]] = []

    def finished_meanwhile(core: Any, step: int, when: str = "") -> None:
        taken.append((step, when))
        core.finished, core.step = True, step  # as the real one leaves it

    monkeypatch.setattr(roles, "finished_meanwhile", finished_meanwhile)

    def dropped(ft: Any) -> None:
        ft.job_over_at = 200

    ft, code = run(monkeypatch, rank=0, body=dropped, body_error=RejoinRequired("this replica was declared dead"))
    assert code == 0 and ft.closed == [True] and taken and taken[0][0] == 200, (code, ft.closed, taken)
    rows = [x for x in read_progress(path) if x.event == "final"]
    assert len(rows) == 1 and rows[0].step == 200 and rows[0].extra.get("late") is True, rows

    def no_checkpoint(core: Any, step: int, when: str = "") -> None:
        raise JobFinished(f"the job finished at step {step} and left no final checkpoint", step)

    monkeypatch.setattr(roles, "finished_meanwhile", no_checkpoint)
    ft, code = run(monkeypatch, rank=0, body=dropped, body_error=RejoinRequired("this replica was declared dead"))
    assert code == 0 and ft.closed == [False]

    def not_yet(core: Any, step: int, when: str = "") -> None:
        raise RuntimeError("call optimizer(opt) first")

    monkeypatch.setattr(roles, "finished_meanwhile", not_yet)
    ft, code = run(monkeypatch, rank=0, body=dropped, body_error=RejoinRequired("this replica was declared dead"))
    assert code == EXIT_REJOIN and ft.closed == []  # a restart takes the final checkpoint then
    ft, code = run(monkeypatch, rank=0, body_error=RejoinRequired("this replica is behind the others"))
    assert code == EXIT_REJOIN and ft.closed == []


def test_the_step_a_finished_job_named_is_read_from_a_sessions_end() -> None:
    from lighthouse.incarnations import finished_message, finished_step_of

    why = f"Session for replica-1 at 127.0.0.1:1: FAILED_PRECONDITION: {finished_message('replica-1', 'i', 200)}"
    assert finished_step_of(why) == 200
    assert finished_step_of("Session for replica replica-1: FAILED_PRECONDITION: incarnation 'i' was declared dead") \
        is None


def test_other_errors_propagate(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="bad batch"):
        run(monkeypatch, body_error=ValueError("bad batch"))


def test_under_a_launcher_it_writes_the_lines_the_launcher_supervises_by(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: pathlib.Path) -> None:
    path = tmp_path / "progress.jsonl"
    monkeypatch.setenv("FTHSDP_PROGRESS", str(path))
    monkeypatch.setenv("RANK", "0")
    run(monkeypatch, rank=1)
    assert read_progress(path) == []  # rank 1 writes no start and no final line
    run(monkeypatch, rank=0)
    rows = read_progress(path)
    assert [x.event for x in rows] == ["start", "final"] and rows[-1].param_hash == "f00d" and rows[-1].step == 7
    path.unlink()
    with pytest.raises(SlotConflict):  # a restart would meet it again: the launcher is told to stop
        run(monkeypatch, body_error=SlotConflict("two replicas train slot 1"), rank=0)
    assert [x.event for x in read_progress(path)] == ["start", "fatal"]
    path.unlink()
    with pytest.raises(ValueError):  # anything else: no fatal line, the launcher restarts the group
        run(monkeypatch, body_error=ValueError("flaky"), rank=0)
    assert [x.event for x in read_progress(path)] == ["start"]


def test_under_a_launcher_every_committed_step_is_a_row_naming_the_slot_trained(monkeypatch: pytest.MonkeyPatch,
                                                                                tmp_path: pathlib.Path) -> None:
    """The launcher says who trained which slot (``fthsdp run``'s ``trained_by``) from these rows, whatever the
    script writes itself (its own ``on_result`` does not replace them)."""
    path = tmp_path / "progress.jsonl"
    monkeypatch.setenv("FTHSDP_PROGRESS", str(path))
    trained = StepResult(7, 0.5, 3, 2, False, 1, 0.01, ((0, 7), (1, 7)), slot=1)
    zeros = StepResult(8, None, 3, 2, False, 2, 0.02, ((0, 8),), contributed=False)

    def body(ft: Any) -> None:
        ft.on_result = lambda r: None  # the trainer's own hook
        for r in (trained, zeros):
            ft.on_committed(r)

    run(monkeypatch, rank=0, body=body)
    rows = read_progress(path)
    assert [x.event for x in rows] == ["start", "step", "step", "final"]
    one, two = rows[1], rows[2]
    assert (one.step, one.slot, one.contributed, one.batches, one.replica) == (7, 1, True, [[0, 7], [1, 7]], 1)
    assert (two.step, two.slot, two.contributed, two.attempts) == (8, None, False, 2)
    assert trained_by({1: steps_of(rows)}) == {1: {1: 1}}
    assert session.step_row(zeros)["contributed"] is False and "slot" not in session.step_row(zeros)
    made, _ = run(monkeypatch, rank=1)
    assert getattr(made, "on_committed", None) is None  # rank 1 writes none
