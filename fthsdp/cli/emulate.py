"""``fthsdp emulate``: N emulated replicas (control plane only) against a lighthouse until interrupted."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from fthsdp.cli.common import add_client_security_args, client_security, run_until_signal

if TYPE_CHECKING:
    from fthsdp.cli.common import Subparsers


def cmd_emulate(a: argparse.Namespace) -> None:
    from fthsdp.bench.emulate import run_emulate

    security = client_security(a)
    run_until_signal(lambda stop: run_emulate(a.lighthouse, a.replicas, a.job, a.prefix, stop, security=security,
                                              ranks=a.ranks))


def register(sub: Subparsers) -> None:
    em = sub.add_parser("emulate", help="run N emulated replicas (control plane only) until interrupted")
    em.add_argument("--lighthouse", default="127.0.0.1:29510", help="HOST:PORT[,HOST:PORT...]")
    em.add_argument("--replicas", type=int, required=True)
    em.add_argument("--prefix", default="emu", help="replica ids are PREFIX-00000, ...")
    em.add_argument("--job", default="default")
    em.add_argument("--ranks", type=int, default=1, help="ranks per emulated replica group (one session each group)")
    add_client_security_args(em)
    em.set_defaults(fn=cmd_emulate)
