"""The ``fthsdp`` command line: lighthouse, status, emulate, bench, demo, chaos."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import pathlib
import signal
import sys
from typing import Any, Callable

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def _setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=LOG_FORMAT, stream=sys.stderr)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)


def _run_until_signal(coro_factory: Callable[[asyncio.Event], Any]) -> None:
    """Run ``coro_factory(stop)`` until SIGTERM/SIGINT sets ``stop``."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await coro_factory(stop)

    asyncio.run(main())


# --- lighthouse ------------------------------------------------------------------------------------------------


def _add_client_security_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", default="", help="file holding the job token (default: $FTHSDP_TOKEN_FILE)")
    p.add_argument("--tls-ca", default="", help="CA certificate of the lighthouse: use TLS (default: $FTHSDP_TLS_CA)")
    p.add_argument("--tls-cert", default="", help="client certificate for mTLS (default: $FTHSDP_TLS_CERT)")
    p.add_argument("--tls-key", default="", help="client key for mTLS (default: $FTHSDP_TLS_KEY)")


def _client_security(a: argparse.Namespace) -> Any:
    """The client's TLS and token options: each flag, else its FTHSDP_* environment variable."""
    import os

    from lighthouse import security as sec

    def pick(flag: str, var: str) -> str | None:
        return flag or os.environ.get(var) or None

    try:
        return sec.ClientSecurity.from_files(pick(a.tls_ca, sec.ENV_TLS_CA), pick(a.tls_cert, sec.ENV_TLS_CERT),
                                             pick(a.tls_key, sec.ENV_TLS_KEY),
                                             pick(a.token_file, sec.ENV_TOKEN_FILE))
    except sec.SecurityConfigError as e:
        sys.exit(f"fthsdp {a.command}: {e}")


def cmd_lighthouse(a: argparse.Namespace) -> None:
    from fthsdp.testing.procutil import write_atomic
    from lighthouse.membership import Policy
    from lighthouse.security import SecurityConfigError, ServerSecurity
    from lighthouse.server import LighthouseConfig, serve
    from lighthouse.store import open_store

    interval = a.heartbeat_interval if a.heartbeat_interval else min(0.5, a.heartbeat_timeout / 4)
    policy = Policy(min_replicas=a.min_replicas, heartbeat_interval_s=interval,
                    heartbeat_timeout_s=a.heartbeat_timeout,
                    confirm_age_s=a.confirm_age if a.confirm_age else min(a.heartbeat_timeout, 2 * interval),
                    join_window_s=a.join_window, expected_replicas=a.expected_replicas,
                    max_reforms=a.max_reforms)
    try:
        security = ServerSecurity.from_files(a.tls_cert, a.tls_key, a.tls_client_ca, a.token_file)
        security.ssl_context()  # fail now, with a clear message, on unreadable TLS files
        store = open_store(a.store)
    except (SecurityConfigError, ValueError) as e:
        sys.exit(f"fthsdp lighthouse: {e}")
    config = LighthouseConfig(bind=a.bind, http=a.http or None, jobs=tuple(a.job), policy=policy,
                              rendezvous=not a.no_rendezvous, security=security, advertise=a.advertise,
                              election_ttl_s=a.election_ttl)

    def ready(lh: Any) -> None:
        if a.port_file:
            write_atomic(pathlib.Path(a.port_file),
                         f"grpc={lh.port} http={lh.http_port} rendezvous={lh.rendezvous_addr}")

    _run_until_signal(lambda stop: serve(config, store, stop=stop, ready=ready))
    logging.getLogger("fthsdp.lighthouse").info("lighthouse stopped")


