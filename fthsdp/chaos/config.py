"""The settings of a chaos run (``fthsdp chaos``): the schedule's, the local cluster's and the replicas'. The run
turns them into the launcher's ``ClusterConfig`` (``cluster_config``), the one place they reach the processes."""

from __future__ import annotations

from dataclasses import dataclass

from fthsdp.chaos.schedule import HA_KINDS, REPLICA_KINDS
from fthsdp.launch.config import ClusterConfig


@dataclass(frozen=True)
class ChaosConfig:
    seed: int = 0
    """The schedule's seed (``soak``: run i uses seed + i)."""
    replicas: int = 3
    """Replica groups."""
    steps: int = 400
    """Steps per run (faults are drawn up to the last one)."""
    kinds: tuple[str, ...] = REPLICA_KINDS
    """Fault kinds drawn (``fthsdp.chaos.schedule.KINDS``; the HA kinds only with ``ha``)."""
    faults: int = 0
    """Faults per run (0: one per kind)."""
    ha: bool = False
    """A 3-member etcd on loopback and ``lighthouses`` lighthouses on it."""
    lighthouses: int = 3
    """Lighthouses of the HA set."""
    min_step_s: float = 0.15
    """Pace the trainer's steps to at least this long."""
    compute_s: float = 0.1
    """Pad each training forward to at least this long (a steady stand-in compute: the tiny model's own tens of
    milliseconds on shared cores jitter by more than the fail-slow factor, and a chaos run must name no
    straggler)."""
    model: str = "tiny"
    ranks: int = 2
    """Ranks per replica group."""
    timeout_s: float = 600.0
    """Give one run up after this long."""
    heartbeat_timeout_s: float = 4.0
    """The lighthouse's heartbeat timeout."""
    collective_timeout_s: float = 4.0
    """The replicas' collective deadline (``FTHSDP_TIMEOUT``)."""
    hang_s: tuple[float, float] = (6.0, 8.0)
    """A hang lasts a uniform draw from this range."""
    restart_delay_s: float = 0.5
    """A group that exited is restarted this long after."""
    epoch_wait_s: float = 15.0
    """``FTHSDP_EPOCH_WAIT`` of the replicas: a replica continued after a hang finds itself out of the epoch and
    waits this long for one that has it before it exits to rejoin (the runtime's default is 60 s)."""
    log_level: str = "WARNING"
    """``FTHSDP_LOG_LEVEL`` of the replicas (``INFO``: the lanes' rebuilds, where they met, in the replicas' logs)."""
    lane_spread_from: int = 0
    """The lighthouse's ``--lane-spread-from`` (0: its default): from how many members a lane meets on several
    members' stores after a death."""
    last_fault_at: float = 1.0
    """No fault armed past this fraction of the steps (1.0: faults up to the last step; a replica back after the
    job finished takes its final checkpoint)."""

    @property
    def run_kinds(self) -> tuple[str, ...]:
        """The kinds this run draws from: the HA kinds need ``ha``."""
        return self.kinds if self.ha else tuple(k for k in self.kinds if k not in HA_KINDS)

    def cluster_config(self, faults: int) -> ClusterConfig:
        """The local cluster of a run with ``faults`` faults (each may cost a restart or two)."""
        return ClusterConfig(replicas=self.replicas, ranks=self.ranks, steps=self.steps, model=self.model,
                             seed=self.seed, restart_delay_s=self.restart_delay_s, timeout_s=self.timeout_s,
                             heartbeat_timeout_s=self.heartbeat_timeout_s,
                             collective_timeout_s=self.collective_timeout_s, min_step_s=self.min_step_s,
                             compute_s=self.compute_s, lane_spread_from=self.lane_spread_from,
                             max_restarts=4 * faults + 4,
                             env={i: {"FTHSDP_EPOCH_WAIT": str(self.epoch_wait_s), "FTHSDP_LOG_LEVEL": self.log_level}
                                  for i in range(self.replicas)})
