"""``fthsdp chaos``: local clusters under a seeded schedule of failures, invariants checked
(``fthsdp.chaos``)."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fthsdp.cli.common import Subparsers


def cmd_sim(a: argparse.Namespace) -> None:
    """``--sim``: the control plane in a deterministic simulation (``fthsdp.chaos.sim``)."""
    from fthsdp.chaos.sim.run import PLANES, VARIANTS, run_one, simulate

    if a.sim_variant not in VARIANTS:
        sys.exit(f"fthsdp chaos: --sim-variant must be one of {', '.join(v for v in VARIANTS if v)}")
    if a.sim_plane not in PLANES:
        sys.exit(f"fthsdp chaos: --sim-plane must be one of {', '.join(PLANES)}")
    if a.sim_variant in ("local-vote", "unpinned-orphans") and a.sim_plane != "lanes":
        sys.exit(f"fthsdp chaos: --sim-variant {a.sim_variant} needs --sim-plane lanes (the vote and the data are "
                 "the lanes')")
    if a.runs < 1:
        sys.exit("fthsdp chaos: --runs must be at least 1 (no run, nothing checked)")
    if a.jobs < 0:
        sys.exit("fthsdp chaos: --jobs must be at least 1 (0: one per CPU)")
    if a.trace:
        r = run_one(a.seed, a.sim_variant, trace=True, plane=a.sim_plane, spares=a.sim_spares,
                    blame_all=a.sim_blame_all, orphans=a.sim_orphans)
        if a.json:
            print(json.dumps(r, indent=1))
        else:
            print("\n".join(r["trace"]))
            print("\n".join(f"VIOLATION {v}" for v in r["violations"]) or "no violation")
        if r["violations"]:
            sys.exit(1)
        return
    if a.sim_spares < 0 or (a.sim_spares and a.sim_plane != "lanes"):
        sys.exit("fthsdp chaos: --sim-spares must be >= 0, and needs --sim-plane lanes")
    if a.sim_orphans and a.sim_plane != "lanes":
        sys.exit("fthsdp chaos: --sim-orphans needs --sim-plane lanes")
    out = simulate(a.seed, a.runs, a.sim_variant, plane=a.sim_plane, jobs=a.jobs or os.cpu_count() or 1,
                   spares=a.sim_spares, blame_all=a.sim_blame_all, orphans=a.sim_orphans)
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        variant = f", variant {a.sim_variant}" if a.sim_variant else ""
        print(f"{out['runs']} simulated runs (seeds {a.seed}..{a.seed + a.runs - 1}{variant}) in {out['seconds']}s: "
              f"{out['violations']} with violations {out['by_invariant'] or ''}; faults {out['faults_injected']}"
              + (f"; committed steps that carried an orphan slot: {out['steps_carried']}" if out["steps_carried"]
                 else ""))
        for x in out["first_failing"]:
            print(f"  seed {x['seed']} ({'; '.join(x['faults'])}): {x['violations'][0]}  "
                  f"[replay: fthsdp chaos --sim --seed {x['seed']} --trace"
                  f"{' --sim-variant ' + a.sim_variant if a.sim_variant else ''}"
                  f"{' --sim-plane ' + a.sim_plane if a.sim_plane != 'lanes' else ''}"
                  f"{' --sim-spares ' + str(a.sim_spares) if a.sim_spares else ''}"
                  f"{' --sim-blame-all' if a.sim_blame_all else ''}{' --sim-orphans' if a.sim_orphans else ''}]")
    if out["violations"]:
        sys.exit(1)


def cmd_chaos(a: argparse.Namespace) -> None:
    if a.sim:
        cmd_sim(a)
        return
    from fthsdp.chaos.config import ChaosConfig
    from fthsdp.chaos.report import exit_code, result_text, summary_text
    from fthsdp.chaos.run import soak
    from fthsdp.chaos.schedule import HA_KINDS, KINDS, RANK_KINDS, REPLICA_KINDS

    kinds = tuple(a.kinds.split(",")) if a.kinds else (REPLICA_KINDS + HA_KINDS if a.ha else REPLICA_KINDS)
    bad = [k for k in kinds if k not in KINDS]
    if bad or (not a.ha and not set(kinds) & set(REPLICA_KINDS + RANK_KINDS)):
        sys.exit(f"fthsdp chaos: --kinds must be among {','.join(KINDS)} (lighthouse and etcd need --ha)")
    if a.duration < 0 or (a.runs < 1 and not a.duration):
        sys.exit("fthsdp chaos: --runs must be at least 1 and --duration not negative (no run, nothing checked)")
    cfg = ChaosConfig(seed=a.seed, replicas=a.replicas, ranks=a.ranks, steps=a.steps, kinds=kinds, faults=a.faults,
                      ha=a.ha, min_step_s=a.min_step_s, compute_s=a.compute_s, model=a.model, timeout_s=a.timeout)
    workdir = pathlib.Path(a.workdir) if a.workdir else pathlib.Path(tempfile.mkdtemp(prefix="fthsdp-chaos-"))
    out = soak(cfg, workdir, runs=a.runs, duration_s=a.duration, keep=a.keep,
               on_result=None if a.json else lambda r: print(result_text(r), flush=True))
    if a.json:
        print(json.dumps(out, indent=2))
    else:
        print(summary_text(out))
        if out["violations"]:
            print(f"runs with violations kept under {workdir}")
    code = exit_code(out)
    if code:
        sys.exit(code)


def register(sub: Subparsers) -> None:
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
                    help="steps per run (faults are drawn up to the last one)")
    ch.add_argument("--faults", type=int, default=0, help="faults per run (default: one per kind)")
    ch.add_argument("--kinds", default="", help="comma-separated among kill,hang,double,rank-hang,rank-kill,"
                                                "lighthouse,etcd (default: kill,hang,double, and with --ha "
                                                "lighthouse,etcd)")
    ch.add_argument("--model", default="tiny")
    ch.add_argument("--min-step-s", type=float, default=0.15, help="pace the trainer's steps")
    ch.add_argument("--compute-s", type=float, default=0.1,
                    help="pad each training forward to at least this long (a steady stand-in compute)")
    ch.add_argument("--timeout", type=float, default=900.0, help="give one run up after this many seconds")
    ch.add_argument("--workdir", default="", help="runs go here (default: a new temporary directory)")
    ch.add_argument("--keep", action="store_true", help="keep the logs of runs without violations too")
    ch.add_argument("--json", action="store_true")
    ch.add_argument("--sim", action="store_true",
                    help="no processes: the control plane (the lighthouse's membership decision, FTAR's lane rules, "
                    "the commit protocol: the real decision code) in a deterministic simulation, --runs seeds from "
                    "--seed (docs/chaos.md, Simulation)")
    ch.add_argument("--sim-variant", default="", metavar="VARIANT",
                    help="with --sim: a deliberately broken protocol the checks must catch (no-confirm, "
                    "reuse-epochs, local-vote)")
    ch.add_argument("--sim-plane", default="lanes", metavar="PLANE",
                    help="with --sim: lanes (every rank's FTAR lane and the commit protocol; the default) or "
                    "membership (the membership layer alone, its data plane a model of failure detection)")
    ch.add_argument("--sim-blame-all", action="store_true",
                    help="--sim: add to every run of 3 replicas or more a member that blames every other member, "
                    "persistently, for 3-8 s (drawn per seed; the other faults stay the seed's)")
    ch.add_argument("--sim-spares", type=int, default=0, metavar="K",
                    help="with --sim: K spare groups besides the drawn replicas in every run (the lighthouse hands "
                    "a dead replica's data slot to a spare; docs/design.md §7, Spares)")
    ch.add_argument("--sim-orphans", action="store_true",
                    help="with --sim: the designed constant global batch (docs/design.md §7, Orphan slots; the "
                    "runtime does not carry yet): the slot holders train the batches of slots nobody holds, and "
                    "every committed step must train every slot's batch exactly once")
    ch.add_argument("--trace", action="store_true", help="with --sim: replay --seed alone and print its trace")
    ch.add_argument("--jobs", type=int, default=0,
                    help="with --sim: processes to share the runs (default: one per CPU; the result is the same)")
    ch.set_defaults(fn=cmd_chaos)