def cmd_status(a: argparse.Namespace) -> None:
    import urllib.error
    import urllib.request

    sec = _client_security(a)
    ctx = sec.ssl_context()
    status: dict[str, Any] | None = None
    errors: list[str] = []
    for addr in [x.strip() for x in a.http.split(",") if x.strip()]:  # the leader's answer wins
        url = f"{'https' if ctx else 'http'}://{addr}/status"
        try:
            req = urllib.request.Request(url, headers=sec.http_headers())
            with urllib.request.urlopen(req, timeout=a.timeout, context=ctx) as r:
                got = json.load(r)
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:200]
            errors.append(f"{url}: HTTP {e.code} {detail}")
            continue
        except (urllib.error.URLError, OSError, ValueError) as e:
            errors.append(f"{url}: {e}")
            continue
        if status is None or (got.get("leader") and not status.get("leader")):
            status = got
        if got.get("leader"):
            break
    if status is None:
        sys.exit("fthsdp status: cannot reach any lighthouse: " + "; ".join(errors))
    if a.json:
        print(json.dumps(status, indent=2))
        return
    print(f"job {status['job']}  epoch {status['epoch']}  leader {'yes' if status['leader'] else 'no'}  "
          f"members {len(status['members'])}  min_replicas {status['min_replicas']}"
          + (f"  (leader at {status['leader_address'] or 'unknown'})" if not status["leader"] else ""))
    print(f"{'REPLICA':<24} {'ROLE':<8} {'IN EPOCH':<8} {'STEP':>8} {'HB AGE (s)':>10}")
    for x in status["members"]:
        print(f"{x['replica_id']:<24} {x['role']:<8} {'yes' if x['in_epoch'] else 'no':<8} {x['step']:>8} "
              f"{x['last_heartbeat_age_s']:>10.2f}")
    if status["history"]:
        print("\nrecent epochs:")
        for e in status["history"][-a.history:]:
            print(f"  {e['epoch']:>5}  {len(e['members'])} members  {e['reason'][:100]}")


def cmd_emulate(a: argparse.Namespace) -> None:
    from fthsdp.bench.emulate import run_emulate

    security = _client_security(a)
    _run_until_signal(lambda stop: run_emulate(a.lighthouse, a.replicas, a.job, a.prefix, stop, security=security))


# --- bench -----------------------------------------------------------------------------------------------------


def _emit(result: dict[str, Any], as_json: bool, table: Callable[[dict[str, Any]], None]) -> None:
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        table(result)


def cmd_bench_lighthouse(a: argparse.Namespace) -> None:
    from fthsdp.bench.lighthouse import bench_lighthouse

    result = bench_lighthouse(a.replicas, deaths=a.deaths, window_s=a.window, interval=a.heartbeat_interval,
                              rejoins=not a.no_rejoins)

    def table(r: dict[str, Any]) -> None:
        print(f"{'replicas':>8} {'hb int':>6} {'hb/s':>9} {'hb ratio':>8} {'lh cpu%':>7} {'detect p50':>10} "
              f"{'push p50':>9} {'push p99':>9} {'death->all p50/p99':>19} {'rejoin->all p50/p99':>20} "
              f"{'churn lh cpu%':>13}")
        for x in r["results"]:
            print(f"{x['replicas']:>8} {x['heartbeat_interval_s']:>6} {x['heartbeats_per_s']:>9} "
                  f"{x['heartbeat_ratio']:>8} {x['lighthouse_cpu_pct']:>7} {x['detect_p50_s']:>10} "
                  f"{x['push_p50_s']:>9} {x['push_p99_s']:>9} "
                  f"{x['death_to_all_p50_s']:>9}/{x['death_to_all_p99_s']:<9} "
                  f"{x['rejoin_to_all_p50_s']!s:>9}/{x['rejoin_to_all_p99_s']!s:<10} "
                  f"{x['lighthouse_cpu_pct_churn']:>13}")

    _emit(result, a.json, table)


