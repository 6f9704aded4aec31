"""``fthsdp lighthouse`` (run the membership coordinator) and ``fthsdp status`` (print a lighthouse's members and
epochs)."""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import sys
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

from fthsdp.cli.common import add_client_security_args, client_security, run_until_signal

if TYPE_CHECKING:
    from fthsdp.cli.common import Subparsers
    from lighthouse.security import ClientSecurity


def confirm_age_risk(confirm_age_s: float, heartbeat_interval_s: float) -> str:
    """Why a confirm age is risky ('' when it is not): at or under one heartbeat interval, a healthy replica's
    last heartbeat can be that old when a failure report against it lands (a false blame over a slow link), and
    the report is confirmed: it dies for nothing (docs/chaos.md, "Simulation")."""
    if confirm_age_s > heartbeat_interval_s:
        return ""
    return (f"--confirm-age {confirm_age_s:g} is not above the heartbeat interval {heartbeat_interval_s:g}: a "
            "healthy replica's last heartbeat can be that old when a failure report against it lands, and the "
            "report is confirmed (default: 2 intervals)")


def cmd_lighthouse(a: argparse.Namespace) -> None:
    from fthsdp.launch.procutil import write_atomic
    from lighthouse.config import LighthouseConfig, etcd_tls_from_env
    from lighthouse.errors import StoreAccessDenied, StoreUnavailable
    from lighthouse.membership import Policy
    from lighthouse.security import SecurityConfigError, ServerSecurity, exposure, is_loopback
    from lighthouse.server.app import serve
    from lighthouse.stores.etcd_tls import EtcdTLS
    from lighthouse.stores.factory import open_store

    interval = a.heartbeat_interval if a.heartbeat_interval else min(0.5, a.heartbeat_timeout / 4)
    try:
        policy = Policy(min_replicas=a.min_replicas, heartbeat_interval_s=interval,
                        heartbeat_timeout_s=a.heartbeat_timeout,
                        confirm_age_s=a.confirm_age if a.confirm_age else min(a.heartbeat_timeout, 2 * interval),
                        join_window_s=a.join_window, expected_replicas=a.expected_replicas,
                        max_reforms=a.max_reforms, join_deadline_s=a.join_deadline,
                        straggler_factor=a.straggler_factor, straggler_confirm=a.straggler_confirm,
                        straggler_policy=a.straggler_policy, max_members=a.max_members,
                        orphan_planes=a.orphan_planes)
    except ValueError as e:
        sys.exit(f"fthsdp lighthouse: {e}")
    if risk := confirm_age_risk(policy.confirm_age_s, policy.heartbeat_interval_s):
        print(f"fthsdp lighthouse: warning: {risk}", file=sys.stderr)
    if a.lane_spread_from < 2:
        sys.exit(f"fthsdp lighthouse: --lane-spread-from must be >= 2 (members of a lane), not {a.lane_spread_from}")
    try:
        security = ServerSecurity.from_files(a.tls_cert, a.tls_key, a.tls_client_ca, a.token_file)
        security.ssl_context()  # fail now, with a clear message, on unreadable TLS files
        env_tls = etcd_tls_from_env()
        etcd_tls = EtcdTLS.from_options(a.etcd_ca or (env_tls.ca if env_tls else None),
                                        a.etcd_cert or (env_tls.cert if env_tls else None),
                                        a.etcd_key or (env_tls.key if env_tls else None))
        store = open_store(a.store, etcd_tls)
    except (SecurityConfigError, ValueError) as e:
        sys.exit(f"fthsdp lighthouse: {e}")
    hosts = [a.bind.rsplit(":", 1)[0]] + ([a.http.rsplit(":", 1)[0]] if a.http else [])
    if open_to := exposure(hosts, security):
        if not a.insecure:
            store.close()
            sys.exit("fthsdp lighthouse: refusing to serve the job open to the network: " + "; ".join(open_to)
                     + ". Make a token and a certificate with `fthsdp secrets --out DIR --host NAME` and pass "
                     "--token-file DIR/token --tls-cert DIR/server.pem --tls-key DIR/server.key (the replicas: "
                     "FTHSDP_TOKEN_FILE and FTHSDP_TLS_CA=DIR/ca.pem), or bind to 127.0.0.1, or pass --insecure "
                     "on a network only you use")
        for why in open_to:
            logging.getLogger("fthsdp.lighthouse").warning("INSECURE (--insecure): %s", why)
    try:  # a store that refuses us (TLS, client certificate) is a configuration error: say so and stop
        store.check_access()
    except StoreAccessDenied as e:
        store.close()
        sys.exit(f"fthsdp lighthouse: {e}")
    except StoreUnavailable as e:  # down for now: the lighthouse starts and follows until it answers
        logging.getLogger("fthsdp.lighthouse").warning("store not answering at start: %s", e)
    config = LighthouseConfig(bind=a.bind, http=a.http or None, jobs=tuple(a.job or ["default"]), policy=policy,
                              rendezvous=not a.no_rendezvous, insecure_tcp_rendezvous=a.insecure_tcp_rendezvous,
                              member_rendezvous=a.rendezvous_on == "members", lane_spread_from=a.lane_spread_from,
                              security=security, advertise=a.advertise, election_ttl_s=a.election_ttl,
                              election_probe_s=a.election_probe,
                              probe_timeout_s=a.probe_timeout)
    if config.probe_timeout_s < 0:
        sys.exit(f"fthsdp lighthouse: --probe-timeout must be >= 0, not {config.probe_timeout_s:g}")
    if config.election_probe_s < 0:
        sys.exit(f"fthsdp lighthouse: --election-probe must be >= 0, not {config.election_probe_s:g}")
    if config.insecure_tcp_rendezvous and not is_loopback(config.host):
        sys.exit(f"fthsdp lighthouse: --insecure-tcp-rendezvous needs a loopback --bind, not {config.host!r}")
    def ready(lh: Any) -> None:
        if a.port_file:
            write_atomic(pathlib.Path(a.port_file),
                         f"grpc={lh.port} http={lh.http_port} rendezvous={lh.rendezvous_addr}")

    run_until_signal(lambda stop: serve(config, store, stop=stop, ready=ready))
    logging.getLogger("fthsdp.lighthouse").info("lighthouse stopped")


