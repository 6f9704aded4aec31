"""``fthsdp bench lighthouse|ftar|overhead|recovery|catchup|straggler|failover|...``: the benchmarks
(``fthsdp.bench``), each against a baseline measured in the same run; ``--json`` prints the result's document,
otherwise its table (``fthsdp.bench.results``, or the benchmark's own ``format_*``)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from typing import TYPE_CHECKING

from fthsdp.cli.common import add_carrying_args, emit

if TYPE_CHECKING:
    from fthsdp.cli.common import Subparsers


def cmd_bench_lighthouse(a: argparse.Namespace) -> None:
    from fthsdp.bench.lighthouse import bench_lighthouse
    from fthsdp.bench.results import format_lighthouse

    result = bench_lighthouse(a.replicas, deaths=a.deaths, window_s=a.window, interval=a.heartbeat_interval,
                              rejoins=not a.no_rejoins, ranks=a.ranks, vs_torchft=a.vs == "torchft",
                              lanes=None if a.no_lanes else a.lanes, lane_backend=a.lane_backend,
                              lane_deaths=a.lane_deaths)
    emit(result, a.json, format_lighthouse)


def cmd_bench_ftar(a: argparse.Namespace) -> None:
    from fthsdp.bench.ftar import bench_ftar
    from fthsdp.bench.results import format_ftar

    emit(bench_ftar(members=a.members, mb=a.mb, iters=a.iters, timeout_s=a.timeout), a.json, format_ftar)


def cmd_bench_checkpoint(a: argparse.Namespace) -> None:
    from fthsdp.bench.checkpoint import bench_checkpoint, format_checkpoint

    try:
        result = bench_checkpoint(replicas=a.replicas, ranks=a.ranks, steps=a.steps, model=a.model, every=a.every,
                                  window=a.window, rounds=a.rounds, workdir=a.workdir)
    except ValueError as e:
        sys.exit(f"fthsdp bench checkpoint: {e}")
    emit(result, a.json, format_checkpoint)


def cmd_bench_overhead(a: argparse.Namespace) -> None:
    from fthsdp.bench.overhead import bench_overhead
    from fthsdp.bench.results import format_overhead

    try:
        result = bench_overhead(replicas=a.replicas, ranks=a.ranks, steps=a.steps, model=a.model, rounds=a.rounds,
                                against=a.against, layout=a.layout)
    except ValueError as e:
        sys.exit(f"fthsdp bench overhead: {e}")
    emit(result, a.json, format_overhead)


def cmd_bench_recovery(a: argparse.Namespace) -> None:
    from fthsdp.bench.recovery import bench_recovery
    from fthsdp.bench.results import RecoveryReport, format_recovery

    # Side by side with torchft: its reference workload (docs/design.md §12) is 1 rank per replica group, so ours is
    # too; --ranks 2 runs every system on the HSDP shape (torchft with FSDP2 inside each group).
    ranks = a.ranks if a.ranks is not None else (1 if a.vs else 2)
    from fthsdp.launch.config import Kill

    kills = tuple(Kill.parse(k) for k in a.kill or ())
    if a.vs and kills:
        raise SystemExit("--kill is not supported with --vs (the baselines kill group 1 at --kill-step)")
    ours = bench_recovery(replicas=a.replicas, ranks=ranks, steps=a.steps, kill_step=a.kill_step, model=a.model,
                          restart_delay_s=a.restart_delay, kills=kills, workdir=a.workdir,
                          warm_restarts=a.warm_restarts, common_step=not a.vs, spares=a.spares,
                          carry_orphans=a.carry_orphans, deterministic=a.deterministic)
    report = RecoveryReport(ours)
    if a.vs:
        from fthsdp.bench.vs import compare

        with tempfile.TemporaryDirectory(prefix="fthsdp-bench-vs-") as tmp:
            report = RecoveryReport(ours, compare(ours.to_json(), tmp, steps=a.steps, kill_step=a.kill_step,
                                                  replicas=a.replicas, ranks=ranks))
    emit(report, a.json, format_recovery)


def cmd_bench_catchup(a: argparse.Namespace) -> None:
    from fthsdp.bench.catchup import bench_catchup
    from fthsdp.bench.results import format_catchup

    try:
        result = bench_catchup(mb=a.mb, model=a.model, repeats=a.repeats, pin=not a.no_pin)
    except ValueError as e:
        raise SystemExit(f"fthsdp bench catchup: {e}") from None
    emit(result, a.json, format_catchup)


def cmd_bench_failover(a: argparse.Namespace) -> None:
    from fthsdp.bench.failover import bench_failover, format_failover

    try:
        result = bench_failover(members=a.members, rounds=a.rounds, election_ttl_s=a.election_ttl,
                                election_probe_s=a.election_probe)
    except (ValueError, TimeoutError) as e:
        sys.exit(f"fthsdp bench failover: {e}")
    emit(result, a.json, format_failover)


def cmd_bench_straggler(a: argparse.Namespace) -> None:
    from fthsdp.bench.results import format_straggler
    from fthsdp.bench.straggler import bench_straggler

    try:
        result = bench_straggler(steps=a.steps, slow_from=a.slow_from, factor=a.factor, model=a.model,
                                 workdir=a.workdir)
    except ValueError as e:
        raise SystemExit(f"fthsdp bench straggler: {e}") from None
    emit(result, a.json, format_straggler)


def register(sub: Subparsers) -> None:
    bench = sub.add_parser("bench", help="benchmarks, each against a baseline measured in the same run")
    bsub = bench.add_subparsers(dest="bench", required=True)
    bl = bsub.add_parser("lighthouse", help="heartbeat throughput and epoch push latency with N emulated replicas")
    bl.add_argument("--replicas", type=int, nargs="+", default=[100, 1000])
    bl.add_argument("--deaths", type=int, default=5)
    bl.add_argument("--window", type=float, default=5.0, help="seconds of heartbeat measurement")
    bl.add_argument("--heartbeat-interval", type=float, default=0.0,
                    help="seconds; 0 (default): max(1, replicas/1000), about what one lighthouse keeps up with here")
    bl.add_argument("--no-rejoins", action="store_true", help="skip bringing the dead replicas back")
    bl.add_argument("--ranks", "--ranks-per-group", dest="ranks", type=int, default=8,
                    help="ranks per emulated replica group (its session's holder hands epochs to the others), so "
                         "lanes per job")
    bl.add_argument("--lanes", type=int, default=0,
                    help="lanes emulated whole (every member of each: the real rendezvous, stores and "
                         "authentication, no tensors) for the rebuild after a death, on the members' stores and, as "
                         "the baseline, on the lighthouse; 0 (default): about 240 emulated ranks' worth")
    bl.add_argument("--lane-backend", choices=["mesh", "nccl", "lazy"], default="mesh",
                    help="the backend's own connect the emulated lanes make: Gloo's full mesh (a Gloo lane's), "
                         "NCCL's unique id, or Gloo's lazy pairs (not what a lane does: docs/design.md §5)")
    bl.add_argument("--lane-deaths", type=int, default=3, help="deaths measured for the lanes")
    bl.add_argument("--no-lanes", action="store_true", help="skip the lanes' rebuild")
    bl.add_argument("--vs", choices=["torchft"], default=None,
                    help="also run torchft's lighthouse at each size (one death each, heartbeats at the same budget)")
    bl.add_argument("--json", action="store_true")
    bl.set_defaults(fn=cmd_bench_lighthouse)
    bf = bsub.add_parser("ftar", help="FTAR vs plain all_reduce; rebuild time; stall on a SIGKILL mid-exchange")
    bf.add_argument("--members", type=int, default=4)
    bf.add_argument("--mb", type=float, default=64.0, help="tensor size in MiB (float32)")
    bf.add_argument("--iters", type=int, default=3, help="timed exchanges per round (3 rounds)")
    bf.add_argument("--timeout", type=float, default=5.0, help="collective deadline (s)")
    bf.add_argument("--json", action="store_true")
    bf.set_defaults(fn=cmd_bench_ftar)
    bo = bsub.add_parser("overhead", help="steady-state step time: fthsdp vs plain FSDP2-HSDP")
    bo.add_argument("--replicas", type=int, default=3)
    bo.add_argument("--ranks", type=int, default=2)
    bo.add_argument("--steps", type=int, default=60)
    bo.add_argument("--model", default="reference")
    bo.add_argument("--rounds", type=int, default=3,
                    help="baseline/fthsdp alternations (the ratio is the median of the rounds' ratios)")
    bo.add_argument("--against", default="plain", choices=["plain", "timeline-off"],
                    help="the baseline: plain FSDP2-HSDP, or fthsdp with its step timeline off (FTHSDP_TIMELINE=0)")
    bo.add_argument("--layout", default="fsdp",
                    help="each replica's layout, the baseline's too: fsdp (FSDP2 over its ranks), tp2 (tensor parallel "
                    "2 x FSDP2), pp2 (2 pipeline stages, 1F1B, FSDP2 inside each)")
    bo.add_argument("--json", action="store_true")
    bo.set_defaults(fn=cmd_bench_overhead)
    bk = bsub.add_parser("checkpoint", help="the step while a periodic checkpoint is written, on the training "
                                            "thread and behind the steps, against the same run's other steps")
    bk.add_argument("--replicas", type=int, default=3)
    bk.add_argument("--ranks", type=int, default=2)
    bk.add_argument("--steps", type=int, default=60)
    bk.add_argument("--every", type=int, default=10, help="a checkpoint every this many steps")
    bk.add_argument("--window", type=int, default=2, help="steps after a checkpoint's that count as during it")
    bk.add_argument("--model", default="reference")
    bk.add_argument("--rounds", type=int, default=1, help="sync/async alternations")
    bk.add_argument("--workdir", default=None,
                    help="keep the runs' logs, progress files and checkpoints here (default: a temporary folder)")
    bk.add_argument("--json", action="store_true")
    bk.set_defaults(fn=cmd_bench_checkpoint)
    br = bsub.add_parser("recovery", help="a SIGKILL and rejoin: survivors' stall, catch-up cost, join time, "
                                          "transfer throughput (--vs torchft: side by side with torchft and a "
                                          "whole-job restart)")
    br.add_argument("--replicas", type=int, default=3)
    br.add_argument("--ranks", type=int, default=None, help="ranks per replica group (default 2; 1 with --vs)")
    br.add_argument("--steps", type=int, default=60)
    br.add_argument("--kill-step", type=int, default=20, help="SIGKILL group 1 at this step (without --kill)")
    br.add_argument("--kill", action="append", metavar="REPLICA@STEP[:PHASE]",
                    help="repeatable, instead of --kill-step: e.g. --kill 1@20 --kill 2@20 (two groups at once: "
                         "what a double failure costs the last survivor)")
    br.add_argument("--restart-delay", type=float, default=2.0)
    br.add_argument("--warm-restarts", action="store_true",
                    help="keep a warm standby of each group (started ahead, held before registering): a "
                    "restart releases it instead of starting cold")
    br.add_argument("--spares", type=int, default=0,
                    help="spare replica groups besides --replicas: a spare shadows training without a data slot "
                    "and takes over the killed group's slot (back_to_full_s)")
    add_carrying_args(br, ": reports their step while carrying over their step before",
                      ", and the same job again with the default sum: reports the exact sum's step over the default's")
    br.add_argument("--workdir", default=None,
                    help="keep the run's logs and progress files here (default: a temporary folder, removed)")
    br.add_argument("--model", default="reference")
    br.add_argument("--vs", choices=["torchft"], default=None,
                    help="also run torchft and a whole-job restart on the same workload")
    br.add_argument("--json", action="store_true")
    br.set_defaults(fn=cmd_bench_recovery)
    bc = bsub.add_parser("catchup", help="the catch-up transfer of a large state against a plain socket copy, and "
                                         "the serving source's step against its steady step")
    bc.add_argument("--mb", type=float, default=512.0, help="the state's size in MB (float32 tensors)")
    bc.add_argument("--model", default="reference", help="the model the source trains meanwhile")
    bc.add_argument("--repeats", type=int, default=3, help="fetches and socket copies (the best of each counts)")
    bc.add_argument("--no-pin", action="store_true",
                    help="leave the source's training thread unpinned (pinned, it has a core to itself)")
    bc.add_argument("--json", action="store_true")
    bc.set_defaults(fn=cmd_bench_catchup)
    bs = bsub.add_parser("straggler", help="one replica made slow: steps to detection, throughput doing nothing and "
                                           "after ejecting it, against the same job with no straggler")
    bs.add_argument("--steps", type=int, default=100)
    bs.add_argument("--slow-from", type=int, default=20, help="replica 2 is slow from this step")
    bs.add_argument("--factor", type=float, default=2.0, help="how many times as long replica 2 computes")
    bs.add_argument("--model", default="reference")
    bs.add_argument("--workdir", default=None, help="keep the jobs' logs and progress files here")
    bs.add_argument("--json", action="store_true")
    bs.set_defaults(fn=cmd_bench_straggler)
    bv = bsub.add_parser("failover", help="the leader lighthouse SIGKILLed: a follower serving the next epoch to "
                                          "every member, taking over on evidence (its knock) against the lease")
    bv.add_argument("--members", type=int, default=8, help="replica clients active in the job")
    bv.add_argument("--rounds", type=int, default=5, help="failovers of each arm (the median of each is reported)")
    bv.add_argument("--election-ttl", type=int, default=5, help="the leader's lease (the lighthouse's default)")
    bv.add_argument("--election-probe", type=float, default=0.25, help="the knock period of the 'knock' arm")
    bv.add_argument("--json", action="store_true")
    bv.set_defaults(fn=cmd_bench_failover)