def cmd_bench_ftar(a: argparse.Namespace) -> None:
    from fthsdp.bench.ftar import bench_ftar

    result = bench_ftar(members=a.members, mb=a.mb, iters=a.iters, timeout_s=a.timeout)

    def table(r: dict[str, Any]) -> None:
        print(f"FTAR vs torch.distributed.all_reduce, {r['members']} members, {r['mb']} MB, {r['backend']}")
        print(f"  all_reduce {r['baseline_allreduce_s']}s  FTAR {r['ftar_allreduce_s']}s  "
              f"throughput ratio {r['throughput_ratio']}")
        print(f"  rebuild for a new epoch {r['rebuild_s']}s  stall on SIGKILL mid-exchange {r['kill_stall_s']}s")

    _emit(result, a.json, table)


def cmd_demo(a: argparse.Namespace) -> None:
    from fthsdp.cli.demo import run_demo
    from fthsdp.testing.launcher import ClusterConfig, Kill, ReplicaFailed

    try:
        kills = tuple(Kill.parse(k) for k in a.kill)
        delay = a.restart_delay
        if a.kill_all is not None:
            kills += tuple(Kill(r, a.kill_all) for r in range(a.replicas))
            # Come back once the lighthouse has declared the dead incarnations dead: the first replica back then
            # resumes from the newest checkpoint and the others catch up from it.
            delay = max(delay, ClusterConfig.heartbeat_timeout_s + 1.0)
        config = ClusterConfig(replicas=a.replicas, ranks=a.ranks, steps=a.steps, model=a.model,
                               kills=kills, restart_delay_s=delay, timeout_s=a.timeout,
                               checkpoint_every=a.checkpoint_every)
        run_demo(config, pathlib.Path(a.report) if a.report else None, pathlib.Path(a.plot) if a.plot else None,
                 pathlib.Path(a.keep_logs) if a.keep_logs else None)
    except (ValueError, ReplicaFailed, TimeoutError) as e:
        sys.exit(f"fthsdp demo: {e}")


def cmd_bench_overhead(a: argparse.Namespace) -> None:
    from fthsdp.bench.overhead import bench_overhead

    result = bench_overhead(replicas=a.replicas, ranks=a.ranks, steps=a.steps, model=a.model, rounds=a.rounds)

    def table(r: dict[str, Any]) -> None:
        print(f"{r['replicas']} replicas x {r['ranks_per_replica']} ranks, {r['model']} model, median of steps "
              f">= {r['warmup_steps']}")
        print(f"  plain FSDP2-HSDP {r['baseline_step_s']}s/step  fthsdp {r['fthsdp_step_s']}s/step  "
              f"ratio {r['step_time_ratio']}")

    _emit(result, a.json, table)


def cmd_bench_recovery(a: argparse.Namespace) -> None:
    from fthsdp.bench.recovery import bench_recovery

    # Side by side with torchft: its workload (WORKLOAD.md) is 1 rank per replica group, so ours is too.
    ranks = a.ranks if a.ranks is not None else (1 if a.vs else 2)
    result: dict[str, Any] = {"fthsdp": bench_recovery(replicas=a.replicas, ranks=ranks, steps=a.steps,
                                                       kill_step=a.kill_step, model=a.model,
                                                       restart_delay_s=a.restart_delay)}
    if a.vs:
        import tempfile

        from fthsdp.bench.vs import compare

        with tempfile.TemporaryDirectory(prefix="fthsdp-bench-vs-") as tmp:
            result = {**result, **compare(result["fthsdp"], tmp, steps=a.steps, kill_step=a.kill_step,
                                          replicas=a.replicas)}

    def table(r: dict[str, Any]) -> None:
        f = r["fthsdp"]
        print(f"fthsdp recovery: {f['replicas']} replicas x {f['ranks_per_replica']} ranks, {f['model']} model, "
              f"kill {f['kill']}; final states equal: {f['final_equal']}")
        print(f"  survivors' stall at the failure   {f['survivor_stall_s']:>8} s")
        print(f"  step-time ratio during catch-up   {f['catchup_step_ratio']:>8}   (target <= 1.1; "
              f"{f['catchup_steps_observed']} survivor steps)")
        print(f"  joiner start -> active            {f['join_s']:>8} s   (from its registration: "
              f"{f['join_from_registration_s']} s)")
        print(f"  transfer / plain socket copy      {f['transfer_ratio']:>8}   ({f['transfer_mbps']} vs "
              f"{f['socket_copy_mbps']} MB/s; target >= 0.5)")
        if "table" in r:
            from fthsdp.bench.vs import format_table

            print()
            print(format_table(r))

    _emit(result, a.json, table)


