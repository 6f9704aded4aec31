"""``fthsdp trace``: one timeline of a running job. Asks the lighthouse for the members (``/status``), reads every
rank's step timeline over its catch-up port (``fthsdp.trace.pull``; proven with the job's catch-up key), and writes
a Chrome trace-event JSON (Perfetto, ``chrome://tracing``) and, if asked, a PNG; with ``--publish`` it also sends it
to the lighthouse, whose page links it. Exits non-zero when no rank could be read, the trace is malformed, or no
lighthouse kept a trace it was asked to publish."""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any

from fthsdp.cli.common import add_client_security_args, client_security
from fthsdp.cli.lighthouse import fetch_status
from fthsdp.trace import chrome, render
from fthsdp.trace.pull import Collector, Follower

if TYPE_CHECKING:
    from fthsdp.cli.common import Subparsers
    from lighthouse.security import ClientSecurity


def catchup_key(token_file: str, job: str) -> str:
    """The key the job's ranks prove a timeline read with: from the job secret or a replica's credential ('' with
    no token file: a job without a token serves on loopback only)."""
    from lighthouse.security import SecurityConfigError, read_catchup_key

    path = token_file or os.environ.get("FTHSDP_TOKEN_FILE", "")
    if not path:
        return ""
    try:
        return read_catchup_key(path, job)
    except SecurityConfigError as e:
        sys.exit(f"fthsdp trace: {e} (a timeline is read with the job secret or a replica's credential, not the "
                 "read-only one)")


def write(collector: Collector, history: list[dict[str, Any]], out: pathlib.Path, png: pathlib.Path | None,
          launcher: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Write the trace of what ``collector`` read (and its PNG); returns the document. ``ValueError`` when it is not
    a valid Chrome trace (a bug: it is checked before it is written)."""
    doc = chrome.build(collector.tracks.values(), history, launcher or [], job=collector.job)
    if bad := chrome.problems(doc):
        raise ValueError("the trace is malformed: " + "; ".join(bad[:5]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc))
    if png is not None:
        render.draw(doc, png)
    return doc


def publish(body: bytes, http: str, sec: ClientSecurity, timeout: float) -> list[str]:
    """``PUT /trace`` of the trace document ``body`` to every lighthouse at ``http`` (comma-separated: each keeps
    its own, and its page links it); returns what went wrong with each that did not keep it."""
    ctx, errors = sec.ssl_context(), []
    for addr in [x.strip() for x in http.split(",") if x.strip()]:
        url = f"{'https' if ctx else 'http'}://{addr}/trace"
        req = urllib.request.Request(url, data=body, method="PUT",
                                     headers={**sec.http_headers(), "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=ctx):
                pass
        except urllib.error.HTTPError as e:
            errors.append(f"{url}: HTTP {e.code} {e.read().decode(errors='replace')[:200]}")
        except (urllib.error.URLError, OSError) as e:
            errors.append(f"{url}: {e}")
    return errors


def cmd_trace(a: argparse.Namespace) -> None:
    sec = client_security(a)

    def status() -> dict[str, Any]:
        got, errors = fetch_status(a.http, sec, a.timeout)
        if got is None:
            raise OSError("cannot reach any lighthouse: " + "; ".join(errors))
        return got

    try:
        first = status()
    except OSError as e:
        sys.exit(f"fthsdp trace: {e}")
    collector = Collector(str(first["job"]), catchup_key(a.token_file, str(first["job"])))
    follower = Follower(collector, status)
    deadline = time.monotonic() + a.follow
    follower.tick()
    while time.monotonic() < deadline:
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))  # a poll period, not a synchronisation
        follower.tick()
    doc = write(collector, follower.history or list(first.get("history", ())), pathlib.Path(a.out),
                pathlib.Path(a.png) if a.png else None)
    tracks = chrome.rank_tracks(doc)
    for replica, names in tracks.items():
        print(f"{replica}: {', '.join(names)}")
    for why in collector.errors:
        print(f"not read: {why}", file=sys.stderr)
    print(f"trace: {a.out} ({len(doc['traceEvents'])} events, {sum(map(len, tracks.values()))} rank tracks)"
          + (f"; png: {a.png}" if a.png else ""))
    if not tracks:
        sys.exit("fthsdp trace: no rank's timeline could be read")
    if a.publish:
        errors = publish(pathlib.Path(a.out).read_bytes(), a.http, sec, a.timeout)  # as written: no second dump
        for why in errors:
            print(f"not published: {why}", file=sys.stderr)
        if len(errors) == len([x for x in a.http.split(",") if x.strip()]):
            sys.exit("fthsdp trace: no lighthouse kept the trace")
        print("published: the lighthouse's page links it (/trace.json)")


def register(sub: Subparsers) -> None:
    tr = sub.add_parser("trace", help="one timeline of a running job: every rank's step phases, epochs and deaths "
                        "(Chrome trace JSON for Perfetto or chrome://tracing; a PNG)")
    tr.add_argument("--http", default="127.0.0.1:29511",
                    help="the lighthouse's HTTP HOST:PORT (comma-separated: several; the leader's answer wins)")
    add_client_security_args(tr)
    tr.add_argument("--out", default="fthsdp-trace.json", help="write the Chrome trace-event JSON here")
    tr.add_argument("--png", default="", help="also draw it as a PNG here")
    tr.add_argument("--follow", type=float, default=0.0,
                    help="read again every second for this many seconds (a rank that dies meanwhile keeps its steps "
                    "up to its last read)")
    tr.add_argument("--publish", action="store_true",
                    help="also send it to the lighthouse (PUT /trace; the job secret or a replica's credential), whose "
                    "page then links it as the latest trace (/trace.json)")
    tr.add_argument("--timeout", type=float, default=5.0, help="seconds per lighthouse request")
    tr.set_defaults(fn=cmd_trace)
