"""``fthsdp demo``: a lighthouse and R replica groups (torchrun, S ranks each) of the example trainer on
loopback; injects the failures asked for, shows live progress, and writes a JSON report and a PNG timeline. It exits
non-zero when the run did not end with one final state on every replica, or the launcher gave it up."""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

from fthsdp.cli.common import add_carrying_args
from fthsdp.cli.run import job_cursors, summary
from fthsdp.cli.trace import write as write_trace
from fthsdp.launch.cluster import Cluster, converged
from fthsdp.launch.config import ClusterConfig, Kill, ReplicaFailed, credential_path
from fthsdp.launch.epochs import epoch_history
from fthsdp.trace.pull import Collector, Follower

if TYPE_CHECKING:
    from fthsdp.cli.common import Subparsers


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
            rows = [x for x in cluster.progress(g) if x.event in ("step", "start")]
            last = rows[-1] if rows else None
            alive = g.proc is not None and g.proc.poll() is None
            if not alive and not g.finished:
                cells.append(f"r{g.index}: DOWN (restarting)")
            elif last is None or last.event == "start" or last.t < g.started_at:
                cells.append(f"r{g.index}: starting" + (" (joining)" if last and last.joining else ""))
            else:
                role = "joined" if last.joined else "active"
                loss = "-" if last.loss is None else f"{last.loss:.3f}"
                done = " done" if g.finished else ""
                cells.append(f"r{g.index}: step {last.step:>3} epoch {last.epoch} {role} loss {loss}{done}")
        print(f"[{now - self.t0:6.1f}s] " + " | ".join(cells), flush=True)


def trace_follower(config: ClusterConfig, cluster: Cluster) -> Follower:
    """Reads every rank's timeline about once a second while the demo runs (``fthsdp.trace.pull``)."""
    from lighthouse.security import read_catchup_key

    key = read_catchup_key(credential_path(config.credentials, 0), "default") if config.credentials else ""
    return Follower(Collector("default", key), cluster.status)


def run_demo(config: ClusterConfig, report_path: pathlib.Path | None, plot_path: pathlib.Path | None,
             keep_logs: pathlib.Path | None = None, trace_path: pathlib.Path | None = None) -> dict[str, Any]:
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="fthsdp-demo-"))
    try:
        kills = ", ".join(f"replica {k.replica} at step {k.step} ({k.phase})" for k in config.kills) or "none"
        print(f"fthsdp demo: {config.replicas} replicas x {config.ranks} ranks, {config.model} model, "
              f"{config.steps} steps; kills: {kills}; restart after {config.restart_delay_s}s", flush=True)
        live = LiveView()
        follower: Follower | None = None

        def tick(c: Cluster) -> None:
            live(c)
            if follower is not None:
                follower.tick()

        cluster = Cluster(config, workdir, on_tick=tick)
        if trace_path is not None:
            follower = trace_follower(config, cluster)
        report = cluster.run()
        report["resumed"] = [{"replica": x.replica, "from_step": x.resumed_from, "t": x.t}
                             for g in cluster.groups for x in cluster.progress(g)
                             if x.event == "start" and x.resumed_from is not None]
    finally:
        if keep_logs is not None:
            shutil.copytree(workdir, keep_logs, dirs_exist_ok=True)
        shutil.rmtree(workdir, ignore_errors=True)
    hashes = {f["param_hash"] for f in report["final"].values() if f}
    missing = sorted(r for r, f in report["final"].items() if not f)
    print(f"\nfinal state hash equal on all {config.replicas} replicas: {len(hashes) == 1 and not missing} "
          f"({next(iter(hashes))[:16] if len(hashes) == 1 else hashes})"
          + (f"; no final state on replica(s) {', '.join(missing)}" if missing else ""))
    killed = {e["replica"] for e in report["events"] if e["event"] == "exit"}
    per_failure = ("none: every replica died" if len(killed) == config.replicas else
                   ", ".join(f"{x}s" for x in report.get("stall_per_failure_s", [])) or "no failure")
    print(f"survivors' stall beyond a median step, per failure: {per_failure} (worst gap of the run, warm-up "
          f"included: {report['survivor_max_stall_s']}s); "
          f"rejoin (kill to first joined step): {report['rejoin_s']}s; "
          f"effective training time: {report['effective_training_time']:.0%}")
    report["cursors"] = job_cursors(report["final"])
    # What each slot trained, by whom, what the others carried, who came back.
    for line in summary(report["final"], report.get("trained_by"), report.get("carried"), report.get("samples")):
        print(line)
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
    if follower is not None and trace_path is not None:
        exits = [{"t": e["t"], "name": f"replica {e['replica']} " + ("killed" if e.get("killed") else
                                                                      f"exited ({e.get('code')})")}
                 for e in report["events"] if e["event"] == "exit"]
        write_trace(follower.collector, epoch_history(report), trace_path, trace_path.with_suffix(".png"), exits)
        print(f"trace: {trace_path} (Perfetto, chrome://tracing), {trace_path.with_suffix('.png')}")
    return report


