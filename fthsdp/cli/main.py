"""The ``fthsdp`` command: one module per command group (``lighthouse`` and ``status``, ``emulate``, ``run``, ``demo``,
``chaos``, ``sim``, ``bench``, ``trace``), each adding its subcommands to the parser built here."""

from __future__ import annotations

import argparse

from fthsdp.cli import bench, chaos, demo, emulate, lighthouse, run, secrets, sim, trace
from fthsdp.cli.common import setup_logging


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fthsdp", description="Fault-tolerant HSDP training runtime.")
    p.add_argument("--log-level", default="INFO")
    sub = p.add_subparsers(dest="command", required=True)
    for group in (lighthouse, emulate, run, demo, chaos, sim, bench, secrets, trace):
        group.register(sub)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    args.fn(args)


if __name__ == "__main__":
    main()
