"""``fthsdp secrets``: make a job's token and TLS certificates (``fthsdp.launch.secrets``)."""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fthsdp.cli.common import Subparsers


def cmd_secrets(a: argparse.Namespace) -> None:
    from fthsdp.launch.secrets import SecretsError, make

    try:
        made = make(pathlib.Path(a.out), a.host, days=a.days)
    except SecretsError as e:
        sys.exit(f"fthsdp secrets: {e}")
    print(f"wrote {made.folder} (readable by you only). Lighthouse:\n"
          f"  fthsdp lighthouse --token-file {made.path('token')} --tls-cert {made.path('server.pem')} "
          f"--tls-key {made.path('server.key')} ...\n"
          f"Replicas (and fthsdp status/run: --token-file, --tls-ca):\n"
          f"  FTHSDP_TOKEN_FILE={made.path('token')} FTHSDP_TLS_CA={made.path('ca.pem')}")


def register(sub: Subparsers) -> None:
    p = sub.add_parser("secrets", help="make a job's token and TLS certificates for a lighthouse off loopback")
    p.add_argument("--out", required=True, help="a new folder for them (never overwritten)")
    p.add_argument("--host", action="append", default=[], required=True,
                   help="a name or address the replicas dial the lighthouse at (repeatable)")
    p.add_argument("--days", type=int, default=365, help="how long the certificates are valid")
    p.set_defaults(fn=cmd_secrets)
