"""The settings of a local job (``ClusterConfig``) and of its faults (``Kill``): what ``fthsdp run``, ``fthsdp demo``,
the benchmarks and the tests hand the launcher (``fthsdp.launch.cluster``).

The launcher, and every ``fthsdp`` command, never imports torch (about 2.5 s of CPU per process here): ``ftar`` and
``fthsdp.runtime`` do as packages, so the two names taken from them are imported where they are used. A test keeps
it so (``tests/unit/test_layout.py``)."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from dataclasses import dataclass, field

from fthsdp.launch.procutil import child_env
from lighthouse.model import Policy


class ReplicaFailed(RuntimeError):
    """A replica group cannot go on: it reported a fatal error, or failed more than ``max_restarts`` times."""


JOIN_WINDOW_S = 30.0
"""The longest default ``ClusterConfig.join_window_s``."""


@dataclass(frozen=True)
class Kill:
    """SIGKILL of replica group ``replica`` when its rank 0 reaches ``phase`` of ``step``."""

    replica: int
    step: int
    phase: str = "forward"

    @classmethod
    def parse(cls, spec: str) -> Kill:
        """``REPLICA@STEP[:PHASE]``."""
        try:
            replica, rest = spec.split("@", 1)
            step, _, phase = rest.partition(":")
            kill = cls(int(replica), int(step), phase or "forward")
        except ValueError:
            raise ValueError(f"--kill {spec!r}: expected REPLICA@STEP[:PHASE]") from None
        from fthsdp.runtime.faults import PHASES  # here: importing the runtime imports torch (see the module's doc)

        if kill.phase not in PHASES:
            raise ValueError(f"--kill {spec!r}: phase must be one of {PHASES}")
        return kill


@dataclass(frozen=True)
class ClusterConfig:
    """The settings of one local job: the trainer's, the lighthouse's and the replicas' (``replica_env`` turns them
    into each replica group's environment, the one place the launcher writes ``FTHSDP_*``)."""

    replicas: int = 3
    """Replica groups that train a data slot each (one torchrun each; ``FTHSDP_NUM_REPLICAS``)."""
    spares: int = 0
    """Spare replica groups besides them (indexes ``replicas ..``; ``FTHSDP_SPARES``): each shadows training with no
    data slot and takes over a dead group's slot in the next epoch (docs/design.md §7, "Spares"). A spare costs a
    group's devices and one more member in each exchange."""
    carry_orphans: bool = False
    """The survivors train the batches of a dead group's slot (``FTHSDP_ORPHANS=carry``; the lighthouse runs with
    ``--orphan-planes``): a constant global batch (docs/design.md §7, "Orphan slots"). Needs the trainer's own loop
    and no spares."""
    deterministic: bool = False
    """The exact cross-replica sum (``FTHSDP_DETERMINISTIC=1``; implies ``carry_orphans``): a run with failures ends
    bitwise equal to a failure-free run of the same seed (docs/design.md §7, "Bitwise failure transparency")."""
    ranks: int = 2
    """Ranks per replica group (FSDP2 shards)."""
    steps: int = 60
    """Steps the job trains (``fthsdp.examples.train --steps``)."""
    model: str = "reference"
    """``reference`` (the benchmark workload) or ``tiny``."""
    batch: int = 8
    """Sequences per replica per step."""
    layout: str = "fsdp"
    """The replica's layout (``fthsdp.examples.train --layout``: fsdp, tp2, pp2; ``fthsdp.examples.layouts``)."""
    lr: float = 3e-4
    seed: int = 0
    """The model's initial weights and the data."""
    kills: tuple[Kill, ...] = ()
    """SIGKILLs injected through ``FTHSDP_FAULT``, one per incarnation of their group, in step order."""
    restart_delay_s: float = 2.0
    """A group that exited non-zero is restarted this long after."""
    warm_restarts: bool = False
    """Keep a warm standby of each group (the trainer's set-up and a warm-up done, held unregistered at its first
    ``train_step``): a restart releases it, so it costs registration and catch-up, not a cold start. A standby costs
    the group's processes and memory while it waits (no CPU to speak of). A kill armed for a later incarnation goes
    with the standby started for it."""
    standby_nice: int = 19
    """The CPU priority (nice, 0-19; 0: the training's) of a standby started while the job trains, the replacement
    of a released one, until its own release: its cold start must not take the training's CPU on a shared host, as
    on a cluster, where it has a host of its own (``fthsdp.launch.priority``: the autogroup's nice where the
    kernel has them). The standbys started with the job build at the training's priority, while the job starts."""
    timeout_s: float = 900.0
    """The whole job's deadline."""
    heartbeat_interval_s: float = 0.1
    """The lighthouse's ``--heartbeat-interval``."""
    heartbeat_timeout_s: float = 5.0
    """The lighthouse's ``--heartbeat-timeout``."""
    confirm_age_s: float = 0.5
    """The lighthouse's ``--confirm-age``."""
    join_window_s: float | None = None
    """The lighthouse's ``--join-window``: at the job's start, how long after the first group registered the first
    epoch waits for the others before it forms without them. A group that never registers (it failed its
    self-check, or its host never came up) then does not hold the job back; a slow one that comes later joins as
    a joiner. None: half the replicas' smallest ``FTHSDP_EPOCH_WAIT`` (60 s by default), at most 30 s; a value
    given must stay below it, or the first to register would give up waiting first. 0: wait for every group."""
    collective_timeout_s: float = 5.0
    """The replicas' ``FTHSDP_TIMEOUT``."""
    max_restarts: int = 10
    """Restarts of one replica group before the job is given up."""
    straggler_policy: str = "report"
    """The lighthouse's ``--straggler-policy`` (fail-slow: ``report`` or ``eject``)."""
    lane_spread_from: int = 0
    """The lighthouse's ``--lane-spread-from`` (0: its default): from how many members a lane meets on several of
    its members' stores after a death."""
    min_step_s: float = 0.0
    """Pace the trainer's steps that train a batch to at least this long (tests: keeps runs long enough for a
    rejoin; it stands in for compute, so a joiner's zero steps are not paced)."""
    compute_s: float = 0.0
    """Pad each training forward of the example trainer to at least this long (``--compute-s``): a steady stand-in
    compute, for the fail-slow detector (the tiny model's own compute jitters by more than a straggler's factor)."""
    checkpoint_every: int = 0
    """Durable checkpoint every K steps (0: only on SIGTERM, if a directory is set)."""
    checkpoint_dir: str = ""
    """Where checkpoints go (default with ``checkpoint_every``: ``<workdir>/checkpoints``); a job started with a
    checkpoint there resumes from it."""
    final_checkpoint: bool = True
    """Give the replicas a checkpoint directory (``checkpoint_dir`` or ``<workdir>/checkpoints``) even without
    periodic checkpoints: each writes its final state there at the end of the job, and a replica that comes back
    after the job finished takes it (without one it stops with no final state)."""
    env: dict[int, dict[str, str]] = field(default_factory=dict)
    """Extra environment per replica group (tests: fault switches)."""
    lighthouse: str = ""
    """An external lighthouse's gRPC ``host:port[,host:port...]`` (the replicas' ``FTHSDP_LIGHTHOUSE``); empty:
    start one on loopback for this job."""
    lighthouse_http: str = ""
    """The external lighthouse's HTTP ``host:port`` (its ``/status``: live progress and the epoch history); empty:
    run without them."""
    groups: tuple[int, ...] = ()
    """The replica groups this launcher runs, of ``replicas`` (one host's share of a job whose other groups run
    elsewhere against the same ``lighthouse``); empty: all of them."""
    credentials: str = ""
    """A folder ``fthsdp secrets --replicas N`` wrote: the launcher's lighthouse takes its job secret (``token``;
    not needed with an external ``lighthouse``), each replica group ``i`` only its own credential
    (``replicas/replica-<i>.credential``), and the launcher reads the lighthouse's status with the read-only
    ``reader.credential``. Empty: no token (loopback only)."""
    command: tuple[str, ...] = ()
    """A user's script and its arguments, run as they are by each group's torchrun from the current directory
    (``fthsdp run``); empty: the example trainer with this config's ``steps``, ``model``, ``batch``... ."""

    @property
    def carries(self) -> bool:
        """The groups carry orphan slots (``carry_orphans``, or implied by ``deterministic``)."""
        return self.carry_orphans or self.deterministic

    def indices(self) -> tuple[int, ...]:
        """The replica groups this launcher runs; ``ValueError`` when ``groups`` is malformed or needs an external
        lighthouse it lacks."""
        if self.carries and self.spares:
            raise ValueError("carrying orphan slots (--carry-orphans, --deterministic) with --spares: a spare takes "
                             "a dead group's slot, so there is no orphan to carry; carrying beside spares is not built "
                             "yet")
        total = self.replicas + self.spares
        if not self.groups:
            return tuple(range(total))
        bad = [i for i in self.groups if not 0 <= i < total]
        if bad or len(set(self.groups)) != len(self.groups):
            raise ValueError(f"groups {list(self.groups)}: each must be one of 0..{total - 1}, once")
        if not self.lighthouse:
            raise ValueError("running only some replica groups needs the job's lighthouse (the others use it)")
        return tuple(sorted(self.groups))

    def replica_env(self, index: int, lighthouse: str, progress: pathlib.Path, workdir: pathlib.Path,
                    fault: Kill | None) -> dict[str, str]:
        """The environment of replica group ``index``'s torchrun: this process's, less a stray ``FTHSDP_FAULT``,
        plus the replica's settings, ``env[index]`` and the fault armed in this incarnation."""
        env = child_env(FTHSDP_LIGHTHOUSE=lighthouse, FTHSDP_REPLICA_INDEX=str(index),
                        FTHSDP_NUM_REPLICAS=str(self.replicas), FTHSDP_SPARES=str(self.spares),
                        FTHSDP_PROGRESS=str(progress), FTHSDP_BLOCKLIST=str(workdir / "blocklist.jsonl"),
                        FTHSDP_TIMEOUT=str(self.collective_timeout_s))
        # torchrun never restarts a group here (the launcher does, as a new incarnation), so the workers keep
        # sharing the agent's rendezvous store: a second store would bind a port that can be taken meanwhile.
        env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
        if self.checkpoint_every or self.checkpoint_dir or self.final_checkpoint:
            env.update(FTHSDP_CHECKPOINT_DIR=self.checkpoint_dir or str(workdir / "checkpoints"),
                       FTHSDP_CHECKPOINT_EVERY=str(self.checkpoint_every))
        if self.credentials:
            env["FTHSDP_TOKEN_FILE"] = str(credential_path(self.credentials, index))
        if self.carries:
            env["FTHSDP_ORPHANS"] = "carry"
        if self.deterministic:
            env["FTHSDP_DETERMINISTIC"] = "1"
        env.update(self.env.get(index, {}))
        from ftar import nccl_env  # here: importing ftar imports torch (see the module's doc)

        env.update(nccl_env.process_settings(env))  # before the trainer builds any group (ftar.nccl_env)
        env.pop("FTHSDP_FAULT", None)
        if fault is not None:
            env["FTHSDP_FAULT"] = f"{fault.step}:{fault.phase}"
        return env


