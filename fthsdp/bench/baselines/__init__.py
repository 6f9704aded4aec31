"""Baselines of ``fthsdp bench recovery --vs torchft``, each run on the reference workload (docs/design.md §12) with the
same failure schedule: torchft (its Manager, lighthouse and process groups), a whole-job restart (torchrun
elastic + checkpoint reload), and plain FSDP2-HSDP without failures (the steady-step baseline). Each returns a
dict with ``step_s``, ``stall_s``, ``rejoin_s`` and ``ett`` (see ``fthsdp.launch.recovery_metrics``)."""

from __future__ import annotations

from typing import Any


def run_torchft(workdir: Any, steps: int = 60, kill_step: int = 20, seed: int = 0, **kw: Any) -> dict[str, Any]:
    from fthsdp.bench.baselines.torchft_run import run_torchft as run

    return run(workdir, steps=steps, kill_step=kill_step, seed=seed, **kw)


def run_restart(workdir: Any, steps: int = 60, kill_step: int = 20, seed: int = 0, **kw: Any) -> dict[str, Any]:
    from fthsdp.bench.baselines.restart import run_restart as run

    return run(workdir, steps=steps, kill_step=kill_step, seed=seed, **kw)


def run_plain(workdir: Any, steps: int = 60, seed: int = 0, **kw: Any) -> dict[str, Any]:
    from fthsdp.bench.baselines.plain import run_plain as run

    return run(workdir, steps=steps, seed=seed, **kw)


__all__ = ["run_plain", "run_restart", "run_torchft"]
