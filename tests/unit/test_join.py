"""The joiner's announcement to the lighthouse (``fthsdp.runtime.join.Joiner._announce``), and the hold-out of a
replica ejected as slow (``_enter_data_plane``)."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest
import torch

from fthsdp.runtime.config import RuntimeConfig
from fthsdp.runtime.errors import FinishedWhileJoining, RejoinRequired
from fthsdp.runtime.faults import FaultInjector
from fthsdp.runtime.join import Joiner
from lighthouse.errors import FencedOut, HeldOut, JobOver
from lighthouse.incarnations import departed_message, finished_message, finished_step_of


class RefusingLighthouse:
    """A lighthouse that refuses this incarnation's Ready with ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def ready(self, role: str, probe_s: float = 0.0) -> int:
        raise self.error


def _refused_joiner(client: Any) -> Joiner:
    def log(level: int, msg: str, *args: object) -> None:
        logging.getLogger("test").log(level, msg, *args)

    config = RuntimeConfig(lighthouse="127.0.0.1:1", replica_index=1, num_replicas=3, replica_id="r1", rank=0,
                           world_size=1)
    return Joiner(config, 0, lambda: 1, client, FaultInjector(), torch.device("cpu"), log, epoch=lambda: None)


def test_a_ready_refused_because_the_incarnation_was_dropped_sends_the_replica_back_not_a_crash() -> None:
    """Seen in a CI run: a refusal escaped as a traceback (exit 1); it must be RejoinRequired (exit 75), after
    which the next incarnation registers."""
    joiner = _refused_joiner(RefusingLighthouse(FencedOut(f"FAILED_PRECONDITION: {departed_message('r1', 'i')}")))
    assert finished_step_of(departed_message("r1", "i")) is None  # not the job's end: no JobOver
    with pytest.raises(RejoinRequired, match="declared dead or left"):
        joiner._announce(0.0, time.monotonic() + 5)


def test_a_ready_refused_because_the_job_finished_tells_every_rank_the_final_step(monkeypatch: Any) -> None:
    """Seen in a CI run: a replica whose Ready came after the job's end exited to rejoin, and only its next
    incarnation learned the job was over (an extra restart). Now every rank learns the final step at once
    (``FinishedWhileJoining``), and the role takes the final checkpoint in place (``roles.finished_meanwhile``)."""
    import fthsdp.runtime.join as join

    told: list[list[int]] = []
    monkeypatch.setattr(join, "from_rank0", lambda values, device: told.append(values) or values)
    refusal = finished_message("r1", "i", 120)
    assert finished_step_of(refusal) == 120
    joiner = _refused_joiner(RefusingLighthouse(JobOver(f"FAILED_PRECONDITION: {refusal}", 120)))
    with pytest.raises(FinishedWhileJoining) as e:
        joiner._enter_data_plane(None, None)  # type: ignore[arg-type]
    assert e.value.step == 120 and told == [[0, 120]]
    assert not joiner.announced


class HoldingLighthouse:
    """A lighthouse that ejected this replica as slow: it holds it out twice, then lets it in."""

    def __init__(self) -> None:
        self.asked: list[float] = []

    def ready(self, role: str, probe_s: float = 0.0) -> int:
        self.asked.append(probe_s)
        if len(self.asked) <= 2:
            raise HeldOut(f"ABORTED: held out: probe {probe_s}")
        return 7


def test_a_held_out_joiner_probes_every_rank_together_and_asks_again_until_let_in(monkeypatch: Any) -> None:
    import fthsdp.runtime.join as join

    probes: list[int] = []
    monkeypatch.setattr(join, "from_rank0", lambda values, device: values)  # one rank: its own values
    monkeypatch.setattr(join, "probe", lambda opt, closure: probes.append(1) or 0.25)
    monkeypatch.setattr(join.time, "sleep", lambda s: None)  # probe pacing, not under test
    client: Any = HoldingLighthouse()
    config = RuntimeConfig(lighthouse="127.0.0.1:1", replica_index=1, num_replicas=3, replica_id="r1", rank=0,
                           world_size=1)
    joiner = Joiner(config, 0, lambda: 1, client, FaultInjector(), torch.device("cpu"),
                    lambda level, msg, *args: None, epoch=lambda: None)
    joiner._enter_data_plane(None, lambda: torch.zeros(()))  # type: ignore[arg-type]
    assert client.asked == [0.0, 0.25, 0.25]  # no probe until asked for one; then one per attempt
    assert len(probes) == 2