def credential_path(folder: str, index: int) -> pathlib.Path:
    """Replica group ``index``'s credential in a folder ``fthsdp secrets --replicas`` wrote (its default id)."""
    return pathlib.Path(folder) / "replicas" / f"replica-{index}.credential"


def join_window(config: ClusterConfig, indices: tuple[int, ...]) -> float:
    """``config.join_window_s``, or by default half the smallest ``FTHSDP_EPOCH_WAIT`` of these groups (their
    ``env``, else this process's, else the runtime's 60 s), at most ``JOIN_WINDOW_S``. ``ValueError`` for a window
    below 0 or not below that wait: a replica that registered first must not give up waiting for the first epoch
    before the window lets it form."""
    wait = min(float(config.env.get(i, {}).get("FTHSDP_EPOCH_WAIT", os.environ.get("FTHSDP_EPOCH_WAIT", "60")))
               for i in indices)
    if config.join_window_s is None:
        return min(JOIN_WINDOW_S, wait / 2)
    if config.join_window_s < 0 or config.join_window_s >= wait:
        raise ValueError(f"join_window_s {config.join_window_s:g}: must be >= 0 and below the replicas' "
                         f"FTHSDP_EPOCH_WAIT ({wait:g} s), which the first to register would otherwise run out of")
    return config.join_window_s


