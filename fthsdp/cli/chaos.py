"""``fthsdp chaos``: local clusters under a seeded schedule of failures, invariants checked
(``fthsdp.chaos``)."""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fthsdp.cli.common import Subparsers


def cmd_chaos(a: argparse.Namespace) -> None:
    from fthsdp.chaos.config import ChaosConfig
    from fthsdp.chaos.report import exit_code, result_text, summary_text
    from fthsdp.chaos.run import soak
    from fthsdp.chaos.schedule import KINDS, REPLICA_KINDS

    kinds = tuple(a.kinds.split(",")) if a.kinds else (KINDS if a.ha else REPLICA_KINDS)
    bad = [k for k in kinds if k not in KINDS]
    if bad or (not a.ha and not set(kinds) & set(REPLICA_KINDS)):
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
    ch.add_argument("--kinds", default="", help="comma-separated among kill,hang,double,lighthouse,etcd "
                                                "(default: all that apply)")
    ch.add_argument("--model", default="tiny")
    ch.add_argument("--min-step-s", type=float, default=0.15, help="pace the trainer's steps")
    ch.add_argument("--compute-s", type=float, default=0.1,
                    help="pad each training forward to at least this long (a steady stand-in compute)")
    ch.add_argument("--timeout", type=float, default=900.0, help="give one run up after this many seconds")
    ch.add_argument("--workdir", default="", help="runs go here (default: a new temporary directory)")
    ch.add_argument("--keep", action="store_true", help="keep the logs of runs without violations too")
    ch.add_argument("--json", action="store_true")
    ch.set_defaults(fn=cmd_chaos)
