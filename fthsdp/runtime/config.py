"""Runtime settings, read from the environment of each training process (torchrun provides the rank and
world size inside a replica; the launcher provides the rest)."""

from __future__ import annotations

import os
from dataclasses import dataclass


LR_RULES = ("sqrt", "linear", "none")


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


@dataclass(frozen=True)
class RuntimeConfig:
    """What one training process needs to take part in fault-tolerant HSDP."""

    lighthouse: str
    """``FTHSDP_LIGHTHOUSE``: ``host:port[,host:port...]`` of the lighthouse."""
    replica_index: int
    """``FTHSDP_REPLICA_INDEX``: this replica group's index (0-based), also its data slot."""
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
    backend: str = "gloo"
    """``FTHSDP_BACKEND``: ``gloo`` (CPU) or ``nccl`` (GPU); default by whether CUDA is available."""
    timeout_s: float = 5.0
    """``FTHSDP_TIMEOUT``: deadline of one cross-replica collective; a hung peer is given up after it."""
    epoch_wait_s: float = 60.0
    """``FTHSDP_EPOCH_WAIT``: how long a step may wait for a usable epoch before failing."""
    host: str = "127.0.0.1"
    """``FTHSDP_HOST``: the address this rank's catch-up server binds and advertises (reachable by the other
    replicas' ranks)."""
    token: str = ""
    """``FTHSDP_TOKEN_FILE``: file holding the job token; joiners present it to the catch-up servers (and the
    lighthouse checks it when it has one). Empty: no token."""
    lr_rule: str = "sqrt"
    """``FTHSDP_LR_RULE``: degraded-mode learning rate, ``lr = lr_base * f(N_contributing / N_total)`` with f =
    ``sqrt`` (default), ``linear`` or ``none``."""
    checkpoint_dir: str = ""
    """``FTHSDP_CHECKPOINT_DIR``: where durable checkpoints (torch.distributed.checkpoint) go; shared by every
    replica. Empty: no checkpoints, and a job whose replicas all died cannot resume."""
    checkpoint_every: int = 0
    """``FTHSDP_CHECKPOINT_EVERY``: write a checkpoint every K committed steps (0: only on SIGTERM)."""
    join_warmup: bool = True
    """``FTHSDP_JOIN_WARMUP``: a joiner runs one forward and backward (thrown away) before entering the data
    plane, so its slow first step does not hold the others; 0 for a closure that consumes data when called."""
    max_replay: int = 256
    """``FTHSDP_CATCHUP_MAX_REPLAY``: a joiner keeps the averaged gradients of at most this many steps while it
    fetches (one gradient shard each); a fetch slower than that makes it restart (exit 75) and try again."""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "RuntimeConfig":
        e = dict(os.environ if env is None else env)
        index = _int(e, "FTHSDP_REPLICA_INDEX")
        num = _int(e, "FTHSDP_NUM_REPLICAS")
        if not 0 <= index < num:
            raise ConfigError(f"FTHSDP_REPLICA_INDEX={index} is outside 0..{num - 1} (FTHSDP_NUM_REPLICAS={num})")
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
                with open(e["FTHSDP_TOKEN_FILE"], encoding="utf-8") as f:
                    token = f.read().strip()
            except OSError as err:
                raise ConfigError(f"FTHSDP_TOKEN_FILE={e['FTHSDP_TOKEN_FILE']!r} cannot be read: {err}") from None
            if not token:
                raise ConfigError(f"FTHSDP_TOKEN_FILE={e['FTHSDP_TOKEN_FILE']!r} is empty")
        every = _int(e, "FTHSDP_CHECKPOINT_EVERY", "0")
        if every < 0:
            raise ConfigError(f"FTHSDP_CHECKPOINT_EVERY={every} must be >= 0")
        return cls(
            lighthouse=_get(e, "FTHSDP_LIGHTHOUSE"),
            replica_index=index,
            num_replicas=num,
            replica_id=e.get("FTHSDP_REPLICA_ID") or f"replica-{index}",
            rank=_int(e, "RANK", "0"),
            world_size=_int(e, "WORLD_SIZE", "1"),
            job_id=e.get("FTHSDP_JOB", "default"),
            backend=backend,
            timeout_s=_float(e, "FTHSDP_TIMEOUT", "5"),
            epoch_wait_s=_float(e, "FTHSDP_EPOCH_WAIT", "60"),
            host=e.get("FTHSDP_HOST") or "127.0.0.1",
            token=token,
            lr_rule=lr_rule,
            checkpoint_dir=e.get("FTHSDP_CHECKPOINT_DIR", ""),
            checkpoint_every=every,
            max_replay=_int(e, "FTHSDP_CATCHUP_MAX_REPLAY", "256"),
            join_warmup=_int(e, "FTHSDP_JOIN_WARMUP", "1") != 0,
        )
