"""Settings of a training process, read from its environment here and nowhere else (torchrun provides the rank
and world size inside a replica; the launcher provides the rest): ``RuntimeConfig`` for the runtime, with the
test-only fault hooks' ``FaultSettings`` and the lighthouse client's security; ``TrainerSettings`` for the
example trainer (``fthsdp.examples.train``)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from fthsdp.runtime.faults import FaultSettings, parse_hold, parse_slow
from lighthouse.config import security_from_env
from lighthouse.security import ClientSecurity, SecurityConfigError, read_catchup_key

LR_RULES = ("sqrt", "linear", "none")
SCHEDULERS = ("none", "cosine", "lambda")
"""The example trainer's LR schedulers (``TrainerSettings.scheduler``)."""


class ConfigError(ValueError):
    """A required setting is missing or malformed; the message names the environment variable."""


def _get(env: dict[str, str], name: str, default: str | None = None) -> str:
    value = env.get(name, default)
    if value is None or value == "":
        raise ConfigError(f"{name} is not set")
    return value


def _int(env: dict[str, str], name: str, default: str | None = None) -> int:
    raw = _get(env, name, default)
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


def _float(env: dict[str, str], name: str, default: str) -> float:
    raw = _get(env, name, default)
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None


def _environ(env: Mapping[str, str] | None) -> dict[str, str]:
    """The process environment (or ``env``, for tests): the one place settings are read from."""
    return dict(os.environ if env is None else env)


def _metrics_port(e: dict[str, str], local_rank: int | None) -> int | None:
    """``FTHSDP_METRICS_PORT + LOCAL_RANK`` (so the ranks of one host do not collide); 0: any free port; None: no
    exporter."""
    raw = e.get("FTHSDP_METRICS_PORT", "")
    if not raw:
        return None
    try:
        base = int(raw)
    except ValueError:
        raise ConfigError(f"FTHSDP_METRICS_PORT={raw!r} (LOCAL_RANK={e.get('LOCAL_RANK')!r}) is not an "
                          "integer") from None
    local = local_rank or 0
    if not 0 <= base + local <= 65535 or base < 0:
        raise ConfigError(f"FTHSDP_METRICS_PORT={base} + LOCAL_RANK={local} is not a port")
    return base + local if base else 0


def _faults(e: dict[str, str]) -> FaultSettings:
    """The fault hooks' settings (``fthsdp.runtime.faults``: tests and demos only)."""
    slow, corrupt = "FTHSDP_FAULT_SLOW_SERVE_S", "FTHSDP_FAULT_CORRUPT_CHUNKS"
    try:
        for name, link in (("FTHSDP_FAULT_SLOW", False), ("FTHSDP_FAULT_SLOW_LINK", True)):
            if e.get(name):
                parse_slow(e[name], link=link)
        if e.get("FTHSDP_FAULT_HOLD_UNTIL"):
            parse_hold(e["FTHSDP_FAULT_HOLD_UNTIL"])
    except ValueError as err:
        raise ConfigError(str(err)) from None
    return FaultSettings(spec=e.get("FTHSDP_FAULT", ""), path=e.get("FTHSDP_FAULT_FILE", ""),
                         slow_serve_s=_float(e, slow, "0") if e.get(slow) else 0.0,
                         corrupt_chunks=_int(e, corrupt) if e.get(corrupt) else 0,
                         corrupt_step=_int(e, "FTHSDP_FAULT_CORRUPT") if e.get("FTHSDP_FAULT_CORRUPT") else -1,
                         kill_agent="TORCHELASTIC_RUN_ID" in e, slow=e.get("FTHSDP_FAULT_SLOW", ""),
                         slow_link=e.get("FTHSDP_FAULT_SLOW_LINK", ""),
                         hold_ready=e.get("FTHSDP_FAULT_HOLD_READY", ""),
                         hold_until=e.get("FTHSDP_FAULT_HOLD_UNTIL", ""))


