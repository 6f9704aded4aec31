"""``fthsdp bench recovery``: what a failure costs under fthsdp, on the reference workload (docs/design.md §12).

One run of R replica groups with a SIGKILL of group 1 at ``kill_step`` (or of every group ``kills`` names: two
groups killed at the same step measure what a double failure costs the last survivor) and its restart
``restart_delay_s`` later. From the replicas' progress lines (the joiner figures are the first killed group's):

- ``survivor_stall_s``: the survivors' longest gap between two commits after the failure, less their median
  step (detection, the new epoch and the redo; ``fthsdp/launch/recovery_metrics.py``);
- ``catchup_step_ratio``: the survivors' median step while the restarted replica catches up (their steps that
  overlap its first exchange as a member to active) over their median step while it was down (the same replicas
  training, before it entered; the steady step before the kill when no step fits in between, as with a warm
  standby): the catch-up's cost to them (target <= 1.1);
- ``rejoin_s``: the kill -> the restarted replica's first joined step (the restart delay included);
  ``back_to_full_s``: the kill -> the first step every replica contributed to again;
- ``join_s``: the restarted group's process start (a warm standby's release) to active
  (``join_from_registration_s``: from its registration, once Python, torch and the model are up);
- ``transfer_ratio``: the catch-up's throughput (rank 0's bytes over its transfer time) over a plain loopback
  socket copy of the same bytes between two processes, measured in the same run while the job trains
  (target >= 0.5);
- ``ett_common_step``: the effective training time on one common step: distinct replica-steps trained x the
  median step of plain FSDP2-HSDP on the same shape (no failure; the mean of a run just before fthsdp's and one
  just after, in the same invocation: the host's speed drifts over minutes, as ``--vs torchft`` does it) /
  (replicas x wall time from the first to the last commit). ``effective_training_time`` uses the run's own median
  step, so a slower step would score better; this one cannot (``common_ett``).

The lighthouse runs at its own defaults (``at_lighthouse_defaults``: heartbeats every 0.5 s), as a deployment's does
and as ``fthsdp bench overhead``'s; a death is confirmed by its closed session and refused endpoint, not by a
heartbeat timeout, so the interval costs the recovery nothing and the step no CPU for faster heartbeats.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import pathlib
import socket
import statistics
import tempfile
import time
from itertools import pairwise
from typing import Any

from fthsdp.bench.baselines import run_plain
from fthsdp.bench.results import RecoveryResult
from fthsdp.launch.cluster import Cluster
from fthsdp.launch.config import ClusterConfig, Kill, at_lighthouse_defaults
from fthsdp.launch.progress import steps_of

_PIECE = 4 << 20


def _receiver(port_q: mp.Queue[Any], nbytes: int, out_q: mp.Queue[Any]) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    t0 = 0.0
    while got < nbytes:
        n = conn.recv_into(view[got:], min(_PIECE, nbytes - got))
        if n == 0:
            raise RuntimeError("sender closed early")
        if got == 0:
            t0 = time.perf_counter()
        got += n
    out_q.put(time.perf_counter() - t0)
    conn.close()
    srv.close()


def socket_copy_mbps(nbytes: int, repeats: int = 3) -> float:
    """Best throughput (MB/s) of copying ``nbytes`` from one process to another over a loopback socket: the
    baseline of the catch-up transfer (no framing, no checksum, one stream)."""
    ctx = mp.get_context("spawn")
    best = 0.0
    payload = bytes(nbytes)
    for _ in range(repeats):
        port_q: mp.Queue[Any] = ctx.Queue()
        out_q: mp.Queue[Any] = ctx.Queue()
        p = ctx.Process(target=_receiver, args=(port_q, nbytes, out_q), daemon=True)
        p.start()
        port = port_q.get(timeout=60)
        with socket.create_connection(("127.0.0.1", port)) as s:
            view = memoryview(payload)
            for off in range(0, nbytes, _PIECE):
                s.sendall(view[off:off + _PIECE])
            seconds = out_q.get(timeout=120)
        p.join(30)
        best = max(best, nbytes / max(seconds, 1e-9) / 1e6)
    return best


def measure(cluster: Cluster, report: dict[str, Any], socket_mbps: float, warmup: int = 5) -> dict[str, Any]:
    """The recovery figures of a finished run (see the module doc); the joiner is the first group killed."""
    kill = next(e for e in report["events"] if e["event"] == "exit")
    joiner = steps_of(cluster.progress(cluster.groups[kill["replica"]]))
    joined = next(x for x in joiner if x.joined and x.t > kill["t"])
    c = joined.catchup
    if c is None:
        raise RuntimeError(f"the joiner's step {joined.step} records no catch-up")
    launched = max(e["t"] for e in report["events"] if e["event"] == "start" and e["replica"] == kill["replica"]
                   and e["t"] < joined.t)
    registered = next(x.t for x in reversed(cluster.progress(cluster.groups[kill["replica"]]))
                      if x.event == "start" and x.t < joined.t)
    down: list[float] = []
    before: list[float] = []
    catching_up: list[float] = []
    for g in cluster.groups:
        if any(e["event"] == "exit" and e["replica"] == g.index for e in report["events"]):
            continue  # only the groups that never failed
        rows = [x for x in steps_of(cluster.progress(g)) if x.step is not None and x.step >= warmup]
        for a, b in pairwise(rows):
            if a.t < joined.t and b.t > c["member_unix"]:  # a step that overlaps the catch-up (a short one may
                catching_up.append(b.t - a.t)             # end inside no step)
            elif kill["t"] + 1.0 <= a.t and b.t <= c["entered_unix"]:
                down.append(b.t - a.t)  # the same replicas training, before the joiner entered
            elif b.t <= kill["t"]:
                before.append(b.t - a.t)
    transfer_mbps = c["bytes"] / max(c["transfer_s"], 1e-9) / 1e6
    # A warm standby enters about a second after the kill: no whole step fits in between, so the steady step
    # before the kill stands in.
    down_s = statistics.median(down or before) if down or before else float("nan")
    before_s = statistics.median(before) if before else float("nan")
    catchup_s = statistics.median(catching_up) if catching_up else float("nan")
    return {
        # Per failure, as the acceptance and torchft's figure count it (recovery_metrics.stall_per_failure_s): not
        # the run's longest gap overall, which is the warm-up's first step more often than not.
        "survivor_stall_s": max(report["stall_per_failure_s"], default=0.0),
        "catchup_step_ratio": round(catchup_s / down_s, 3),
        "join_s": round(joined.t - launched, 3),
        "join_from_registration_s": round(joined.t - registered, 3),
        "transfer_ratio": round(transfer_mbps / socket_mbps, 3),
        "down_step_s": round(down_s, 4),
        "before_step_s": round(before_s, 4),
        # With orphan slots carried, the survivors train the dead slot's batch too while it is down.
        "down_step_ratio": round(down_s / before_s, 3),
        "catchup_step_s": round(catchup_s, 4),
        "catchup_steps_observed": len(catching_up),
        "catchup_bytes_rank0": c["bytes"],
        "transfer_mbps": round(transfer_mbps, 1),
        "socket_copy_mbps": round(socket_mbps, 1),
        "catchup": c,
        "rejoin_s": report["rejoin_s"],
        "back_to_full_s": _back_to_full(cluster, kill["t"]),
        "effective_training_time": report["effective_training_time"],
        "replica_steps_trained": report["replica_steps_trained"],
        "trained": report["trained"],
        "ett_basis": report["ett_basis"],
        "wall_s": report["wall_s"],
        # The keys every system of ``bench recovery --vs torchft`` reports (fthsdp/bench/vs.py).
        "step_s": report["median_step_s"],
        "stall_s": round(statistics.mean(report["stall_per_failure_s"] or [0.0]), 3),
        "ett": report["effective_training_time"],
        "final_equal": len({f["param_hash"] for f in report["final"].values() if f}) == 1
        and all(report["final"].values()),
    }


def common_ett(trained: int, wall_s: float, replicas: int, common_step_s: float | None) -> float | None:
    """Effective training time on one common step (see the module doc), from what the run trained in its ETT's
    basis (``recovery_metrics``' ``trained``: batches, or replica-steps): None without a common step."""
    if not common_step_s or wall_s <= 0:
        return None
    return round(trained * common_step_s / (replicas * wall_s), 3)


def _back_to_full(cluster: Cluster, killed_at: float) -> float | None:
    """The kill -> the first step after it that every replica contributed to (None: never again)."""
    full = [x.t for g in cluster.groups for x in steps_of(cluster.progress(g))
            if x.t > killed_at and x.contributors == cluster.config.replicas]
    return round(min(full) - killed_at, 3) if full else None


class _SocketBaseline:
    """Measures the plain socket copy once the joiner has caught up, while the job trains: the same load on
    the machine as during the catch-up (on 2 shared cores an idle-machine copy would be several times
    faster than anything measured while training)."""

    def __init__(self, replica: int) -> None:
        self.replica = replica
        self.mbps = 0.0

    def __call__(self, cluster: Cluster) -> None:
        if self.mbps:
            return
        catchups = [x.catchup for x in cluster.progress(cluster.groups[self.replica]) if x.joined and x.catchup]
        if catchups:
            self.mbps = socket_copy_mbps(catchups[-1]["bytes"])


def bench_recovery(replicas: int = 3, ranks: int = 2, steps: int = 60, kill_step: int = 20, model: str = "reference",
                   restart_delay_s: float = 2.0, workdir: str | None = None,
                   kills: tuple[Kill, ...] = (), warm_restarts: bool = False,
                   common_step: bool = True, spares: int = 0, carry_orphans: bool = False,
                   deterministic: bool = False) -> RecoveryResult:
    """One run with ``kills`` (default: group 1 at ``kill_step``), restarts cold or from warm standbys
    (``ClusterConfig.warm_restarts``), with ``spares`` spare groups (``ClusterConfig.spares``); see the module doc.
    ``common_step``: then run plain FSDP2-HSDP on the same shape for ``ett_common_step`` (``--vs`` measures its own
    plain runs, and passes False). ``carry_orphans``: the survivors carry the killed group's slot
    (``down_step_ratio`` is then their step while carrying over their step before). ``deterministic``: the exact sum
    (``FTHSDP_DETERMINISTIC``), and the same job again without it, for ``deterministic_step_ratio``."""
    load = round(os.getloadavg()[0], 2)
    kills = kills or (Kill(1, kill_step),)
    if len({k.replica for k in kills}) >= replicas:
        raise ValueError(f"--kill: {len(kills)} kills leave no survivor among {replicas} replica groups")
    with tempfile.TemporaryDirectory(prefix="fthsdp-bench-recovery-") as tmp:
        wd = pathlib.Path(workdir or tmp)

        def plain(name: str) -> float:
            return float(run_plain(wd / name, steps=steps, replicas=replicas, ranks=ranks, model=model)["step_s"])

        plain_runs = [plain("plain")] if common_step else []
        baseline = _SocketBaseline(kills[0].replica)
        config = ClusterConfig(replicas=replicas, ranks=ranks, steps=steps, model=model, kills=kills,
                               restart_delay_s=restart_delay_s, warm_restarts=warm_restarts, spares=spares,
                               carry_orphans=carry_orphans, deterministic=deterministic)
        cluster = Cluster(at_lighthouse_defaults(config), wd, on_tick=baseline)
        report = cluster.run()
        if not baseline.mbps:
            raise RuntimeError("the restarted replica never caught up: no recovery to measure")
        spec = ",".join(f"{k.replica}@{k.step}:{k.phase}" for k in kills)
        figures = measure(cluster, report, baseline.mbps)
        if common_step:
            plain_runs.append(plain("plain-after"))
        rounded = None
        if deterministic:  # the same job with the default (float) sum: the exact sum's cost, measured here
            other = Cluster(at_lighthouse_defaults(dataclasses.replace(config, deterministic=False)), wd / "default")
            rounded = measure(other, other.run(), baseline.mbps)
        common = round(statistics.mean(plain_runs), 4) if plain_runs else None
        return RecoveryResult(replicas=replicas, ranks_per_replica=ranks, steps=steps, model=model, kill=spec,
                              restart_delay_s=restart_delay_s, warm_restarts=warm_restarts, **figures,
                              common_step_s=common,
                              ett_common_step=common_ett(figures["trained"], figures["wall_s"],
                                                         replicas, common), spares=spares,
                              common_step_runs_s=plain_runs or None, carry_orphans=config.carries,
                              deterministic=deterministic, loadavg_1min=load,
                              deterministic_step_ratio=None if rounded is None else
                              round(figures["before_step_s"] / rounded["before_step_s"], 3))