def cmd_chaos(a: argparse.Namespace) -> None:
    import tempfile

    from fthsdp.chaos.runner import KINDS, REPLICA_KINDS, ChaosConfig, result_text, soak, summary_text

    kinds = tuple(a.kinds.split(",")) if a.kinds else (KINDS if a.ha else REPLICA_KINDS)
    bad = [k for k in kinds if k not in KINDS]
    if bad or (not a.ha and not set(kinds) & set(REPLICA_KINDS)):
        sys.exit(f"fthsdp chaos: --kinds must be among {','.join(KINDS)} (lighthouse and etcd need --ha)")
    cfg = ChaosConfig(seed=a.seed, replicas=a.replicas, ranks=a.ranks, steps=a.steps, kinds=kinds, faults=a.faults,
                      ha=a.ha, min_step_s=a.min_step_s, model=a.model, timeout_s=a.timeout)
    workdir = pathlib.Path(a.workdir) if a.workdir else pathlib.Path(tempfile.mkdtemp(prefix="fthsdp-chaos-"))
    out = soak(cfg, workdir, runs=a.runs, duration_s=a.duration, keep=a.keep,
               on_result=None if a.json else lambda r: print(result_text(r), flush=True))
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        print(summary_text(out))
        if out["violations"]:
            print(f"runs with violations kept under {workdir}")
    if out["violations"]:
        sys.exit(1)