class FakeFetch:
    """A fetch that completes (or fails) when told to."""

    def __init__(self, result: object = None, error: Exception | None = None) -> None:
        self.finished, self.waits = False, 0
        self._result, self._error = result, error

    def done(self) -> bool:
        return self.finished

    def wait(self, timeout: float) -> bool:
        self.waits += 1
        if self.waits == 3:  # it completes while the joiner waits
            self.finished = True
        return self.finished

    def result(self, timeout: float | None = None) -> object:
        if self._error is not None:
            raise self._error
        return self._result


def _joiner(monkeypatch: Any) -> Joiner:
    import fthsdp.runtime.join as join

    monkeypatch.setattr(join, "all_ranks", lambda flag, device: flag)  # one rank: its own flag
    config = RuntimeConfig(lighthouse="127.0.0.1:1", replica_index=1, num_replicas=3, replica_id="r1", rank=0,
                           world_size=1)
    return Joiner(config, 0, lambda: 1, None, None, torch.device("cpu"), lambda *a: None,  # type: ignore[arg-type]
                  epoch=lambda: None)


def test_early_takes_the_snapshot_that_comes_in_before_the_steps_exchange(monkeypatch: Any) -> None:
    joiner = _joiner(monkeypatch)
    snapshot = object()
    joiner.fetch = FakeFetch(snapshot)  # type: ignore[assignment]
    assert joiner.early(lambda: False) is snapshot


def test_early_goes_on_exchanging_when_the_exchange_comes_in_first(monkeypatch: Any) -> None:
    joiner = _joiner(monkeypatch)
    fetch = FakeFetch(object())
    joiner.fetch = fetch  # type: ignore[assignment]
    assert joiner.early(lambda: True) is None
    assert fetch.waits == 0 and joiner.fetch is fetch  # not waited on, still fetching
    joiner.fetch = None
    assert joiner.early(lambda: False) is None  # no fetch (dropped after a failure): nothing to wait for


def test_early_drops_a_failed_fetch_and_its_kept_steps(monkeypatch: Any) -> None:
    from fthsdp.catchup.wire import FetchFailed

    joiner = _joiner(monkeypatch)
    joiner.fetch, joiner.fetches = FakeFetch(error=FetchFailed("no source")), 1  # type: ignore[assignment]
    joiner.kept = {7: []}
    assert joiner.early(lambda: False) is None
    assert joiner.fetch is None and not joiner.kept


def test_a_fetch_started_at_the_first_exchange_keeps_that_step_and_is_not_started_again(monkeypatch: Any) -> None:
    """``fetch_from(t)`` at the first exchange (its zeros of t still held back): the snapshot is of t itself, so
    t's averaged gradients are kept for the replay, and the step's settle collects that fetch, not a new one."""
    joiner = _joiner(monkeypatch)
    started: list[int] = []
    registered: list[float] = []
    snapshot = object()

    def start(step: int) -> FakeFetch:
        started.append(step)
        fetch = FakeFetch(snapshot)
        fetch.wait_registered = registered.append  # type: ignore[attr-defined]
        return fetch

    monkeypatch.setattr(joiner, "_start_fetch", start)
    joiner.fetch_from(11)
    assert started == [11] and joiner.target == 11 and joiner.fetches == 1 and len(registered) == 1
    assert joiner.exchanged(11, [], 0) is None  # still fetching
    assert 11 in joiner.kept and started == [11]
    assert joiner.fetch is not None
    joiner.fetch.finished = True  # type: ignore[attr-defined]
    assert joiner.exchanged(12, [], 0) is snapshot
    assert sorted(joiner.kept) == [11, 12]  # both replayed on top of the snapshot of 11


def test_without_an_early_fetch_the_first_settled_step_starts_one_of_the_next(monkeypatch: Any) -> None:
    joiner = _joiner(monkeypatch)
    started: list[int] = []

    def start(step: int) -> FakeFetch:
        started.append(step)
        fetch = FakeFetch(object())
        fetch.wait_registered = lambda timeout: None  # type: ignore[attr-defined]
        return fetch

    monkeypatch.setattr(joiner, "_start_fetch", start)
    assert joiner.exchanged(11, [], 0) is None
    assert started == [12] and joiner.target == 12 and not joiner.kept  # 11 is in the snapshot of 12