def failures(report: dict[str, Any]) -> list[str]:
    """Why a finished demo run failed, empty when it did not: every replica must end at the last step with one
    final state hash (``fthsdp.launch.cluster.converged``: hashes that differ, or a replica with no final state),
    and no micro-batch trained twice in a step (the report's ``samples``)."""
    return converged(report, int(report["steps"])) + list((report.get("samples") or {}).get("problems", []))


def exit_code(report: dict[str, Any]) -> int:
    """``fthsdp demo``'s exit status for a finished run: 1 when ``failures`` names any, else 0. (A run the launcher
    gives up, ``ReplicaFailed`` or its timeout, exits 1 before there is a report.)"""
    return 1 if failures(report) else 0


LANE_COLOURS = {"training": "#2e7d32", "joining": "#f9a825", "starting": "#b0bec5", "down": "#c62828"}
"""The timeline's colours per state (``fthsdp.launch.lanes``); the page's for active, joining and failure."""


def smoothed(values: list[float], window: int = 5) -> list[float]:
    """A trailing moving average (the first points average what there is)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_timeline(report: dict[str, Any], path: pathlib.Path) -> None:
    """PNG: one lane per replica (training, joining, starting, down; kills and restarts marked) against time, and
    each replica's loss as a smoothed curve against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, (ax, lx) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [1.4, 1]})
    t0 = report["t_start"]
    replicas = sorted(report["lanes"], key=int)
    for row, replica in enumerate(replicas):
        for state in LANE_COLOURS:
            spans = [(a, b - a) for s, a, b in report["lanes"][replica] if s == state]
            if spans:
                ax.broken_barh(spans, (row - 0.35, 0.7), facecolors=LANE_COLOURS[state])
    for e in report["events"]:
        if e.get("replica") is None or str(e["replica"]) not in replicas:
            continue
        row = replicas.index(str(e["replica"]))
        if e["event"] == "exit":
            ax.plot(e["t"] - t0, row, marker="X", ms=11, color="black", zorder=3)
        elif e["event"] == "start" and e.get("incarnation", 1) > 1:
            ax.plot(e["t"] - t0, row, marker=">", ms=9, color="black", zorder=3)
    ax.set_yticks(range(len(replicas)), [f"replica {r}" for r in replicas])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_title(f"{report['replicas']} replicas x {report['ranks_per_replica']} ranks (X: killed, >: restarted)")
    ax.legend(handles=[Patch(color=c, label=s) for s, c in LANE_COLOURS.items()], loc="upper center",
              bbox_to_anchor=(0.5, -0.15), ncol=4, frameon=False)
    for n, (replica, points) in enumerate(sorted(report["loss"].items(), key=lambda kv: int(kv[0]))):
        points = sorted(points)
        if points:
            lx.plot([p[0] for p in points], smoothed([p[1] for p in points]), "-", lw=1.6, color=f"C{n}",
                    label=f"replica {replica}")
    lx.set_xlabel("step")
    lx.set_ylabel("loss (rank 0 micro-batch, moving average of 5)")
    lx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def kills_of(a: argparse.Namespace) -> tuple[Kill, ...]:
    """The kills a demo injects: ``--kill``s (default ``1@20``) and, with ``--kill-all``, every replica at that
    step. The default kill is the default scenario: ``--kill-all`` is another one, not an addition to it."""
    specs = [] if a.no_kill or (a.kill_all is not None and not a.kill) else (a.kill or ["1@20"])
    kills = tuple(Kill.parse(k) for k in specs)
    if a.kill_all is not None:
        kills += tuple(Kill(r, a.kill_all) for r in range(a.replicas))
    return kills


