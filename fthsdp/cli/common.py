"""What the command groups share: logging, running a server until a signal, printing a result as JSON or as its
table, and the client's TLS and token options."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from fthsdp.bench.results import Result

if TYPE_CHECKING:
    from lighthouse.security import ClientSecurity

    Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"

R = TypeVar("R", bound=Result)


def setup_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format=LOG_FORMAT, stream=sys.stderr)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)


def run_until_signal(coro_factory: Callable[[asyncio.Event], Awaitable[Any]]) -> None:
    """Run ``coro_factory(stop)`` until SIGTERM/SIGINT sets ``stop``."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await coro_factory(stop)

    asyncio.run(main())


def emit(result: R, as_json: bool, table: Callable[[R], str]) -> None:
    """Print ``result``: its JSON document, or its human table."""
    print(json.dumps(result.to_json(), indent=2) if as_json else table(result))


def add_client_security_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", default="", help="file holding the job token (default: $FTHSDP_TOKEN_FILE)")
    p.add_argument("--tls-ca", default="", help="CA certificate of the lighthouse: use TLS (default: $FTHSDP_TLS_CA)")
    p.add_argument("--tls-cert", default="", help="client certificate for mTLS (default: $FTHSDP_TLS_CERT)")
    p.add_argument("--tls-key", default="", help="client key for mTLS (default: $FTHSDP_TLS_KEY)")


def client_security(a: argparse.Namespace) -> ClientSecurity:
    """The client's TLS and token options: each flag, else its FTHSDP_* environment variable."""
    from lighthouse import security as sec

    def pick(flag: str, var: str) -> str | None:
        return flag or os.environ.get(var) or None

    try:
        return sec.ClientSecurity.from_files(pick(a.tls_ca, sec.ENV_TLS_CA), pick(a.tls_cert, sec.ENV_TLS_CERT),
                                             pick(a.tls_key, sec.ENV_TLS_KEY),
                                             pick(a.token_file, sec.ENV_TOKEN_FILE))
    except sec.SecurityConfigError as e:
        sys.exit(f"fthsdp {a.command}: {e}")


def add_carrying_args(p: argparse.ArgumentParser, what: str, deterministic: str) -> None:
    """``--carry-orphans`` and ``--deterministic`` (docs/design.md §7, "Orphan slots", "Bitwise failure
    transparency"), with what each does for this command (``what``, ``deterministic``)."""
    p.add_argument("--carry-orphans", action="store_true",
                   help=f"the surviving groups train the batches of a dead group's data slot besides their own "
                   f"(FTHSDP_ORPHANS=carry){what}")
    p.add_argument("--deterministic", action="store_true",
                   help=f"the exact cross-replica sum (FTHSDP_DETERMINISTIC=1; implies --carry-orphans){deterministic}")
