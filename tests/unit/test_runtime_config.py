"""The training process's settings (fthsdp/runtime/config.py), read from the environment in one place, and what
they configure: the fault hooks (fthsdp/runtime/faults.py) and the joiner's choice of sources."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from ftar.membership import EpochFeed
from fthsdp.runtime.config import ConfigError, RuntimeConfig, TrainerSettings
from fthsdp.runtime.faults import CATCHUP_PHASES, PHASES, STEP_PHASES, FaultInjector, FaultSettings, Phase
from fthsdp.runtime.join import fetch_sources
from lighthouse import membership as m
from lighthouse.epoch_view import EpochView

BASE = {"FTHSDP_LIGHTHOUSE": "127.0.0.1:1", "FTHSDP_REPLICA_INDEX": "1", "FTHSDP_NUM_REPLICAS": "3",
        "FTHSDP_BACKEND": "gloo"}


def test_defaults() -> None:
    cfg = RuntimeConfig.from_env(BASE)
    assert (cfg.replica_index, cfg.num_replicas, cfg.replica_id, cfg.rank, cfg.world_size) == (1, 3, "replica-1", 0, 1)
    assert cfg.metrics_port is None and cfg.local_rank is None and cfg.device_index == 0
    assert not cfg.under_torchrun and cfg.faults == FaultSettings()


def test_torchrun_variables() -> None:
    cfg = RuntimeConfig.from_env({**BASE, "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                  "TORCHELASTIC_RUN_ID": "x", "FTHSDP_METRICS_PORT": "9400"})
    assert (cfg.rank, cfg.world_size, cfg.local_rank, cfg.device_index) == (3, 4, 1, 1)
    assert cfg.under_torchrun and cfg.faults.kill_agent
    assert cfg.metrics_port == 9401


def test_fault_settings() -> None:
    cfg = RuntimeConfig.from_env({**BASE, "FTHSDP_FAULT": "5:vote", "FTHSDP_FAULT_FILE": "/f",
                                  "FTHSDP_FAULT_SLOW_SERVE_S": "0.05", "FTHSDP_FAULT_CORRUPT_CHUNKS": "2"})
    assert cfg.faults == FaultSettings(spec="5:vote", path="/f", slow_serve_s=0.05, corrupt_chunks=2)
    with pytest.raises(ConfigError, match="FTHSDP_FAULT_CORRUPT_CHUNKS"):
        RuntimeConfig.from_env({**BASE, "FTHSDP_FAULT_CORRUPT_CHUNKS": "many"})


def test_the_slow_fault_stretches_compute_from_its_step_on_and_refuses_bad_values() -> None:
    cfg = RuntimeConfig.from_env({**BASE, "FTHSDP_FAULT_SLOW": "20:3"})
    assert cfg.faults.slow == "20:3"
    faults = FaultInjector.for_rank(cfg.faults, rank=1)  # every rank of the group is slow
    assert (faults.slow_from, faults.slow_factor) == (20, 3.0)
    assert faults.slow_down(19, 0.001) == 0.0 and faults.slow_down(20, 0.0) == 0.0
    assert faults.slow_down(20, 0.001) == pytest.approx(0.002)
    assert FaultInjector.for_rank(FaultSettings(), 0).slow_down(100, 1.0) == 0.0
    one = RuntimeConfig.from_env({**BASE, "FTHSDP_FAULT_SLOW": "20:3:1"}).faults  # only rank 1 of the group
    assert FaultInjector.for_rank(one, 1).slow_from == 20 and FaultInjector.for_rank(one, 0).slow_from == -1
    t0 = time.thread_time()
    assert FaultInjector.for_rank(one, 1).slow_down(20, 0.02) == pytest.approx(0.04)
    # It computes (a slow device's rank is busy), it does not sleep: a sleep costs this thread microseconds of CPU,
    # the spin most of its 0.04 s (not all of it: the spin ends by the clock, and on a busy machine, as under
    # pytest-xdist, the thread waits for a core part of that time).
    assert time.thread_time() - t0 >= 0.01
    for bad in ("20", "x:3", "20:0.5", "-1:2", "20:1000", "20:3:-1", "20:3:x", "20:3:1:2"):
        with pytest.raises(ConfigError, match="FTHSDP_FAULT_SLOW"):
            RuntimeConfig.from_env({**BASE, "FTHSDP_FAULT_SLOW": bad})


def test_the_slow_link_fault_delays_its_lanes_collectives_from_its_step_on_and_refuses_bad_values() -> None:
    cfg = RuntimeConfig.from_env({**BASE, "FTHSDP_FAULT_SLOW_LINK": "20:0.05:1"})  # rank 1's lane only
    assert cfg.faults.slow_link == "20:0.05:1"
    assert FaultInjector.for_rank(cfg.faults, 0).link_hook is None
    assert FaultInjector.for_rank(FaultSettings(), 1).link_hook is None
    faults = FaultInjector.for_rank(cfg.faults, 1)
    hook = faults.link_hook
    assert hook is not None and (faults.link_from, faults.link_delay_s) == (20, 0.05)
    faults.at(19, Phase.EXCHANGE)  # the training thread's step, as the lane's thread sees it
    t0 = time.monotonic()
    hook(0)
    assert time.monotonic() - t0 < 0.05
    faults.at(20, Phase.EXCHANGE)
    t0 = time.monotonic()
    hook(0)
    assert time.monotonic() - t0 >= 0.05
    for bad in ("20", "x:0.1", "20:0", "20:11", "-1:0.1", "20:0.1:-1", "20:0.1:x", "20:0.1:1:2"):
        with pytest.raises(ConfigError, match="FTHSDP_FAULT_SLOW_LINK"):
            RuntimeConfig.from_env({**BASE, "FTHSDP_FAULT_SLOW_LINK": bad})


def test_the_hold_waits_from_its_step_while_the_job_lacks_members_but_never_on_a_joiner() -> None:
    """``FTHSDP_FAULT_HOLD_UNTIL`` (tests): every rank holds before each step from its step on, woken by the epochs
    its feed publishes (``EpochFeed.wait_until``), while the epoch has fewer than its members and none joining (a
    joiner's catch-up needs the others' steps; the lighthouse lets one in at a time); at most its seconds in all;
    said at its step and whenever it waited."""
    cfg = RuntimeConfig.from_env({**BASE, "FTHSDP_FAULT_HOLD_UNTIL": "30:4:10"})
    faults = FaultInjector.for_rank(cfg.faults, 1)  # every rank, not only rank 0
    assert (faults.hold_step, faults.hold_members, faults.hold_s) == (30, 4, 10.0)
    assert FaultInjector.for_rank(RuntimeConfig.from_env({**BASE, "FTHSDP_FAULT_HOLD_UNTIL": "30:3"}).faults,
                                  0).hold_s == 120.0
    feed, lines = EpochFeed(), []

    def epoch(number: int, active: int, joining: int = 0) -> EpochView:
        roles = [m.ACTIVE] * active + [m.JOINING] * joining
        return EpochView("j", number, tuple(m.EpochMember(f"r{i}", "inc", role, 1, m.Endpoints())
                                            for i, role in enumerate(roles)), "", 0.0, "")

    def log(level: int, msg: str, *args: object) -> None:
        assert level == logging.WARNING
        lines.append(msg % args)

    sent: list[int] = []

    def timed(step: int, then: EpochView | None = None, hook: FaultInjector = faults) -> float:
        """Seconds ``hook`` held before ``step``; with ``then``, that epoch is published 0.3 s into the hold and the
        hold must not end before it was (an order, not a duration: the timer's clock is not the hold's)."""
        def publish(epoch: EpochView) -> None:
            sent.append(epoch.number)
            feed.publish(epoch)

        later = threading.Timer(0.3, publish, (then,)) if then is not None else None
        if later is not None:
            later.start()
        t0 = time.monotonic()
        hook.hold(step, feed, log)
        waited = time.monotonic() - t0
        if later is not None:
            assert then is not None and sent[-1:] == [then.number], f"it went on before epoch {then.number} came"
            later.join()
        return waited

    feed.publish(epoch(1, 2))  # two of four groups killed
    assert timed(29) < 1.0 and not lines  # before its step: no wait, no line
    feed.publish(epoch(2, 2, joining=1))  # the first back, catching up: the others step on for it
    assert timed(30) < 1.0 and len(lines) == 1 and "before step 30 for 0.0s" in lines[-1], lines  # said at its step
    assert "a member is joining" in lines[-1], lines
    feed.publish(epoch(3, 3))  # it turned active; the second is not in yet: held until it is
    assert timed(31, then=epoch(4, 3, joining=1)) < 5.0, "it waited out its seconds"  # went on once the joiner came
    assert len(lines) == 2 and "before step 31" in lines[-1] and "an epoch of 4 members" in lines[-1], lines
    feed.publish(epoch(5, 4))
    assert timed(32) < 1.0 and len(lines) == 2  # all in: no wait, no line
    feed.publish(epoch(6, 3))  # a later death: held again until the group is back in
    assert timed(33, then=epoch(7, 3, joining=1)) < 5.0 and "before step 33" in lines[-1], lines
    short = FaultInjector.for_rank(RuntimeConfig.from_env({**BASE, "FTHSDP_FAULT_HOLD_UNTIL": "30:5:0.1"}).faults, 0)
    feed.publish(epoch(8, 4))
    assert timed(40, hook=short) < 1.0 and "no epoch of 5 members within 0.1s in all" in lines[-1], lines
    assert timed(41, hook=short) < 1.0 and len(lines) == 4, lines  # its seconds spent: it never holds again
    for bad in ("30", "x:3", "-1:3", "30:0", "30:3:0", "30:3:601", "30:3:x", "30:3:1:2"):
        with pytest.raises(ConfigError, match="FTHSDP_FAULT_HOLD_UNTIL"):
            RuntimeConfig.from_env({**BASE, "FTHSDP_FAULT_HOLD_UNTIL": bad})


def test_trainer_settings() -> None:
    assert TrainerSettings.from_env({}) == TrainerSettings("", "WARNING", True)
    s = TrainerSettings.from_env({"FTHSDP_PROGRESS": "/p", "FTHSDP_LOG_LEVEL": "INFO", "RANK": "1"})
    assert s == TrainerSettings("/p", "INFO", False)


# --- fault hooks -----------------------------------------------------------------------------------------------


def test_phases_are_the_step_then_the_catchup_phases() -> None:
    assert PHASES == STEP_PHASES + CATCHUP_PHASES
    assert [str(p) for p in STEP_PHASES] == ["forward", "backward", "exchange", "exchange-late", "vote",
                                                "optimizer"]
    assert set(CATCHUP_PHASES) == {"serve", "fetch"} and Phase("fetch") is Phase.FETCH


def test_only_rank_zero_arms_a_fault() -> None:
    settings = FaultSettings(spec="5:vote", path="/f", corrupt_chunks=1)
    zero, one = FaultInjector.for_rank(settings, 0), FaultInjector.for_rank(settings, 1)
    assert (zero.armed, zero.step, zero.phase, zero.path) == (True, 5, "vote", "/f")
    assert (one.armed, one.path) == (False, "")
    assert one.corrupter() is not None  # every rank's catch-up server takes the serve hooks
    assert FaultInjector.for_rank(FaultSettings(spec="7"), 0).phase == "forward"
    with pytest.raises(ValueError, match="FTHSDP_FAULT phase"):
        FaultInjector.for_rank(FaultSettings(spec="5:lunch"), 0)


def test_corrupter_flips_a_byte_in_the_first_chunks_only() -> None:
    corrupt = FaultInjector(corrupt_chunks=1).corrupter()
    assert corrupt is not None and FaultInjector().corrupter() is None
    data = bytearray(b"\x00" * 4)
    assert corrupt(0, 0, data) and data == bytearray(b"\x00\x00\xff\x00")
    assert not corrupt(0, 4, bytearray(4))


# --- the joiner's sources --------------------------------------------------------------------------------------


def member(rid: str, role: str = m.ACTIVE, catchup: str = "h:1") -> m.EpochMember:
    return m.EpochMember(rid, "inc", role, 2, m.Endpoints(catchup=catchup))


def test_fetch_sources_are_the_other_active_members_rotated_by_slot() -> None:
    members = [member("replica-0"), member("replica-1", role=m.JOINING), member("replica-2"),
               member("replica-3"), member("replica-4", catchup="")]
    ids = [s.replica_id for s in fetch_sources(members, "replica-3", slot=3)]
    assert ids == ["replica-2", "replica-0"]  # 3 % 2 = 1: start on the second
    assert [s.replica_id for s in fetch_sources(members, "replica-1", slot=1)] == ["replica-2", "replica-3",
                                                                                  "replica-0"]
    assert fetch_sources([], "replica-1", slot=1) == []


def test_digest_every_defaults_on_and_zero_disables() -> None:
    assert RuntimeConfig.from_env(BASE).digest_every == 10
    assert RuntimeConfig.from_env({**BASE, "FTHSDP_DIGEST_EVERY": "0"}).digest_every == 0
    for bad in ("-1", "often"):
        with pytest.raises(ConfigError, match="FTHSDP_DIGEST_EVERY"):
            RuntimeConfig.from_env({**BASE, "FTHSDP_DIGEST_EVERY": bad})


def test_corrupt_fault_fires_on_rank_zero_at_its_step_only() -> None:
    settings = RuntimeConfig.from_env({**BASE, "FTHSDP_FAULT_CORRUPT": "9"}).faults
    assert settings.corrupt_step == 9
    rank0, rank1 = FaultInjector.for_rank(settings, 0), FaultInjector.for_rank(settings, 1)
    assert [s for s in range(20) if rank0.corrupts(s)] == [9]
    assert not any(rank1.corrupts(s) for s in range(20))
    assert not any(FaultInjector.for_rank(FaultSettings(), 0).corrupts(s) for s in range(20))


def test_scheduler_setting() -> None:
    assert TrainerSettings.from_env({}).scheduler == "none"
    assert TrainerSettings.from_env({"FTHSDP_SCHEDULER": "cosine"}).scheduler == "cosine"
    with pytest.raises(ConfigError, match="FTHSDP_SCHEDULER"):
        TrainerSettings.from_env({"FTHSDP_SCHEDULER": "warmup"})


def test_a_standby_gate_is_read_and_off_by_default() -> None:
    assert RuntimeConfig.from_env(BASE).standby_gate == ""
    assert RuntimeConfig.from_env({**BASE, "FTHSDP_STANDBY_GATE": "/tmp/g"}).standby_gate == "/tmp/g"


def test_spares_ask_for_no_slot_and_indexes_past_them_are_refused() -> None:
    assert RuntimeConfig.from_env(BASE).asked_slot == 1
    spare = RuntimeConfig.from_env({**BASE, "FTHSDP_REPLICA_INDEX": "4", "FTHSDP_SPARES": "2"})
    assert (spare.spares, spare.asked_slot) == (2, -1)
    with pytest.raises(ConfigError, match=r"outside 0\.\.4"):
        RuntimeConfig.from_env({**BASE, "FTHSDP_REPLICA_INDEX": "5", "FTHSDP_SPARES": "2"})
    with pytest.raises(ConfigError, match=r"outside 0\.\.2"):
        RuntimeConfig.from_env({**BASE, "FTHSDP_REPLICA_INDEX": "3"})
    with pytest.raises(ConfigError, match="FTHSDP_SPARES=-1"):
        RuntimeConfig.from_env({**BASE, "FTHSDP_SPARES": "-1"})


def test_how_early_a_spare_trains_a_slot_it_is_handed() -> None:
    assert RuntimeConfig.from_env(BASE).spare_early == 0.5
    assert RuntimeConfig.from_env({**BASE, "FTHSDP_SPARE_EARLY": "0"}).spare_early == 0.0
    assert RuntimeConfig.from_env({**BASE, "FTHSDP_SPARE_EARLY": "1"}).spare_early == 1.0
    for bad in ("-0.1", "1.5"):
        with pytest.raises(ConfigError, match="FTHSDP_SPARE_EARLY"):
            RuntimeConfig.from_env({**BASE, "FTHSDP_SPARE_EARLY": bad})


def test_a_silent_rank_limit_defaults_to_3_s_or_the_collective_timeout_and_zero_turns_it_off() -> None:
    assert RuntimeConfig.from_env(BASE).rank_timeout_s == 3.0
    assert RuntimeConfig.from_env({**BASE, "FTHSDP_TIMEOUT": "2"}).rank_timeout_s == 2.0
    assert RuntimeConfig.from_env({**BASE, "FTHSDP_TIMEOUT": "2", "FTHSDP_RANK_TIMEOUT": "7"}).rank_timeout_s == 7.0
    assert RuntimeConfig.from_env({**BASE, "FTHSDP_RANK_TIMEOUT": "0"}).rank_timeout_s == 0.0
    for bad in ({"FTHSDP_RANK_TIMEOUT": "-1"}, {"FTHSDP_TIMEOUT": "0"}, {"FTHSDP_RANK_TIMEOUT": "soon"}):
        with pytest.raises(ConfigError, match="FTHSDP_(RANK_)?TIMEOUT"):
            RuntimeConfig.from_env({**BASE, **bad})


def test_periodic_checkpoints_are_written_behind_the_steps_unless_turned_off() -> None:
    assert not RuntimeConfig.from_env(BASE).writes_behind  # no directory, no period
    on = {**BASE, "FTHSDP_CHECKPOINT_DIR": "/ck", "FTHSDP_CHECKPOINT_EVERY": "10"}
    assert RuntimeConfig.from_env(on).writes_behind
    assert not RuntimeConfig.from_env({**on, "FTHSDP_CHECKPOINT_ASYNC": "0"}).writes_behind
    assert not RuntimeConfig.from_env({**on, "FTHSDP_CHECKPOINT_EVERY": "0"}).writes_behind
    with pytest.raises(ConfigError, match="FTHSDP_CHECKPOINT_ASYNC"):
        RuntimeConfig.from_env({**on, "FTHSDP_CHECKPOINT_ASYNC": "yes"})


def test_the_exact_sum_needs_orphan_slots_carried() -> None:
    assert not RuntimeConfig.from_env(BASE).deterministic
    on = RuntimeConfig.from_env({**BASE, "FTHSDP_ORPHANS": "carry", "FTHSDP_DETERMINISTIC": "1"})
    assert on.deterministic and on.carry_orphans
    with pytest.raises(ConfigError, match="FTHSDP_DETERMINISTIC=1 needs FTHSDP_ORPHANS=carry"):
        RuntimeConfig.from_env({**BASE, "FTHSDP_DETERMINISTIC": "1"})