def cmd_demo(a: argparse.Namespace) -> None:
    try:
        kills = kills_of(a)
        delay = a.restart_delay
        if a.kill_all is not None:
            # Come back once the lighthouse has declared the dead incarnations dead: the first replica back then
            # resumes from the newest checkpoint and the others catch up from it.
            delay = max(delay, ClusterConfig.heartbeat_timeout_s + 1.0)
        config = ClusterConfig(replicas=a.replicas, ranks=a.ranks, steps=a.steps, model=a.model,
                               kills=kills, restart_delay_s=delay, timeout_s=a.timeout,
                               checkpoint_every=a.checkpoint_every, warm_restarts=a.warm_restarts,
                               spares=a.spares, carry_orphans=a.carry_orphans,
                               deterministic=a.deterministic)
        report = run_demo(config, pathlib.Path(a.report) if a.report else None,
                          pathlib.Path(a.plot) if a.plot else None, pathlib.Path(a.keep_logs) if a.keep_logs else None,
                          pathlib.Path(a.trace) if a.trace else None)
    except (ValueError, ReplicaFailed, TimeoutError) as e:
        sys.exit(f"fthsdp demo: {e}")
    for problem in failures(report):
        print(f"fthsdp demo: FAILED: {problem}", file=sys.stderr)
    code = exit_code(report)
    if code:
        sys.exit(code)


def register(sub: Subparsers) -> None:
    dm = sub.add_parser("demo", help="train the example model on R replica groups with failures injected")
    dm.add_argument("--replicas", type=int, default=3)
    dm.add_argument("--ranks", type=int, default=2, help="ranks per replica group (FSDP2 shards)")
    dm.add_argument("--spares", type=int, default=0,
                    help="spare replica groups besides --replicas: each shadows training without a data slot and "
                    "takes over a killed group's slot in the next epoch")
    add_carrying_args(dm, ": every step trains every slot's batch", ": a run with kills ends bitwise equal to one "
                      "without (compare the final hash with --no-kill's)")
    dm.add_argument("--steps", type=int, default=60)
    dm.add_argument("--model", default="reference", help="reference (the benchmark workload) or tiny")
    dm.add_argument("--kill", action="append", default=None,
                    help="REPLICA@STEP[:PHASE], repeatable: SIGKILL that replica group at that step "
                         "(phase: forward, backward, exchange, vote, optimizer); default 1@20")
    dm.add_argument("--no-kill", action="store_true", help="run without failures")
    dm.add_argument("--kill-all", type=int, default=None, metavar="STEP",
                    help="also SIGKILL every replica group at STEP: the job resumes from the newest checkpoint")
    dm.add_argument("--checkpoint-every", type=int, default=10,
                    help="durable checkpoint (torch.distributed.checkpoint) every K steps; 0: none")
    dm.add_argument("--restart-delay", type=float, default=2.0, help="seconds before a killed group restarts")
    dm.add_argument("--warm-restarts", action="store_true",
                    help="keep a warm standby of each group (started ahead, held before registering): a "
                    "restart releases it instead of starting cold")
    dm.add_argument("--report", default="", help="write the JSON report here")
    dm.add_argument("--plot", default="", help="write the PNG timeline here")
    dm.add_argument("--trace", default="",
                    help="read every rank's step timeline each second and write the job's trace here (Chrome "
                    "trace-event JSON for Perfetto or chrome://tracing; a PNG beside it)")
    dm.add_argument("--keep-logs", default="", help="copy the replicas' logs and progress files here")
    dm.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds")
    dm.set_defaults(fn=cmd_demo)
