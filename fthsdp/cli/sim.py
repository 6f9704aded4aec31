"""``fthsdp sim``: effective training time of a large job under failures, whole-job restarts vs fthsdp
(``fthsdp.bench.sim``)."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from fthsdp.cli.common import emit

if TYPE_CHECKING:
    from fthsdp.cli.common import Subparsers


def cmd_sim(a: argparse.Namespace) -> None:
    from fthsdp.bench.results import format_sim
    from fthsdp.bench.sim import SimConfig, simulate

    try:
        config = SimConfig(gpus=a.gpus, replica_gpus=a.replica_gpus, mtbf_min=a.mtbf_min,
                           sync_recovery_min=a.sync_recovery_min, stall_min=a.stall_min, rejoin_min=a.rejoin_min,
                           arrivals=a.arrivals, seed=a.seed, hours=a.hours)
    except ValueError as e:
        sys.exit(f"fthsdp sim: {e}")
    result = simulate(config)
    emit(result, a.json, format_sim)


def register(sub: Subparsers) -> None:
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