def check_credentials(folder: str, indices: tuple[int, ...], own_lighthouse: bool) -> None:
    """``ValueError`` naming what a credentials folder lacks for these replica groups (and the job secret, for a
    lighthouse the launcher starts; a host that only runs groups needs no more than their own files)."""
    base = pathlib.Path(folder)
    secret = (base / "token",) if own_lighthouse else ()
    missing = [str(p) for p in (*secret, base / "reader.credential", *(credential_path(folder, i) for i in indices))
               if not p.is_file()]
    if missing:
        raise ValueError(f"--credentials {folder}: missing {', '.join(missing)} (make them with `fthsdp secrets "
                         f"--out {folder} --host 127.0.0.1 --replicas {max(indices) + 1}`)")


def at_lighthouse_defaults(config: ClusterConfig) -> ClusterConfig:
    """``config`` with the lighthouse at its own defaults (``lighthouse.model.Policy``: heartbeats every 0.5 s), as
    a deployment runs it: what the benchmarks measure. ``ClusterConfig``'s defaults (heartbeats every 0.1 s, which
    cost the replicas and the lighthouse CPU) are a setting for tests."""
    p = Policy()
    return dataclasses.replace(config, heartbeat_interval_s=p.heartbeat_interval_s,
                               heartbeat_timeout_s=p.heartbeat_timeout_s, confirm_age_s=p.confirm_age_s)
