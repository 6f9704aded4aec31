"""``fthsdp bench recovery --vs torchft``: fthsdp's recovery run side by side with torchft and a whole-job restart
on the same workload and failure schedule, and plain FSDP2-HSDP (no failure) as the steady-step baseline, all
measured in the same invocation (these machines drift 10-15% between runs).

``compare(fthsdp_result, workdir)`` runs plain, torchft and the restart baseline and returns the table;
``fthsdp_result`` is fthsdp's own run (``fthsdp.bench.recovery``), a dict with at least ``step_s``, ``stall_s``,
``rejoin_s`` and ``ett``. ``fthsdp.bench.results.format_vs_table`` renders the human table.
"""

from __future__ import annotations

import pathlib
import time
from typing import Any

from fthsdp.bench.baselines import run_plain, run_restart, run_torchft
from fthsdp.bench.recovery import common_ett
from fthsdp.bench.results import format_vs_table

COLUMNS = ("step_s", "step_ratio", "stall_s", "rejoin_s", "ett", "ett_common_step")


def _row(name: str, r: dict[str, Any], plain_step: float, replicas: int) -> dict[str, Any]:
    step = r.get("step_s")
    trained, wall = r.get("trained", r.get("replica_steps_trained")), r.get("wall_s")
    return {
        "system": name,
        "step_s": step,
        "step_ratio": round(step / plain_step, 3) if step and plain_step else None,
        "stall_s": r.get("stall_s"),
        "rejoin_s": r.get("rejoin_s"),
        "ett": r.get("ett"),
        "ett_common_step": common_ett(trained, wall, replicas, plain_step) if trained and wall else None,
        "final_equal": r.get("final_equal"),
    }


def compare(fthsdp_result: dict[str, Any] | None, workdir: pathlib.Path | str, steps: int = 60, kill_step: int = 20,
            seed: int = 0, replicas: int = 3, ranks: int = 1, keep_progress: bool = False) -> dict[str, Any]:
    """The baselines on fthsdp's shape (``replicas`` groups of ``ranks`` ranks; torchft with FSDP2 inside each group
    when ``ranks`` > 1) and the side-by-side table."""
    work = pathlib.Path(workdir)
    t0 = time.time()
    # Plain FSDP2 before and after the failure runs: the machine's load drifts (others' jobs share its 2 cores),
    # and the baseline is their mean.
    plain_before = run_plain(work / "plain", steps=steps, seed=seed, replicas=replicas, ranks=ranks)
    torchft = run_torchft(work / "torchft", steps=steps, kill_step=kill_step, seed=seed, replicas=replicas,
                          ranks=ranks)
    restart = run_restart(work / "restart", steps=steps, kill_step=kill_step, seed=seed, replicas=replicas,
                          ranks=ranks)
    plain_after = run_plain(work / "plain-after", steps=steps, seed=seed, replicas=replicas, ranks=ranks)
    plain = {**plain_before, "step_s": round((plain_before["step_s"] + plain_after["step_s"]) / 2, 4),
             "runs_step_s": [plain_before["step_s"], plain_after["step_s"]],
             "loadavg_1min": plain_before["loadavg_1min"] + plain_after["loadavg_1min"]}
    if not keep_progress:
        for r in (torchft, restart):
            r.pop("progress", None)
            r.pop("events", None)
    base = plain["step_s"]
    table = [_row("fthsdp", fthsdp_result or {}, base, replicas), _row("torchft", torchft, base, replicas),
             _row("whole-job restart", restart, base, replicas),
             {"system": "plain FSDP2-HSDP (no failure)", "step_s": base, "step_ratio": 1.0, "stall_s": None,
              "rejoin_s": None, "ett": None, "ett_common_step": None, "final_equal": None}]
    return {
        "benchmark": "recovery_vs",
        "workload": {"replicas": replicas, "ranks_per_replica": ranks, "steps": steps, "kill": f"1@{kill_step}",
                     "restart_delay_s": 2.0, "model": "reference", "batch": 8, "lr": 3e-4,
                     "warmup_steps": 5},
        "table": table,
        "plain": plain,
        "torchft": torchft,
        "restart": restart,
        "baselines_wall_s": round(time.time() - t0, 1),
        "definitions": {
            "step_s": "median gap between two commits of one replica, steps >= 5",
            "step_ratio": "step_s / plain FSDP2-HSDP step_s (mean of a run before and one after the others)",
            "stall_s": "survivors' longest gap after the failure less the median step (restart: kill -> first "
                       "step after the restart + steps lost since the checkpoint x median step)",
            "rejoin_s": "kill -> first committed step of the restarted replica (restart: of the restarted job)",
            "ett": "distinct replica-steps trained x median step / (replicas x wall time first..last commit)",
            "ett_common_step": "distinct replica-steps trained x plain FSDP2-HSDP's step_s / (replicas x wall time "
                               "first..last commit): one common step for every system",
        },
    }


def main(argv: list[str] | None = None) -> None:
    """``python -m fthsdp.bench.vs [--fthsdp RESULT.json] --workdir DIR [--json]``: the baselines (plain, torchft,
    whole-job restart) beside an fthsdp result measured elsewhere (or none: its row stays empty)."""
    import argparse
    import json
    import tempfile

    p = argparse.ArgumentParser(prog="fthsdp.bench.vs")
    p.add_argument("--fthsdp", default="", help="fthsdp's recovery result (JSON with step_s, stall_s, ...)")
    p.add_argument("--workdir", default="")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-step", type=int, default=20)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    ft = json.loads(pathlib.Path(a.fthsdp).read_text()) if a.fthsdp else None
    work = pathlib.Path(a.workdir or tempfile.mkdtemp(prefix="fthsdp-bench-vs-"))
    result = compare(ft, work, steps=a.steps, kill_step=a.kill_step)
    print(json.dumps(result, indent=2) if a.json else format_vs_table(result))


if __name__ == "__main__":
    main()