def cmd_sim(a: argparse.Namespace) -> None:
    from fthsdp.bench.sim import SimConfig, simulate

    try:
        config = SimConfig(gpus=a.gpus, replica_gpus=a.replica_gpus, mtbf_min=a.mtbf_min,
                           sync_recovery_min=a.sync_recovery_min, stall_min=a.stall_min, rejoin_min=a.rejoin_min,
                           arrivals=a.arrivals, seed=a.seed, hours=a.hours)
    except ValueError as e:
        sys.exit(f"fthsdp sim: {e}")
    result = simulate(config)

    def table(r: dict[str, Any]) -> None:
        print(f"{r['replicas']} replicas, {r['failures']} failures over {r['horizon_min'] / 60:.0f} h "
              f"({a.arrivals} arrivals)")
        for mode in ("sync", "fthsdp"):
            x = r[mode]
            print(f"  {mode:<7} ETT {x['ett']:.3f}  (closed form, fixed arrivals {x['closed_form_fixed']:.3f}; "
                  f"Poisson limit {x['poisson_limit']:.3f})")

    _emit(result, a.json, table)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fthsdp", description="Fault-tolerant HSDP training runtime.")
    p.add_argument("--log-level", default="INFO")
    sub = p.add_subparsers(dest="command", required=True)

    lh = sub.add_parser("lighthouse", help="run the membership coordinator")
    lh.add_argument("--bind", default="127.0.0.1:29510", help="gRPC HOST:PORT (port 0: any free port)")
    lh.add_argument("--http", default="127.0.0.1:29511", help="HTTP HOST:PORT for /status, /metrics, / ('' = off)")
    lh.add_argument("--job", action="append", default=None, help="job id served (repeatable; default 'default')")
    lh.add_argument("--min-replicas", type=int, default=1, help="no epoch with fewer live replicas")
    lh.add_argument("--heartbeat-timeout", type=float, default=3.0, help="seconds without heartbeat = dead")
    lh.add_argument("--heartbeat-interval", type=float, default=0.0,
                    help="interval advertised to clients (default: min(0.5, timeout/4))")
    lh.add_argument("--confirm-age", type=float, default=0.0,
                    help="a reported peer with no heartbeat for this long is confirmed dead (default 2 intervals)")
    lh.add_argument("--join-window", type=float, default=0.0,
                    help="bootstrap: after min-replicas registered, wait this long for more")
    lh.add_argument("--expected-replicas", type=int, default=0,
                    help="bootstrap: form the first epoch as soon as this many registered")
    lh.add_argument("--max-reforms", type=int, default=2,
                    help="a peer still heartbeating but reported after this many consecutive re-formed epochs is "
                         "declared hung (dead); 0: never")
    lh.add_argument("--store", default="memory://", help="durable store URL (memory:// is the default)")
    lh.add_argument("--no-rendezvous", action="store_true", help="do not host the data-plane TCPStore")
    lh.add_argument("--port-file", default="", help="write 'grpc=P http=P rendezvous=H:P' here once serving")
    lh.add_argument("--advertise", default="", help="gRPC HOST:PORT other lighthouses name as the leader's "
                    "(HA on etcd; default: the bound address)")
    lh.add_argument("--election-ttl", type=int, default=5,
                    help="HA on etcd: seconds of the leader's lease; a dead leader is replaced within about this")
    lh.add_argument("--tls-cert", default="", help="TLS certificate (PEM) for the gRPC and HTTP ports")
    lh.add_argument("--tls-key", default="", help="TLS private key (PEM)")
    lh.add_argument("--tls-client-ca", default="", help="require client certificates signed by this CA (mTLS)")
    lh.add_argument("--token-file", default="", help="file holding the job token every call must present")
    lh.set_defaults(fn=cmd_lighthouse)

    st = sub.add_parser("status", help="print a lighthouse's members and epochs")
    st.add_argument("--http", default="127.0.0.1:29511",
                    help="the lighthouse's HTTP HOST:PORT[,HOST:PORT...] (the leader's answer is shown)")
    st.add_argument("--json", action="store_true")
    st.add_argument("--history", type=int, default=10, help="how many recent epochs to show")
    st.add_argument("--timeout", type=float, default=5.0)
    _add_client_security_args(st)
    st.set_defaults(fn=cmd_status)

    em = sub.add_parser("emulate", help="run N emulated replicas (control plane only) until interrupted")
    em.add_argument("--lighthouse", default="127.0.0.1:29510", help="HOST:PORT[,HOST:PORT...]")
    em.add_argument("--replicas", type=int, required=True)
    em.add_argument("--prefix", default="emu", help="replica ids are PREFIX-00000, ...")
    em.add_argument("--job", default="default")
    _add_client_security_args(em)
    em.set_defaults(fn=cmd_emulate)

    dm = sub.add_parser("demo", help="train the example model on R replica groups with failures injected")
    dm.add_argument("--replicas", type=int, default=3)
    dm.add_argument("--ranks", type=int, default=2, help="ranks per replica group (FSDP2 shards)")
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
    dm.add_argument("--report", default="", help="write the JSON report here")
    dm.add_argument("--plot", default="", help="write the PNG timeline here")
    dm.add_argument("--keep-logs", default="", help="copy the replicas' logs and progress files here")
    dm.add_argument("--timeout", type=float, default=1800.0, help="give up after this many seconds")
    dm.set_defaults(fn=cmd_demo)

    ch = sub.add_parser("chaos", help="local clusters under a seeded schedule of failures, invariants checked")
    ch.add_argument("--seed", type=int, default=0, help="first run's seed (run i uses seed + i)")
    ch.add_argument("--runs", type=int, default=1)
    ch.add_argument("--duration", type=float, default=0.0,
                    help="soak: start runs until this many seconds have passed (overrides --runs)")
    ch.add_argument("--ha", action="store_true",
                    help="3-member etcd on loopback and 3 lighthouses on it; also kill the leader and etcd members")
    ch.add_argument("--replicas", type=int, default=3)
    ch.add_argument("--ranks", type=int, default=2, help="ranks per replica group")
    ch.add_argument("--steps", type=int, default=800,
                    help="steps per run: enough for the last fault's replica to be back before the others finish")
    ch.add_argument("--faults", type=int, default=0, help="faults per run (default: one per kind)")
    ch.add_argument("--kinds", default="", help="comma-separated among kill,hang,double,lighthouse,etcd "
                                                "(default: all that apply)")
    ch.add_argument("--model", default="tiny")
    ch.add_argument("--min-step-s", type=float, default=0.15, help="pace the trainer's steps")
    ch.add_argument("--timeout", type=float, default=900.0, help="give one run up after this many seconds")
    ch.add_argument("--workdir", default="", help="runs go here (default: a new temporary directory)")
    ch.add_argument("--keep", action="store_true", help="keep the logs of runs without violations too")
    ch.add_argument("--json", action="store_true")
    ch.set_defaults(fn=cmd_chaos)

    sm = sub.add_parser("sim", help="effective training time of a large job: whole-job restarts vs fthsdp")
    sm.add_argument("--gpus", type=int, required=True)
    sm.add_argument("--replica-gpus", type=int, required=True)
    sm.add_argument("--mtbf-min", type=float, required=True, help="the job's mean time between failures")
    sm.add_argument("--sync-recovery-min", type=float, required=True, help="whole-job restart time per failure")
    sm.add_argument("--stall-min", type=float, required=True, help="fthsdp: whole-job stall per failure")
    sm.add_argument("--rejoin-min", type=float, required=True, help="fthsdp: failure until its replica trains again")
    sm.add_argument("--arrivals", choices=("fixed", "poisson"), default="fixed")
    sm.add_argument("--seed", type=int, default=0)
    sm.add_argument("--hours", type=float, default=1000.0)
    sm.add_argument("--json", action="store_true")
    sm.set_defaults(fn=cmd_sim)

    bench = sub.add_parser("bench", help="benchmarks, each against a baseline measured in the same run")
    bsub = bench.add_subparsers(dest="bench", required=True)
    bl = bsub.add_parser("lighthouse", help="heartbeat throughput and epoch push latency with N emulated replicas")
    bl.add_argument("--replicas", type=int, nargs="+", default=[100, 1000])
    bl.add_argument("--deaths", type=int, default=5)
    bl.add_argument("--window", type=float, default=5.0, help="seconds of heartbeat measurement")
    bl.add_argument("--heartbeat-interval", type=float, default=0.0,
                    help="seconds; 0 (default): max(1, replicas/1000), about what one lighthouse keeps up with here")
    bl.add_argument("--no-rejoins", action="store_true", help="skip bringing the dead replicas back")
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
    bo.add_argument("--rounds", type=int, default=1, help="baseline/fthsdp alternations")
    bo.add_argument("--json", action="store_true")
    bo.set_defaults(fn=cmd_bench_overhead)
    br = bsub.add_parser("recovery", help="a SIGKILL and rejoin: survivors' stall, catch-up cost, join time, "
                                          "transfer throughput (--vs torchft: side by side with torchft and a "
                                          "whole-job restart)")
    br.add_argument("--replicas", type=int, default=3)
    br.add_argument("--ranks", type=int, default=None, help="ranks per replica group (default 2; 1 with --vs)")
    br.add_argument("--steps", type=int, default=60)
    br.add_argument("--kill-step", type=int, default=20)
    br.add_argument("--restart-delay", type=float, default=2.0)
    br.add_argument("--model", default="reference")
    br.add_argument("--vs", choices=["torchft"], default=None,
                    help="also run torchft and a whole-job restart on the same workload")
    br.add_argument("--json", action="store_true")
    br.set_defaults(fn=cmd_bench_recovery)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "lighthouse" and not args.job:
        args.job = ["default"]
    if args.command == "demo":
        args.kill = [] if args.no_kill else (args.kill or ["1@20"])
    _setup_logging(args.log_level)
    args.fn(args)


if __name__ == "__main__":
    main()