def fetch_status(http: str, sec: ClientSecurity, timeout: float) -> tuple[dict[str, Any] | None, list[str]]:
    """The ``/status`` of the lighthouses at ``http`` (comma-separated; the leader's answer wins), and what went
    wrong asking each."""
    ctx = sec.ssl_context()
    status: dict[str, Any] | None = None
    errors: list[str] = []
    for addr in [x.strip() for x in http.split(",") if x.strip()]:
        url = f"{'https' if ctx else 'http'}://{addr}/status"
        try:
            req = urllib.request.Request(url, headers=sec.http_headers())
            with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:
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
    return status, errors


def cmd_status(a: argparse.Namespace) -> None:
    status, errors = fetch_status(a.http, client_security(a), a.timeout)
    if status is None:
        sys.exit("fthsdp status: cannot reach any lighthouse: " + "; ".join(errors))
    if a.json:
        print(json.dumps(status, indent=2))
        return
    print(f"job {status['job']}  epoch {status['epoch']}  leader {'yes' if status['leader'] else 'no'}  "
          f"members {len(status['members'])}  min_replicas {status['min_replicas']}"
          + (f"  (leader at {status['leader_address'] or 'unknown'})" if not status["leader"] else ""))
    print(f"{'REPLICA':<24} {'ROLE':<8} {'IN EPOCH':<8} {'STEP':>8} {'HB AGE (s)':>10} {'COMPUTE':>8} {'WAIT':>7}  "
          "DIGEST (STEP)")
    for x in status["members"]:
        digest = f"{x['digest']} ({x['digest_step']})" if x.get("digest") else "-"
        pace = x.get("pace")
        compute, wait = (f"{pace['compute_s']:.3f}", f"{pace['wait_s']:.3f}") if pace else ("-", "-")
        print(f"{x['replica_id']:<24} {x['role']:<8} {'yes' if x['in_epoch'] else 'no':<8} {x['step']:>8} "
              f"{x['last_heartbeat_age_s']:>10.2f} {compute:>8} {wait:>7}  {digest}")
    agreement = status.get("agreement")
    print("state: " + (agreement["text"] if agreement else "not compared yet (no step has two digests)"))
    slow = status.get("stragglers") or []
    print("stragglers: " + ("; ".join(x["text"] for x in slow) if slow else "none"))
    links = status.get("slow_links") or []
    print("slow links: " + ("; ".join(x["text"] for x in links) if links else "none"))
    if waiting := status.get("waiting_slots"):
        print(f"data slots without an active holder: {waiting} (their batches wait until a holder or a spare takes "
              "them)")
    if status["history"]:
        print("\nrecent epochs:")
        for h in status["history"][-a.history:]:
            print(f"  {h['epoch']:>5}  {len(h['members'])} members  {h['reason'][:100]}")


