"""The benchmarks' results, typed, and their human tables: what ``fthsdp bench ...`` and ``fthsdp sim`` print.
``to_json()`` gives the JSON document (``--json``; the keys ``docs/bench-data/*.json`` hold and ``fthsdp.bench.docs``
reads); ``format_*`` the table."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol, cast


class Result(Protocol):
    def to_json(self) -> dict[str, Any]: ...


class _AsJson:
    def to_json(self) -> dict[str, Any]:
        """The JSON document: every field, in order."""
        out: dict[str, Any] = dataclasses.asdict(cast(Any, self))
        return out


# --- bench lighthouse -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LighthouseRun(_AsJson):
    """One replica count of ``fthsdp bench lighthouse`` (``fthsdp.bench.lighthouse``'s module doc)."""

    replicas: int
    ranks_per_replica: int
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    bootstrap_s: float
    epoch_message_bytes: int
    """The full epoch (every member), as the Status call returns it."""
    epoch_change_bytes: int
    """What one death's epoch change cost each member on its session (median; a delta: O(changed))."""
    heartbeats_per_s: float
    heartbeats_offered_per_s: float
    heartbeat_ratio: float
    lighthouse_cpu_pct: float
    emulator_cpu_pct: float
    lighthouse_connections: int
    """TCP connections established to the lighthouse's port in steady state."""
    lighthouse_streams: int
    """Sessions and watch streams the lighthouse held open in steady state (its /metrics)."""
    deaths: int
    detect_p50_s: float
    detect_p99_s: float
    push_p50_s: float
    push_p99_s: float
    death_to_all_p50_s: float
    death_to_all_p99_s: float
    rejoins: int
    rejoin_to_all_p50_s: float | None
    rejoin_to_all_p99_s: float | None
    rejoin_push_p50_s: float | None
    rejoin_push_p99_s: float | None
    lighthouse_cpu_pct_churn: float
    emulator_cpu_pct_churn: float
    churn_s: float
    cancelled_calls: int
    call_errors: dict[str, int]
    """Failed calls and broken streams of the emulated replicas, by status code."""
    healthy_evicted: int
    """Live emulated replicas the lighthouse declared dead."""
    loadavg_1min: float
    measured_at: str


@dataclass(frozen=True)
class LighthouseResult(_AsJson):
    cpus: int | None
    sizes: list[LighthouseRun]
    benchmark: str = "lighthouse"
    torchft: list[dict[str, Any]] | None = None
    """``--vs torchft``: torchft's lighthouse at the same sizes (``fthsdp.bench.baselines.torchft_lighthouse``)."""
    lanes: list[dict[str, Any]] | None = None
    """Per size, the lanes' rebuild after a death, on their members' stores and on the lighthouse
    (``fthsdp.bench.lane_rebuild.bench_lanes``): ``lane_rebuild_p99_s`` and its baseline."""

    def to_json(self) -> dict[str, Any]:
        out = {"benchmark": self.benchmark, "cpus": self.cpus, "sizes": [r.to_json() for r in self.sizes]}
        if self.torchft is not None:
            out["torchft"] = self.torchft
        if self.lanes is not None:
            out["lanes"] = self.lanes
        return out


def format_lighthouse(r: LighthouseResult) -> str:
    lines = [f"{'replicas':>8} {'ranks':>5} {'boot s':>7} {'change B':>8} {'lh cpu%':>7} {'conns':>6} {'streams':>7} "
             f"{'detect p50':>10} {'push p99':>9} {'death->all p50/p99':>19} {'rejoin->all p99':>15} "
             f"{'cancelled':>9} {'evicted':>7}"]
    for x in r.sizes:
        lines.append(f"{x.replicas:>8} {x.ranks_per_replica:>5} {x.bootstrap_s:>7} {x.epoch_change_bytes:>8} "
                     f"{x.lighthouse_cpu_pct:>7} {x.lighthouse_connections:>6} {x.lighthouse_streams:>7} "
                     f"{x.detect_p50_s:>10} {x.push_p99_s:>9} "
                     f"{x.death_to_all_p50_s:>9}/{x.death_to_all_p99_s:<9} {x.rejoin_to_all_p99_s!s:>15} "
                     f"{x.cancelled_calls:>9} {x.healthy_evicted:>7}")
    for lane in r.lanes or ():
        mine, base = lane["members"], lane["lighthouse"]
        errors = mine["errors"] + base["errors"]
        lines.append(f"lanes {lane['replicas']} x {lane['ranks_per_group']} ({mine['lanes_sampled']} of "
                     f"{mine['lanes_total']} lanes emulated, {mine['backend']}): rebuild p99 "
                     f"{mine['lane_rebuild_p99_s']} s on the members ({mine['lighthouse_calls_per_change']:g} "
                     f"lighthouse calls per death), {base['lane_rebuild_p99_s']} s on the lighthouse "
                     f"({base['lighthouse_calls_per_change_projected']:g} calls per death for every lane: at least "
                     f"{base['lighthouse_rebuild_projected_s']} s){'; ERRORS ' + str(errors) if errors else ''}")
    for t in r.torchft or ():
        if t.get("skipped"):
            lines.append(f"torchft {t['replicas']:>8}: {t['skipped']}")
            continue
        lines.append(f"torchft {t['replicas']:>8}: bootstrap {t.get('bootstrap_s')} s, death -> all "
                     f"{t.get('death_to_all_s')} s ({t.get('after_timeout_s')} s after its "
                     f"{t['heartbeat_timeout_s']:g} s heartbeat timeout){'; ' + t['error'] if t.get('error') else ''}")
    return "\n".join(lines)


# --- bench ftar -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FtarResult(_AsJson):
    """``fthsdp bench ftar`` (``fthsdp.bench.ftar``'s module doc)."""

    members: int
    mb: float
    baseline_allreduce_s: float
    ftar_allreduce_s: float
    baseline_gbps: float
    ftar_gbps: float
    throughput_ratio: float
    baseline_average_s: float
    ftar_average_keep_inputs_s: float
    average_keep_inputs_ratio: float
    rebuild_s: float
    first_build_s: float
    kill_stall_s: float
    normal_exchange_s: float
    contributors_after_kill: int
    benchmark: str = "ftar"
    backend: str = "gloo"

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        return {"benchmark": d.pop("benchmark"), "backend": d.pop("backend"), **d}


def format_ftar(r: FtarResult) -> str:
    return "\n".join([
        f"FTAR vs torch.distributed.all_reduce, {r.members} members, {r.mb} MB, {r.backend}",
        f"  all_reduce {r.baseline_allreduce_s}s  FTAR {r.ftar_allreduce_s}s  throughput ratio {r.throughput_ratio}",
        f"  rebuild for a new epoch {r.rebuild_s}s  stall on SIGKILL mid-exchange {r.kill_stall_s}s"])


# --- bench overhead -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OverheadResult(_AsJson):
    """``fthsdp bench overhead`` (``fthsdp.bench.overhead``'s module doc)."""

    replicas: int
    ranks_per_replica: int
    model: str
    steps: int
    warmup_steps: int
    rounds: int
    heartbeat_interval_s: float
    """The lighthouse's heartbeat interval in the fthsdp runs (its default)."""
    baseline_step_s: float
    fthsdp_step_s: float
    step_time_ratio: float
    """The median of ``round_ratios``."""
    round_ratios: list[float]
    """Per round, its fthsdp run's median step over its baseline run's."""
    baseline_runs_s: list[float]
    fthsdp_runs_s: list[float]
    benchmark: str = "overhead"
    baseline: str = "plain FSDP2-HSDP (replicate x shard mesh, one torchrun)"
    layout: str = "fsdp"
    """The replica's layout, the same in the baseline (``fthsdp.examples.layouts``)."""
    span_cost_us: float | None = None
    """Against the timeline off: what one recorded span costs here, in microseconds."""
    spans_per_step: int | None = None
    """Against the timeline off: spans one rank records per step."""

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        head = {"benchmark": d.pop("benchmark")}
        head.update((k, d.pop(k)) for k in ("replicas", "ranks_per_replica", "layout", "model", "steps",
                                            "warmup_steps", "rounds", "baseline", "heartbeat_interval_s"))
        return {**head, **d}


def format_overhead(r: OverheadResult) -> str:
    return "\n".join([
        f"{r.replicas} replicas x {r.ranks_per_replica} ranks ({r.layout}), {r.model} model, median of steps >= "
        f"{r.warmup_steps}",
        f"  {r.baseline}: {r.baseline_step_s}s/step  fthsdp {r.fthsdp_step_s}s/step  ratio {r.step_time_ratio}",
        f"  per round: {r.round_ratios}"]
        + ([f"  one span {r.span_cost_us} us, {r.spans_per_step} per step: "
            f"{r.span_cost_us * r.spans_per_step / 1e6 / r.fthsdp_step_s:.2e} of a step"]
           if r.span_cost_us is not None and r.spans_per_step and r.fthsdp_step_s else []))


# --- bench recovery -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RecoveryResult(_AsJson):
    """fthsdp's run of ``fthsdp bench recovery`` (``fthsdp.bench.recovery``'s module doc)."""

    replicas: int
    ranks_per_replica: int
    steps: int
    model: str
    kill: str
    restart_delay_s: float
    warm_restarts: bool
    """The restarted group was a warm standby (``ClusterConfig.warm_restarts``), not a cold start."""
    survivor_stall_s: float
    catchup_step_ratio: float
    join_s: float
    join_from_registration_s: float
    transfer_ratio: float
    down_step_s: float
    catchup_step_s: float
    catchup_steps_observed: int
    catchup_bytes_rank0: int
    transfer_mbps: float
    socket_copy_mbps: float
    catchup: dict[str, Any]
    """The joiner's catch-up record, as its progress row has it."""
    rejoin_s: float | None
    back_to_full_s: float | None
    effective_training_time: float
    replica_steps_trained: int
    wall_s: float
    """The first commit to the last, of any replica."""
    # The keys every system of ``bench recovery --vs torchft`` reports (fthsdp/bench/vs.py).
    step_s: float
    stall_s: float
    ett: float
    final_equal: bool
    common_step_s: float | None = None
    """Plain FSDP2-HSDP's median step on the same shape, measured in the same invocation (None with ``--vs``,
    whose table has its own)."""
    ett_common_step: float | None = None
    """``fthsdp.bench.recovery.common_ett``: the effective training time on the common step."""
    spares: int = 0
    """Spare replica groups besides ``replicas`` (``ClusterConfig.spares``): a spare takes the killed group's slot."""
    common_step_runs_s: list[float] | None = None
    """The plain runs ``common_step_s`` is the mean of: one just before fthsdp's run, one just after."""
    trained: int = 0
    """What the ETT counts (``fthsdp.launch.recovery_metrics``): the batches the job trained, in ``ett_basis``."""
    ett_basis: str = "batches"
    """"batches" (the rows report them) or "replica-steps"."""
    before_step_s: float = 0.0
    """The survivors' median step before the kill."""
    down_step_ratio: float = 0.0
    """Their median step while the killed group was down over ``before_step_s`` (carrying its slot, with
    ``carry_orphans``)."""
    carry_orphans: bool = False
    """The survivors carried the killed group's slot (``ClusterConfig.carry_orphans``)."""
    deterministic: bool = False
    """The exact cross-replica sum (``ClusterConfig.deterministic``)."""
    deterministic_step_ratio: float | None = None
    """With ``deterministic``: the steady step (before the kill) over the same job's with the default sum, run
    after it in the same invocation."""
    loadavg_1min: float | None = None
    """The 1-minute load average when the invocation began."""


@dataclass(frozen=True)
class RecoveryReport:
    """``fthsdp bench recovery``: fthsdp's run and, with ``--vs torchft``, the side-by-side comparison
    (``fthsdp.bench.vs.compare``'s document, merged at the top level)."""

    fthsdp: RecoveryResult
    vs: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        f = self.fthsdp
        ett_common = f.ett_common_step
        if self.vs is not None:  # the table's plain runs give the common step
            ett_common = next((r.get("ett_common_step") for r in self.vs.get("table", []) if r["system"] == "fthsdp"),
                              ett_common)
        return {"rejoin_s": f.rejoin_s, "back_to_full_s": f.back_to_full_s, "restart_delay_s": f.restart_delay_s,
                "warm_restarts": f.warm_restarts, "ett_common_step": ett_common, "spares": f.spares,
                "fthsdp": f.to_json(),
                **(self.vs or {})}


def format_recovery(r: RecoveryReport) -> str:
    f = r.fthsdp
    lines = [f"fthsdp recovery: {f.replicas} replicas (+{f.spares} spare) x {f.ranks_per_replica} ranks, "
             f"{f.model} model, "
             f"kill {f.kill}, restart {'from a warm standby' if f.warm_restarts else 'cold'} after "
             f"{f.restart_delay_s} s; final states equal: {f.final_equal}"
             + (f"; orphan slots carried{' with the exact sum' if f.deterministic else ''}" if f.carry_orphans else "")
             + (f" (1-minute load {f.loadavg_1min} before)" if f.loadavg_1min is not None else ""),
             f"  survivors' stall at the failure   {f.survivor_stall_s:>8} s",
             f"  kill -> restarted replica joined  {_cell(f.rejoin_s, ''):>8} s   (back to all replicas "
             f"contributing: {_cell(f.back_to_full_s, '')} s)",
             f"  step-time ratio during catch-up   {f.catchup_step_ratio:>8}   (target <= 1.1; "
             f"{f.catchup_steps_observed} survivor steps)",
             f"  survivors' step while down        {f.down_step_ratio:>8}   (over their step before the kill, "
             f"{f.before_step_s} s{'; carrying its slot' if f.carry_orphans else ''})",
             f"  joiner start -> active            {f.join_s:>8} s   (from its registration: "
             f"{f.join_from_registration_s} s)",
             f"  transfer / plain socket copy      {f.transfer_ratio:>8}   ({f.transfer_mbps} vs "
             f"{f.socket_copy_mbps} MB/s; target >= 0.5)",
             f"  effective training time           {f.effective_training_time:>8}   (on the common step: "
             f"{_cell(r.to_json()['ett_common_step'], '')}, plain FSDP2-HSDP's "
             f"{_cell(f.common_step_s or (r.vs or {}).get('plain', {}).get('step_s'), '')} s)"]
    if f.deterministic_step_ratio is not None:
        lines.append(f"  exact sum's step / default sum's  {f.deterministic_step_ratio:>8}   (steady steps before the "
                     "kill, the same job run twice)")
    if r.vs is not None and "table" in r.vs:
        lines += ["", format_vs_table(r.vs)]
    return "\n".join(lines)


def _cell(v: Any, spec: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "NO"
    return format(v, spec)


def format_vs_table(result: dict[str, Any]) -> str:
    """The side-by-side table of ``fthsdp.bench.vs.compare``'s document."""
    w = result.get("workload", {})
    lines = [f"{w.get('replicas', '?')} replicas x {w.get('ranks_per_replica', '?')} rank(s), {w.get('steps', '?')} "
             f"steps, SIGKILL {w.get('kill', '?')}, restart after {w.get('restart_delay_s', '?')} s",
             f"{'system':<30} {'step s':>8} {'vs plain':>8} {'stall s':>8} {'rejoin s':>9} {'ETT':>6} "
             f"{'ETT@plain':>9} {'equal':>6}"]
    for r in result["table"]:
        lines.append(f"{r['system']:<30} {_cell(r['step_s'], '.3f'):>8} {_cell(r['step_ratio'], '.2f'):>8} "
                     f"{_cell(r['stall_s'], '.2f'):>8} {_cell(r['rejoin_s'], '.2f'):>9} {_cell(r['ett'], '.3f'):>6} "
                     f"{_cell(r.get('ett_common_step'), '.3f'):>9} {_cell(r.get('final_equal'), ''):>6}")
    return "\n".join(lines)


# --- sim ------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModeEtt(_AsJson):
    """One mode's effective training time, simulated, beside its closed forms."""

    ett: float
    closed_form_fixed: float
    poisson_limit: float


@dataclass(frozen=True)
class SimResult(_AsJson):
    """``fthsdp sim`` (``fthsdp.bench.sim``'s module doc): whole-job restarts (``sync``) vs fthsdp."""

    config: dict[str, Any]
    """The ``SimConfig``'s fields."""
    replicas: int
    horizon_min: float
    failures: int
    sync: ModeEtt
    fthsdp: ModeEtt


def format_sim(r: SimResult) -> str:
    lines = [f"{r.replicas} replicas, {r.failures} failures over {r.horizon_min / 60:.0f} h "
             f"({r.config['arrivals']} arrivals)"]
    for mode, x in (("sync", r.sync), ("fthsdp", r.fthsdp)):
        lines.append(f"  {mode:<7} ETT {x.ett:.3f}  (closed form, fixed arrivals {x.closed_form_fixed:.3f}; "
                     f"Poisson limit {x.poisson_limit:.3f})")
    return "\n".join(lines)


# --- bench catchup --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CatchupResult(_AsJson):
    """``fthsdp bench catchup`` (``fthsdp.bench.catchup``'s module doc)."""

    mb: float
    bytes: int
    model: str
    repeats: int
    pinned: bool
    """The source's training thread had a core to itself (``fthsdp.bench.catchup``'s module doc)."""
    transfer_ratio: float
    """The best fetch's throughput over the best plain socket copy's (target >= 0.6)."""
    transfer_mbps: float
    socket_copy_mbps: float
    fetch_mbps_all: list[float]
    socket_copy_mbps_all: list[float]
    snapshot_wait_s: list[float]
    """Per fetch: its request to the manifest (the source's snapshot copy, and the step boundary it waits for)."""
    serve_step_ratio: float
    """The source's median step while serving over its median step with nothing moving (target <= 1.05)."""
    steady_step_s: float
    serving_step_s: float
    steady_steps: int
    serving_steps: int
    copying_step_s: float | None
    """The source's median step among those that overlap a fetch's wait for its manifest (the snapshot's copy)."""
    sending_step_s: float | None
    """... among those that overlap a fetch's transfer (manifest to last byte)."""
    loadavg_1min: float
    """The 1-minute load average before the run."""
    measured_at: str
    benchmark: str = "catchup"


def format_catchup(r: CatchupResult) -> str:
    return "\n".join([
        f"catch-up of {r.bytes / 1e6:.0f} MB from one source training the {r.model} model "
        f"({'its training thread on a core of its own' if r.pinned else 'unpinned'}; load before {r.loadavg_1min})",
        f"  transfer / plain socket copy   {r.transfer_ratio:>7}   ({r.transfer_mbps} vs {r.socket_copy_mbps} MB/s, "
        f"best of {r.repeats}; target >= 0.6)",
        f"  source's step while serving    {r.serve_step_ratio:>7}   ({r.serving_step_s} vs {r.steady_step_s} s, "
        f"{r.serving_steps} vs {r.steady_steps} steps; target <= 1.05)"])


# --- bench straggler ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StragglerResult(_AsJson):
    """``fthsdp bench straggler`` (``fthsdp.bench.straggler``'s module doc). Throughputs in samples per second."""

    replicas: int
    steps: int
    model: str
    slow_from: int
    factor: float
    detect_steps: int | None
    """Steps from the slowdown until the status named the straggler (None: never)."""
    false_flags: list[str]
    """What the healthy job named or ejected (must be empty)."""
    ejected_at_step: int | None
    """The eject job's first step with two contributors."""
    ejections: list[str]
    """The eject job's epochs that ejected someone (their reasons)."""
    throughput_healthy: float
    throughput_healthy_2: float
    throughput_do_nothing: float
    throughput_after_eject: float
    throughput_do_nothing_ratio: float
    """The straggler's job left alone, over the healthy three-replica job."""
    throughput_after_ratio: float
    """The eject job once the straggler is out (from ``settle_s`` after its next incarnation registered), over the
    healthy two-replica job."""
    throughput_after_incl_restart_ratio: float
    """The same from the third step without it: its restart on the same cores included."""
    settle_s: float
    benchmark: str = "straggler"


def format_straggler(r: StragglerResult) -> str:
    return "\n".join([
        f"{r.replicas} replicas x 1 rank, {r.model} model, replica 2 {r.factor}x slower from step {r.slow_from}",
        f"  named after {r.detect_steps} step(s); false flags on a healthy job: {r.false_flags or 'none'}",
        f"  doing nothing: {r.throughput_do_nothing} samples/s = {r.throughput_do_nothing_ratio} x healthy "
        f"({r.throughput_healthy})",
        f"  ejected at step {r.ejected_at_step}: {r.throughput_after_eject} samples/s = {r.throughput_after_ratio} x "
        f"a healthy 2-replica job ({r.throughput_healthy_2}); {r.throughput_after_incl_restart_ratio} x with its "
        "restart on the same cores"])
