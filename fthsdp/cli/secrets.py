"""``fthsdp secrets``: make a job's secret, TLS certificates and credentials (``fthsdp.launch.secrets``)."""

from __future__ import annotations

import argparse
import pathlib
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fthsdp.cli.common import Subparsers


def cmd_secrets(a: argparse.Namespace) -> None:
    from fthsdp.launch.secrets import SecretsError, make, replica_ids

    try:
        ids = replica_ids(a.replicas, a.replica_id)
        made = make(pathlib.Path(a.out), a.host, days=a.days, job=a.job, replicas=ids)
    except SecretsError as e:
        sys.exit(f"fthsdp secrets: {e}")
    print(f"wrote {made.folder} (readable by you only). Lighthouse:\n"
          f"  fthsdp lighthouse --token-file {made.path('token')} --tls-cert {made.path('server.pem')} "
          f"--tls-key {made.path('server.key')} ...")
    if ids:
        print(f"Each replica group its own credential (it can speak for that group only):\n"
              f"  FTHSDP_REPLICA_ID=<id> FTHSDP_TOKEN_FILE={made.path('replicas')}/<id>.credential "
              f"FTHSDP_TLS_CA={made.path('ca.pem')}   (ids: {', '.join(ids)})")
    else:
        print(f"Replicas (one job secret for all; --replicas N makes a credential per replica group):\n"
              f"  FTHSDP_TOKEN_FILE={made.path('token')} FTHSDP_TLS_CA={made.path('ca.pem')}")
    print(f"Read-only (fthsdp status, Prometheus): --token-file {made.path('reader.credential')} "
          f"--tls-ca {made.path('ca.pem')}")


def register(sub: Subparsers) -> None:
    p = sub.add_parser("secrets", help="make a job's secret, TLS certificates, per-replica and read-only "
                       "credentials for a lighthouse off loopback")
    p.add_argument("--out", required=True, help="a new folder for them (never overwritten)")
    p.add_argument("--host", action="append", default=[], required=True,
                   help="a name or address the replicas dial the lighthouse at (repeatable)")
    p.add_argument("--days", type=int, default=365, help="how long the certificates are valid")
    p.add_argument("--job", default="default", help="the job the credentials are for (FTHSDP_JOB)")
    p.add_argument("--replicas", type=int, default=0,
                   help="make a credential for each of replica-0 .. replica-{N-1} (the runtime's default ids; "
                        "spares included: N + spares)")
    p.add_argument("--replica-id", action="append", default=[],
                   help="make a credential for this replica id too (FTHSDP_REPLICA_ID; repeatable)")
    p.set_defaults(fn=cmd_secrets)