@dataclass(frozen=True)
class RuntimeConfig:
    """What one training process needs to take part in fault-tolerant HSDP."""

    lighthouse: str
    """``FTHSDP_LIGHTHOUSE``: ``host:port[,host:port...]`` of the lighthouse."""
    replica_index: int
    """``FTHSDP_REPLICA_INDEX``: this replica group's index (0-based). Below ``FTHSDP_NUM_REPLICAS`` it is the data
    slot the replica asks for; from there up (with ``FTHSDP_SPARES``) the replica is a spare: it asks for none.
    The lighthouse decides who trains which slot (``lighthouse.slots``; ``Replica.slot``)."""
    num_replicas: int
    """``FTHSDP_NUM_REPLICAS``: replica groups configured for the job (the learning-rate rule's N_total)."""
    replica_id: str
    """``FTHSDP_REPLICA_ID``: the replica's id at the lighthouse (default ``replica-<index>``)."""
    rank: int
    """``RANK`` (torchrun): rank inside the replica, which is also the FTAR lane."""
    world_size: int
    """``WORLD_SIZE`` (torchrun): ranks per replica (the FSDP2 shard count)."""
    job_id: str = "default"
    """``FTHSDP_JOB``: the lighthouse job."""
    spares: int = 0
    """``FTHSDP_SPARES``: spare replica groups configured for the job (indexes ``N .. N + spares - 1``): each
    shadows training without a data slot and takes a dead replica's slot (docs/design.md §7, "Spares")."""
    spare_early: float = 0.5
    """``FTHSDP_SPARE_EARLY``: a spare handed a dead replica's slot within this fraction of a step (its median step)
    from the step's start trains that very step's batch of the slot, beside the others' compute (they wait at most
    about that much for it, once); later it sends zeros and trains the slot from the next step. 0: never; at most 1.
    The default, half a step: a killed process's session closes 0.3 s after the kill on a loaded 2-core host."""
    carry_orphans: bool = False
    """``FTHSDP_ORPHANS``: ``carry`` (a constant global batch: the micro-batches of a data slot that has no live
    holder, an orphan, are dealt to the replicas that hold a slot, which train them besides their own; docs/design.md
    §7, "Orphan slots") or ``wait`` (the default: an orphan's batches wait for its holder). Carrying needs the
    trainer's own loop iterating the step's batches (``for batch in loader:``, or ``ft.dealt()``), no spares, and a
    lighthouse run with ``--orphan-planes``. The same on every replica."""
    deterministic: bool = False
    """``FTHSDP_DETERMINISTIC=1``: the cross-replica sum is exact (``fthsdp.runtime.exact``: every micro-batch's
    gradient shard in fixed point, summed as integers), so it does not depend on which replica trained which
    micro-batch nor in what order: with orphan slots carried, a run with failures ends bitwise equal to a
    failure-free run of the same seed (docs/design.md §7, "Bitwise failure transparency"). Needs
    ``FTHSDP_ORPHANS=carry``; costs an FSDP2 reduce-scatter per micro-batch and int64 buckets (twice the bytes).
    The same on every replica."""
    micro_batches: int = 1
    """``FTHSDP_MICRO_BATCHES``: micro-batches per data slot and step (the trainer's gradient accumulation), the unit
    an orphan's batch is dealt out in. The same on every replica."""
    backend: str = "gloo"
    """``FTHSDP_BACKEND``: ``gloo`` (CPU) or ``nccl`` (GPU); default by whether CUDA is available."""
    timeout_s: float = 5.0
    """``FTHSDP_TIMEOUT``: deadline of one cross-replica collective; a hung peer is given up after it."""
    rank_timeout_s: float = 3.0
    """``FTHSDP_RANK_TIMEOUT``: a rank of this replica silent this long (stopped, dead, wedged) ends the replica as a
    whole, naming the rank (``fthsdp.runtime.siblings``); the lighthouse's rule for rank 0's heartbeats, applied to
    every rank. Default: 3 s, or ``FTHSDP_TIMEOUT`` if shorter; 0: off."""
    epoch_wait_s: float = 60.0
    """``FTHSDP_EPOCH_WAIT``: how long a step may wait for a usable epoch before failing."""
    host: str = "127.0.0.1"
    """``FTHSDP_HOST``: the address this rank's catch-up server binds and advertises (reachable by the other
    replicas' ranks). Without a token it must be a loopback address (the server refuses to start otherwise)."""
    token: str = ""
    """The catch-up key, from ``FTHSDP_TOKEN_FILE`` (the job secret, or this replica group's credential file from
    ``fthsdp secrets --replicas``; ``lighthouse.security.read_catchup_key``): joiners prove it to the catch-up
    servers and the servers prove it back (HMAC over nonces, never sent). The file's first line is what the
    lighthouse and its data-plane rendezvous are shown (``security``). Empty: no token (catch-up on loopback
    only)."""
    lr_rule: str = "sqrt"
    """``FTHSDP_LR_RULE``: degraded-mode learning rate, ``lr = lr_base * f(N_contributing / N_total)`` with f =
    ``sqrt`` (default), ``linear`` or ``none``."""
    checkpoint_dir: str = ""
    """``FTHSDP_CHECKPOINT_DIR``: where durable checkpoints (torch.distributed.checkpoint) go; shared by every
    replica. Empty: no checkpoints, and a job whose replicas all died cannot resume."""
    checkpoint_every: int = 0
    """``FTHSDP_CHECKPOINT_EVERY``: write a checkpoint every K committed steps (0: only on SIGTERM)."""
    checkpoint_async: bool = True
    """``FTHSDP_CHECKPOINT_ASYNC``: a periodic checkpoint is staged at its commit boundary and written behind the
    next steps (``fthsdp.runtime.checkpoint_writer``); 0: written on the training thread. A SIGTERM's and the end
    of the job's are always written before going on."""
    join_warmup: bool = True
    """``FTHSDP_JOIN_WARMUP``: a joiner runs one forward and backward (thrown away) before entering the data
    plane, so its slow first step does not hold the others; 0 for a closure that consumes data when called."""
    max_replay: int = 256
    """``FTHSDP_CATCHUP_MAX_REPLAY``: a joiner keeps the averaged gradients of at most this many steps while it
    fetches (one gradient shard each); a fetch slower than that makes it restart (exit 75) and try again."""
    digest_every: int = 10
    """``FTHSDP_DIGEST_EVERY``: every K steps the replicas compare a 64-bit digest of their whole state, riding the
    step's exchange (docs/design.md §7); a replica whose state differs is found within K steps. 0: never. The
    same on every replica."""
    step_log: bool = True
    """``FTHSDP_STEP_LOG``: rank 0 logs one line per committed step at INFO (logger ``fthsdp.runtime``: step,
    loss, epoch, contributors, attempts); 0: off."""
    selfcheck: bool = True
    """``FTHSDP_SELFCHECK``: before registering, the group tests its network and devices
    (``fthsdp.runtime.selfcheck``; about 0.1 s); 0: skipped."""
    selfcheck_min_gflops: float = 0.0
    """``FTHSDP_SELFCHECK_MIN_GFLOPS``: the self-check's matmul must reach this throughput (0: not checked)."""
    blocklist: str = ""
    """``FTHSDP_BLOCKLIST``: a file a group that fails its self-check appends its host and reason to (one JSON line),
    for a cluster's supervisor to keep the host out; the local launcher gives such a group up by its ``unhealthy``
    line."""
    timeline_events: int = 4096
    """``FTHSDP_TIMELINE``: this rank keeps its last N events (the phases of each step, marks) in a ring that
    ``fthsdp trace`` reads over the catch-up port (``fthsdp.runtime.timeline``); 0: keeps none."""
    local_rank: int | None = None
    """``LOCAL_RANK`` (torchrun): the rank on this host (None: unset); picks the GPU (default: ``rank``)."""
    metrics_port: int | None = None
    """``FTHSDP_METRICS_PORT``: this rank's Prometheus exporter listens on that port + ``LOCAL_RANK`` (0: any
    free port; unset: no exporter)."""
    standby_gate: str = ""
    """``FTHSDP_STANDBY_GATE``: a warm standby (set by a launcher with warm restarts): the process starts (Python,
    torch, the replica's process group, the catch-up server) and then waits, unregistered, until this file exists;
    the launcher creates it to replace a failed incarnation of the group. Empty: register at once."""
    under_torchrun: bool = False
    """``TORCHELASTIC_RUN_ID`` is set: a worker ends with its torchrun agent (a SIGKILLed replica group leaves no
    worker behind)."""
    security: ClientSecurity = field(default_factory=ClientSecurity)
    """TLS and the token for the lighthouse (``lighthouse.config.security_from_env``: the ``FTHSDP_TLS_*``
    variables and the token file)."""
    faults: FaultSettings = field(default_factory=FaultSettings)
    """Fault injection for tests and demos (``fthsdp.runtime.faults``, its variables documented there)."""

    @property
    def asked_slot(self) -> int:
        """The data slot this replica asks the lighthouse for: its index, or none (-1) for a spare."""
        return self.replica_index if self.replica_index < self.num_replicas else -1

    @property
    def writes_behind(self) -> bool:
        """Periodic checkpoints are written off the training thread (a directory, a period and
        ``checkpoint_async``)."""
        return bool(self.checkpoint_dir and self.checkpoint_every and self.checkpoint_async)

    @property
    def device_index(self) -> int:
        """The GPU of this rank (with ``nccl``)."""
        return self.rank if self.local_rank is None else self.local_rank

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RuntimeConfig:
        e = _environ(env)
        index = _int(e, "FTHSDP_REPLICA_INDEX")
        num = _int(e, "FTHSDP_NUM_REPLICAS")
        spares = _int(e, "FTHSDP_SPARES", "0")
        if num < 1 or spares < 0:
            raise ConfigError(f"FTHSDP_NUM_REPLICAS={num} must be >= 1 and FTHSDP_SPARES={spares} >= 0")
        if not 0 <= index < num + spares:
            raise ConfigError(f"FTHSDP_REPLICA_INDEX={index} is outside 0..{num + spares - 1} "
                              f"(FTHSDP_NUM_REPLICAS={num}, FTHSDP_SPARES={spares})")
        default_backend = "gloo"
        try:
            import torch

            default_backend = "nccl" if torch.cuda.is_available() else "gloo"
        except ImportError:  # the config can be read without torch (tools)
            pass
        backend = e.get("FTHSDP_BACKEND", default_backend)
        if backend not in ("gloo", "nccl"):
            raise ConfigError(f"FTHSDP_BACKEND={backend!r} must be gloo or nccl")
        lr_rule = e.get("FTHSDP_LR_RULE", "sqrt")
        if lr_rule not in LR_RULES:
            raise ConfigError(f"FTHSDP_LR_RULE={lr_rule!r} must be one of {', '.join(LR_RULES)}")
        token = ""
        if e.get("FTHSDP_TOKEN_FILE"):
            try:
                token = read_catchup_key(e["FTHSDP_TOKEN_FILE"], e.get("FTHSDP_JOB", "default"))
            except SecurityConfigError as err:
                raise ConfigError(f"FTHSDP_TOKEN_FILE={e['FTHSDP_TOKEN_FILE']!r}: {err}") from None
        local_rank = _int(e, "LOCAL_RANK") if e.get("LOCAL_RANK") else None
        every = _int(e, "FTHSDP_CHECKPOINT_EVERY", "0")
        if every < 0:
            raise ConfigError(f"FTHSDP_CHECKPOINT_EVERY={every} must be >= 0")
        digest_every = _int(e, "FTHSDP_DIGEST_EVERY", "10")
        if digest_every < 0:
            raise ConfigError(f"FTHSDP_DIGEST_EVERY={digest_every} must be >= 0")
        timeout = _float(e, "FTHSDP_TIMEOUT", "5")
        rank_timeout = _float(e, "FTHSDP_RANK_TIMEOUT", str(min(3.0, timeout)))
        if rank_timeout < 0 or timeout <= 0:
            raise ConfigError(f"FTHSDP_TIMEOUT={timeout:g} must be > 0 and FTHSDP_RANK_TIMEOUT={rank_timeout:g} >= 0")
        timeline = _int(e, "FTHSDP_TIMELINE", "4096")
        if timeline < 0:
            raise ConfigError(f"FTHSDP_TIMELINE={timeline} must be >= 0 (events kept; 0: none)")
        spare_early = _float(e, "FTHSDP_SPARE_EARLY", "0.5")
        if not 0 <= spare_early <= 1:
            raise ConfigError(f"FTHSDP_SPARE_EARLY={spare_early:g} must be between 0 and 1")
        orphans = e.get("FTHSDP_ORPHANS") or "wait"
        micro_batches = _int(e, "FTHSDP_MICRO_BATCHES", "1")
        if orphans not in ("carry", "wait") or micro_batches < 1:
            raise ConfigError(f"FTHSDP_ORPHANS={orphans!r} must be carry or wait and FTHSDP_MICRO_BATCHES="
                              f"{micro_batches} >= 1")
        deterministic = _int(e, "FTHSDP_DETERMINISTIC", "0") != 0
        if deterministic and orphans != "carry":
            raise ConfigError("FTHSDP_DETERMINISTIC=1 needs FTHSDP_ORPHANS=carry: without it a dead replica's batches "
                              "are not trained, and no sum makes that run equal to a failure-free one")
        if orphans == "carry" and spares:
            raise ConfigError(f"FTHSDP_ORPHANS=carry with FTHSDP_SPARES={spares}: a spare takes a dead replica's slot "
                              "(no orphan to carry); carrying beside spares is not built yet")
        return cls(
            lighthouse=_get(e, "FTHSDP_LIGHTHOUSE"),
            replica_index=index,
            num_replicas=num,
            replica_id=e.get("FTHSDP_REPLICA_ID") or f"replica-{index}",
            rank=_int(e, "RANK", "0"),
            world_size=_int(e, "WORLD_SIZE", "1"),
            job_id=e.get("FTHSDP_JOB", "default"),
            spares=spares,
            spare_early=spare_early,
            carry_orphans=orphans == "carry",
            micro_batches=micro_batches,
            deterministic=deterministic,
            backend=backend,
            timeout_s=timeout,
            rank_timeout_s=rank_timeout,
            epoch_wait_s=_float(e, "FTHSDP_EPOCH_WAIT", "60"),
            host=e.get("FTHSDP_HOST") or "127.0.0.1",
            token=token,
            lr_rule=lr_rule,
            checkpoint_dir=e.get("FTHSDP_CHECKPOINT_DIR", ""),
            checkpoint_every=every,
            checkpoint_async=_int(e, "FTHSDP_CHECKPOINT_ASYNC", "1") != 0,
            max_replay=_int(e, "FTHSDP_CATCHUP_MAX_REPLAY", "256"),
            join_warmup=_int(e, "FTHSDP_JOIN_WARMUP", "1") != 0,
            digest_every=digest_every,
            step_log=_int(e, "FTHSDP_STEP_LOG", "1") != 0,
            timeline_events=timeline,
            selfcheck=_int(e, "FTHSDP_SELFCHECK", "1") != 0,
            selfcheck_min_gflops=_float(e, "FTHSDP_SELFCHECK_MIN_GFLOPS", "0"),
            blocklist=e.get("FTHSDP_BLOCKLIST", ""),
            local_rank=local_rank,
            metrics_port=_metrics_port(e, local_rank),
            standby_gate=e.get("FTHSDP_STANDBY_GATE", ""),
            under_torchrun="TORCHELASTIC_RUN_ID" in e,
            security=security_from_env(e),
            faults=_faults(e),
        )


