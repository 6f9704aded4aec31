"""``fthsdp run``: a user's own training script, fault-tolerantly: one torchrun of S ranks per replica group
running the script with its own arguments untouched (from the current directory), restarts of a group that dies,
a stop on a fatal error, live progress from the lighthouse, and a report. The script uses the runtime
(``with fthsdp.runtime.training() as ft:``).

On one host every group runs here, against an embedded lighthouse on loopback. On several hosts, start the
lighthouse once (``fthsdp lighthouse``) and on each host run that host's groups against it:
``fthsdp run --replicas R --lighthouse ADDR [--lighthouse-http ADDR] --group I [--group J ...] script.py ...``
(with ``FTHSDP_HOST``, ``FTHSDP_TOKEN_FILE`` and a shared ``--checkpoint-dir``, ``deploy/torchrun/README.md``)."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time
import urllib.error
from typing import TYPE_CHECKING, Any

from fthsdp.cli.common import add_carrying_args
from fthsdp.launch.cluster import Cluster, finals
from fthsdp.launch.config import ClusterConfig, Kill, ReplicaFailed
from fthsdp.launch.epochs import epoch_events
from fthsdp.launch.progress import slots_json, steps_of

if TYPE_CHECKING:
    from fthsdp.cli.common import Subparsers


class StatusView:
    """Prints the members' steps and roles, and whether their state digests agree (the lighthouse's ``/status``),
    when they change, at most once a second."""

    def __init__(self, period_s: float = 1.0) -> None:
        self.period_s, self.last, self.shown, self.t0 = period_s, 0.0, "", time.time()
        self.refused = False
        """The lighthouse refused the status to us (said once: no live progress without it)."""

    def __call__(self, cluster: Cluster) -> None:
        now = time.time()
        if now - self.last < self.period_s:
            return
        self.last = now
        try:
            status = cluster.status()
        except urllib.error.HTTPError as e:
            if e.code in (401, 403) and not self.refused:
                self.refused = True
                print(f"fthsdp run: the lighthouse refuses its status to this launcher (HTTP {e.code}): no live "
                      "progress; give it the job's reader credential (--credentials DIR)", file=sys.stderr, flush=True)
            return
        except (OSError, urllib.error.URLError, ValueError):  # not up yet, or no HTTP address: nothing to show
            return
        if not cluster.http:
            return
        cells = [f"{m['replica_id']}: step {m['step']} {m['role']}" for m in status.get("members", [])]
        down = [f"r{g.index}: DOWN" for g in cluster.groups if g.restart_at is not None]
        agreement = status.get("agreement")
        line = f"epoch {status.get('epoch')} | " + " | ".join(cells + down) + \
            (f" | state: {agreement['text']}" if agreement else "")
        if line != self.shown:
            self.shown = line
            print(f"[{now - self.t0:6.1f}s] {line}", flush=True)


def collective_timeout(a: argparse.Namespace) -> float:
    """``--collective-timeout``, else ``FTHSDP_TIMEOUT`` (what the groups would read), else 5 s; ``ValueError`` when
    it is not a positive number."""
    raw = a.collective_timeout if a.collective_timeout is not None else os.environ.get("FTHSDP_TIMEOUT") or 5.0
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"FTHSDP_TIMEOUT={raw!r} is not a number of seconds") from None
    if not value > 0:
        raise ValueError(f"the collective timeout must be > 0 seconds, not {value:g}")
    return value


def problems(final: dict[str, dict[str, Any] | None]) -> list[str]:
    """Why a finished run did not end in agreement: a group with no final state, or final states that differ."""
    out = [f"replica {i} wrote no final state" for i, f in final.items() if f is None]
    states = {(f["step"], f["param_hash"]) for f in final.values() if f is not None}
    if len(states) > 1:
        out.append(f"final states differ: {sorted(states)}")
    return out


def disagreement(cluster: Cluster) -> list[str]:
    """With an external lighthouse whose status this launcher reads: its digests' disagreement, if any (the groups
    run elsewhere have final states this launcher never sees)."""
    if not cluster.config.lighthouse or not cluster.http:
        return []
    try:
        found = cluster.status().get("agreement")
    except (OSError, urllib.error.URLError, ValueError) as e:
        return [f"the lighthouse's status could not be read at the end ({e}): agreement unchecked"]
    return [f"the lighthouse sees the replicas' states {found['text']}"] if found and not found["agree"] else []


def cmd_run(a: argparse.Namespace) -> None:
    script = pathlib.Path(a.script)
    if not script.is_file():
        sys.exit(f"fthsdp run: no such script: {a.script}")
    if (a.group or a.lighthouse_http) and not a.lighthouse:
        sys.exit("fthsdp run: --group and --lighthouse-http need --lighthouse (the job's lighthouse, shared by every "
                 "host's groups)")
    workdir = pathlib.Path(a.workdir) if a.workdir else pathlib.Path(tempfile.mkdtemp(prefix="fthsdp-run-"))
    try:
        config = ClusterConfig(replicas=a.replicas, ranks=a.ranks, command=(str(script), *a.args),
                               kills=tuple(Kill.parse(k) for k in a.kill or []), restart_delay_s=a.restart_delay,
                               max_restarts=a.max_restarts, timeout_s=a.timeout, lighthouse=a.lighthouse,
                               lighthouse_http=a.lighthouse_http, groups=tuple(a.group or ()),
                               checkpoint_dir=a.checkpoint_dir, warm_restarts=a.warm_restarts, spares=a.spares,
                               carry_orphans=a.carry_orphans, deterministic=a.deterministic,
                               credentials=a.credentials, collective_timeout_s=collective_timeout(a))
        groups = config.indices()
        where = f"against the lighthouse at {a.lighthouse}" if a.lighthouse else "with an embedded lighthouse"
        print(f"fthsdp run: replica groups {list(groups)} of {a.replicas} (+{a.spares} spare), {a.ranks} ranks each, "
              f"{where}: {script} "
              f"{' '.join(a.args)}; logs in {workdir}", flush=True)
        cluster = Cluster(config, workdir, on_tick=StatusView())
        t_start, history = cluster.execute()
    except (ValueError, ReplicaFailed, TimeoutError) as e:
        sys.exit(f"fthsdp run: {e} (logs in {workdir})")
    final = finals(cluster)
    slots = slots_json({g.index: steps_of(cluster.progress(g)) for g in cluster.groups})
    by, carried, samples = slots["trained_by"], slots["carried"], slots["samples"]
    report = {"command": [str(script), *a.args], "replicas": a.replicas, "groups": list(groups),
              "ranks_per_replica": a.ranks, "lighthouse": a.lighthouse or "embedded", "t_start": t_start,
              "final": final, "cursors": job_cursors(final), "trained_by": by, "carried": carried, "samples": samples,
              "problems": problems(final) + disagreement(cluster) + (samples["problems"] if samples else []),
              "events": cluster.events + epoch_events(history)}
    if a.report:
        pathlib.Path(a.report).write_text(json.dumps(report, indent=1))
    for p in report["problems"]:
        print(f"fthsdp run: FAILED: {p}", file=sys.stderr)
    if report["problems"]:
        sys.exit(1)
    done = next(iter(final.values()))
    print(f"fthsdp run: every replica group run here ended at step {done['step'] if done else '?'} with one state "
          f"({done['param_hash'][:16] if done else '?'}...)", flush=True)
    for line in summary(final, by, carried, samples):
        print(f"fthsdp run: {line}", flush=True)


def job_cursors(final: dict[str, dict[str, Any] | None]) -> list[int] | None:
    """The job's data cursors at the end, one per slot (batches trained), as a final state reports them (None: the
    script reports none)."""
    return next((f["cursors"] for f in final.values() if f and "cursors" in f), None)


def summary(final: dict[str, dict[str, Any] | None], by: dict[str, dict[str, int]] | None = None,
            carried: dict[str, int] | None = None, samples: dict[str, Any] | None = None) -> list[str]:
    """What the end of a run says besides the state: the batches each data slot trained (from the job's data
    cursors, when the script reports them: ``fthsdp.runtime.training()``/``init()`` do), which replicas trained
    them (``by``: the report's ``trained_by``, from the step rows that name their slot: ``training()``/``init()``
    and the example write them), in how many steps the others carried an orphan slot (``carried``: the report's),
    the run's sample sequence in short (``samples``: the report's, where the trainer records its micro-batches),
    and the groups that came back after the job had ended (they hold the final state and trained nothing after
    their restart)."""
    lines = []
    cursors = job_cursors(final)
    steps = next((f["step"] for f in final.values() if f), 0)
    if cursors is not None:
        short = [f"slot {i}: {c} of {steps}" for i, c in enumerate(cursors) if c < steps]
        lines.append(f"batches trained per data slot: {cursors} (steps: {steps})"
                     + (f"; short: {', '.join(short)}" if short else ""))
    if by:
        lines.append("trained by: " + "; ".join(
            f"slot {k}: " + ", ".join(f"replica {i} ({n})" for i, n in sorted(by[k].items(), key=lambda x: int(x[0])))
            for k in sorted(by, key=int)))
    if carried:
        lines.append("orphan slots carried by the other replicas: " + ", ".join(
            f"slot {k} in {n} step{'s' * (n != 1)}" for k, n in sorted(carried.items(), key=lambda x: int(x[0]))))
    if samples:
        lines.append(f"sample sequence: {samples['micro_batches']} micro-batches in {samples['steps']} steps, digest "
                     f"{samples['digest']} (with orphan slots carried, a run of the same seed has this one, "
                     "failures or not)")
    late = sorted(int(g) for g, f in final.items() if f and f.get("late"))
    if late:
        lines.append(f"replica group(s) {late} came back after the job had ended: they took the final checkpoint "
                     "and trained nothing after their restart")
    return lines


def register(sub: Subparsers) -> None:
    r = sub.add_parser("run", help="run your own training script fault-tolerantly on this host",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--replicas", type=int, default=2, help="replica groups (one torchrun each)")
    r.add_argument("--ranks", type=int, default=1, help="ranks per replica group (FSDP2 shards)")
    r.add_argument("--lighthouse", default="", metavar="HOST:PORT[,HOST:PORT...]",
                   help="the job's lighthouse (gRPC), shared with the groups other hosts run (default: start one "
                   "here, on loopback)")
    r.add_argument("--lighthouse-http", default="", metavar="HOST:PORT",
                   help="with --lighthouse: its HTTP address, for live progress and the digests' agreement")
    r.add_argument("--group", action="append", type=int, default=None, metavar="I",
                   help="with --lighthouse: run only replica group I of --replicas on this host (repeatable)")
    r.add_argument("--checkpoint-dir", default=os.environ.get("FTHSDP_CHECKPOINT_DIR", ""),
                   help="checkpoints (each group's final state, which a group back after the end takes; the job "
                   "resumes from the newest once every group died): on several hosts, storage they all share "
                   "(default: FTHSDP_CHECKPOINT_DIR, else <workdir>/checkpoints)")
    r.add_argument("--kill", action="append", default=None, metavar="REPLICA@STEP[:PHASE]",
                   help="SIGKILL that replica group at that step, to see it recover (repeatable)")
    r.add_argument("--restart-delay", type=float, default=2.0, help="seconds before a dead group restarts")
    r.add_argument("--warm-restarts", action="store_true",
                   help="keep a warm standby of each group (started ahead, held before registering): a "
                   "restart releases it instead of starting cold")
    r.add_argument("--spares", type=int, default=0,
                   help="spare replica groups besides --replicas (indexes --replicas and up): each shadows training "
                   "without a data slot and takes over a dead group's slot in the next epoch; read ft.slot inside "
                   "the closure (next_batch does)")
    add_carrying_args(r, "; the script's loop iterates the step's batches: `for batch in loader:` over "
                      "ft.dataloader(...), or ft.dealt(); train_step calls its closure once per slot dealt "
                      "(read ft.slot inside it, as next_batch does)", ": a run with failures ends bitwise equal to a "
                      "failure-free run of the same seed")
    r.add_argument("--collective-timeout", type=float, default=None, metavar="S",
                   help="deadline of one cross-replica collective, seconds: FTHSDP_TIMEOUT of every group "
                        "(default: $FTHSDP_TIMEOUT, else 5)")
    r.add_argument("--credentials", default="", metavar="DIR",
                   help="a folder `fthsdp secrets --replicas N` wrote: the lighthouse takes its job secret, each "
                        "replica group only its own credential, the launcher reads status with the read-only one")
    r.add_argument("--max-restarts", type=int, default=10, help="restarts of one group before the job is given up")
    r.add_argument("--timeout", type=float, default=24 * 3600.0, help="give up after this many seconds")
    r.add_argument("--workdir", default="", help="logs and progress files (default: a new temporary directory)")
    r.add_argument("--report", default="", help="write the JSON report here (final states, events, epochs)")
    r.add_argument("script", help="the training script (run by torchrun, from the current directory)")
    r.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments, passed untouched")
    r.set_defaults(fn=cmd_run)
