"""``fthsdp demo``: a lighthouse and R replica groups (torchrun, S ranks each) of the example trainer on
loopback; injects the failures asked for, shows live progress, and writes a JSON report and a PNG timeline."""

from __future__ import annotations

import json
import pathlib
import shutil
import tempfile
import time
from typing import Any

from fthsdp.testing.launcher import Cluster, ClusterConfig, plot_timeline


class LiveView:
    """Prints one line per replica (step, epoch, role, loss) about once a second."""

    def __init__(self, period_s: float = 1.0) -> None:
        self.period_s = period_s
        self.last = 0.0
        self.t0 = time.time()

    def __call__(self, cluster: Cluster) -> None:
        now = time.time()
        if now - self.last < self.period_s:
            return
        self.last = now
        cells = []
        for g in cluster.groups:
            rows = [x for x in cluster.progress(g) if x["event"] in ("step", "start")]
            last = rows[-1] if rows else None
            alive = g.proc is not None and g.proc.poll() is None
            if not alive and not g.finished:
                cells.append(f"r{g.index}: DOWN (restarting)")
            elif last is None or last["event"] == "start" or last["t"] < g.started_at:
                cells.append(f"r{g.index}: starting" + (" (joining)" if last and last.get("joining") else ""))
            else:
                role = "joined" if last.get("joined") else "active"
                loss = "-" if last["loss"] is None else f"{last['loss']:.3f}"
                done = " done" if g.finished else ""
                cells.append(f"r{g.index}: step {last['step']:>3} epoch {last['epoch']} {role} loss {loss}{done}")
        print(f"[{now - self.t0:6.1f}s] " + " | ".join(cells), flush=True)


def run_demo(config: ClusterConfig, report_path: pathlib.Path | None, plot_path: pathlib.Path | None,
             keep_logs: pathlib.Path | None = None) -> dict[str, Any]:
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="fthsdp-demo-"))
    try:
        kills = ", ".join(f"replica {k.replica} at step {k.step} ({k.phase})" for k in config.kills) or "none"
        print(f"fthsdp demo: {config.replicas} replicas x {config.ranks} ranks, {config.model} model, "
              f"{config.steps} steps; kills: {kills}; restart after {config.restart_delay_s}s", flush=True)
        cluster = Cluster(config, workdir, on_tick=LiveView())
        report = cluster.run()
        report["resumed"] = [{"replica": x["replica"], "from_step": x["resumed_from"], "t": x["t"]}
                             for g in cluster.groups for x in cluster.progress(g)
                             if x["event"] == "start" and x.get("resumed_from") is not None]
    finally:
        if keep_logs is not None:
            shutil.copytree(workdir, keep_logs, dirs_exist_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)
    hashes = {f["param_hash"] for f in report["final"].values() if f}
    print(f"\nfinal state hash equal on all {config.replicas} replicas: {len(hashes) == 1} "
          f"({next(iter(hashes))[:16] if len(hashes) == 1 else hashes})")
    print(f"survivors' worst stall beyond a median step: {report['survivor_max_stall_s']}s; "
          f"rejoin (kill to first joined step): {report['rejoin_s']}s; "
          f"effective training time: {report['effective_training_time']:.0%}")
    for x in report["resumed"]:
        print(f"replica {x['replica']} resumed the job from the checkpoint of step {x['from_step']} (every replica "
              "had died)")
    for e in report["events"]:
        if e["event"] == "epoch":
            print(f"  epoch {e['epoch']:>2}: {', '.join(e['members'])}  <- {e['reason'][:110]}")
    if report_path is not None:
        report_path.write_text(json.dumps(report, indent=1))
        print(f"report: {report_path}")
    if plot_path is not None:
        plot_timeline(report, plot_path)
        print(f"timeline: {plot_path}")
    return report