@dataclass(frozen=True)
class TrainerSettings:
    """The example trainer's own settings, read before (and apart from) the runtime's: it must report a
    malformed runtime setting, and its ``--plain`` baseline runs without one."""

    progress: str = ""
    """``FTHSDP_PROGRESS``: rank 0 appends one JSON line per committed step to this file (``--progress``)."""
    log_level: str = "WARNING"
    """``FTHSDP_LOG_LEVEL``: the Python log level."""
    rank0: bool = True
    """``RANK`` is 0 (or unset): this process writes the progress lines."""
    scheduler: str = "none"
    """``FTHSDP_SCHEDULER``: the example's LR scheduler, ``none``, ``cosine`` (``CosineAnnealingLR``) or ``lambda``
    (``LambdaLR``) (``--scheduler``; the local launcher passes it this way)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> TrainerSettings:
        e = _environ(env)
        scheduler = e.get("FTHSDP_SCHEDULER") or "none"
        if scheduler not in SCHEDULERS:
            raise ConfigError(f"FTHSDP_SCHEDULER={scheduler!r} must be one of {', '.join(SCHEDULERS)}")
        return cls(progress=e.get("FTHSDP_PROGRESS", ""), log_level=e.get("FTHSDP_LOG_LEVEL", "WARNING"),
                   rank0=e.get("RANK", "0") == "0", scheduler=scheduler)