def register(sub: Subparsers) -> None:
    from lighthouse import lane_hosts

    lh = sub.add_parser("lighthouse", help="run the membership coordinator")
    lh.add_argument("--bind", default="127.0.0.1:29510", help="gRPC HOST:PORT (port 0: any free port)")
    lh.add_argument("--http", default="127.0.0.1:29511", help="HTTP HOST:PORT for /status, /metrics, / ('' = off)")
    lh.add_argument("--job", action="append", default=None, help="job id served (repeatable; default 'default')")
    lh.add_argument("--min-replicas", type=int, default=1, help="no epoch with fewer live replicas")
    lh.add_argument("--max-members", type=int, default=4096,
                    help="replica groups registered per job, at most (a new replica id beyond is refused)")
    lh.add_argument("--orphan-planes", action="store_true",
                    help="for jobs whose replicas carry orphan slots (FTHSDP_ORPHANS=carry): a change of which "
                    "active members hold which slot starts a new data plane, so every member of a group deals the "
                    "orphans' micro-batches alike")
    lh.add_argument("--heartbeat-timeout", type=float, default=3.0, help="seconds without heartbeat = dead")
    lh.add_argument("--heartbeat-interval", type=float, default=0.0,
                    help="interval advertised to clients (default: min(0.5, timeout/4))")
    lh.add_argument("--confirm-age", type=float, default=0.0,
                    help="a reported peer with no heartbeat for this long is confirmed dead (default 2 intervals)")
    lh.add_argument("--probe-timeout", type=float, default=1.0,
                    help="a replica whose session closed gets one connection to its catch-up port, this long: "
                         "refused, it is dead at once (0: never probe)")
    lh.add_argument("--join-window", type=float, default=0.0,
                    help="bootstrap: after min-replicas registered, wait this long for more")
    lh.add_argument("--expected-replicas", type=int, default=0,
                    help="bootstrap: form the first epoch as soon as this many registered")
    lh.add_argument("--max-reforms", type=int, default=2,
                    help="a peer still heartbeating but reported after this many consecutive re-formed epochs is "
                         "declared hung (dead); 0: never")
    lh.add_argument("--join-deadline", type=float, default=300.0,
                    help="seconds a joiner may stay in the data plane without turning active before it is dropped; "
                         "0: never")
    lh.add_argument("--straggler-factor", type=float, default=1.5,
                    help="name a replica a straggler when its compute per step is at least this many times the "
                    "others' (status, page, fthsdp status)")
    lh.add_argument("--straggler-confirm", type=int, default=3,
                    help="consecutive slow reports (distinct steps) before a replica is named a straggler")
    lh.add_argument("--straggler-policy", choices=("report", "eject"), default="report",
                    help="report: name stragglers in the status; eject: also take one out of the job when that wins "
                    "(it comes back once a probe step shows it healthy)")
    lh.add_argument("--store", default="memory://", help="durable store URL (memory:// is the default)")
    lh.add_argument("--etcd-ca", default="", help="etcd over TLS: the CA certificate (PEM) that signed etcd's "
                    "server certificates (env FTHSDP_ETCD_CA)")
    lh.add_argument("--etcd-cert", default="", help="client certificate (PEM) presented to an etcd run with "
                    "--client-cert-auth (env FTHSDP_ETCD_CERT)")
    lh.add_argument("--etcd-key", default="", help="its private key (PEM) (env FTHSDP_ETCD_KEY)")
    lh.add_argument("--no-rendezvous", action="store_true", help="do not host the data-plane rendezvous")
    lh.add_argument("--insecure-tcp-rendezvous", action="store_true",
                    help="host the data-plane rendezvous on a plain TCPStore (no token, no TLS; loopback --bind "
                         "only) instead of the authenticated gRPC Rendezvous service")
    lh.add_argument("--rendezvous-on", choices=("members", "lighthouse"), default="members",
                    help="where each lane's ranks meet after a membership change: on a store one of the lane's "
                         "members hosts, chosen by a rule every member computes (the lighthouse only sends the "
                         "epoch), or every rank on the lighthouse's own service (default: members)")
    lh.add_argument("--lane-spread-from", type=int, default=lane_hosts.SPREAD_FROM,
                    help="a lane of at least this many members that meets on the addresses its members kept meets "
                         f"on {lane_hosts.SPREAD} of their stores at once; stamped on every epoch, so the whole job "
                         f"uses one number (default: {lane_hosts.SPREAD_FROM}; at least 2)")
    lh.add_argument("--port-file", default="", help="write 'grpc=P http=P rendezvous=R' here once serving (R: "
                    "'members:' or 'lighthouse:' for the gRPC service, H:P for the opt-in TCPStore, empty when "
                    "off)")
    lh.add_argument("--advertise", default="", help="gRPC HOST:PORT other lighthouses name as the leader's "
                    "(HA on etcd; default: the bound address)")
    lh.add_argument("--election-ttl", type=int, default=5,
                    help="HA on etcd: seconds of the leader's lease; a leader that stops answering is replaced "
                    "within about this")
    lh.add_argument("--election-probe", type=float, default=0.25,
                    help="HA on etcd: seconds between a follower's knocks on the leader's gRPC port; refused twice "
                    "in a row (its process is gone), the follower takes over at once instead of waiting for the "
                    "lease (0: the lease alone)")
    lh.add_argument("--tls-cert", default="", help="TLS certificate (PEM) for the gRPC and HTTP ports")
    lh.add_argument("--tls-key", default="", help="TLS private key (PEM)")
    lh.add_argument("--tls-client-ca", default="", help="require client certificates signed by this CA (mTLS)")
    lh.add_argument("--token-file", default="", help="file holding the job token every call must present")
    lh.add_argument("--insecure", action="store_true",
                    help="serve off loopback without a token, or with a token but no TLS (refused otherwise: anyone "
                    "who reaches the ports could join the job or read the token); logged as a warning")
    lh.set_defaults(fn=cmd_lighthouse)

    st = sub.add_parser("status", help="print a lighthouse's members and epochs")
    st.add_argument("--http", default="127.0.0.1:29511",
                    help="the lighthouse's HTTP HOST:PORT[,HOST:PORT...] (the leader's answer is shown)")
    st.add_argument("--json", action="store_true")
    st.add_argument("--history", type=int, default=10, help="how many recent epochs to show")
    st.add_argument("--timeout", type=float, default=5.0)
    add_client_security_args(st)
    st.set_defaults(fn=cmd_status)
