"""The latest trace on the lighthouse (issue 40): ``fthsdp trace --publish`` sends it (``PUT /trace``), the lighthouse
keeps the newest in memory, ``/status`` describes it, ``/trace.json`` serves it and the page links it. Publishing
takes the job secret or a replica's credential; a reader, a stranger, a malformed or oversized body, or another
job's trace is refused with a clear error and changes nothing."""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from fthsdp.cli.trace import publish
from lighthouse import credentials as c
from lighthouse.security import ClientSecurity, ServerSecurity
from lighthouse.server.traces import MAX_TRACE_BYTES, BadTrace, check
from tests.helpers.lighthouse import JOB, SLOW_POLICY, ServerThread, https_get

SECRET = "job-secret-0123456789abcdef"


def _trace(events: int, job: str = JOB) -> dict[str, Any]:
    return {"traceEvents": [{"name": f"e{i}", "ph": "i", "ts": i, "pid": 0, "tid": 0} for i in range(events)],
            "otherData": {"job": job}}


def _put(addr: str, body: bytes, token: str | None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    req = urllib.request.Request(f"http://{addr}/trace", data=body, method="PUT", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.fixture
def lighthouse(start_server: Callable[..., ServerThread]) -> ServerThread:
    return start_server(SLOW_POLICY, security=ServerSecurity(token=SECRET))


def test_a_published_trace_is_served_described_and_linked(lighthouse: ServerThread) -> None:
    s = lighthouse
    assert https_get(s.http, "/trace.json", token=SECRET)[0] == 404  # none yet
    assert json.loads(https_get(s.http, "/status", token=SECRET)[1])["trace"] is None
    assert publish(json.dumps(_trace(3)).encode(), s.http, ClientSecurity(token=SECRET), 5.0) == []
    code, body, _ = https_get(s.http, "/trace.json", token=c.reader_credential(SECRET, JOB))  # a reader reads it
    assert code == 200 and json.loads(body) == _trace(3)
    meta = json.loads(https_get(s.http, "/status", token=SECRET)[1])["trace"]
    assert meta["events"] == 3 and meta["job"] == JOB and meta["url"] == "/trace.json" and meta["bytes"] > 0
    page = https_get(s.http, "/", token=SECRET)[1]
    assert 'href="trace.json"' in page and "3 events" in page
    # A replica's credential publishes too; the newest replaces the one before.
    replica = c.replica_credential(SECRET, JOB, "replica-0")
    assert _put(s.http, json.dumps(_trace(5)).encode(), replica)[0] == 200
    assert json.loads(https_get(s.http, "/trace.json", token=SECRET)[1]) == _trace(5)


@pytest.mark.parametrize("case", ["reader", "no-token", "wrong-token", "not-json", "not-a-trace", "other-job"])
def test_a_refused_publication_says_why_and_changes_nothing(lighthouse: ServerThread, case: str) -> None:
    s = lighthouse
    assert _put(s.http, json.dumps(_trace(2)).encode(), SECRET)[0] == 200
    body, token, want = json.dumps(_trace(9)).encode(), SECRET, (400, "not kept")
    if case == "reader":
        token, want = c.reader_credential(SECRET, JOB), (403, "cannot publish")
    elif case == "no-token":
        token, want = None, (401, "unauthenticated")
    elif case == "wrong-token":
        token, want = "another-secret-0123456789", (401, "unauthenticated")
    elif case == "not-json":
        body = b"{not json"
    elif case == "not-a-trace":
        body = b'{"events": []}'
    else:
        body = json.dumps(_trace(9, job="another-job")).encode()
    code, detail = _put(s.http, body, token)
    assert (code, want[1] in detail) == (want[0], True), detail
    assert json.loads(https_get(s.http, "/trace.json", token=SECRET)[1]) == _trace(2)


def test_an_oversized_trace_is_refused_before_its_body_is_read(lighthouse: ServerThread) -> None:
    host, port = lighthouse.http.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.putrequest("PUT", "/trace")
        conn.putheader("Authorization", f"Bearer {SECRET}")
        conn.putheader("Content-Length", str(MAX_TRACE_BYTES + 1))
        conn.endheaders()  # and no body
        resp = conn.getresponse()
        assert resp.status == 413 and b"limit" in resp.read()
    finally:
        conn.close()
    assert https_get(lighthouse.http, "/trace.json", token=SECRET)[0] == 404


def test_publish_reports_each_lighthouse_that_did_not_keep_it(lighthouse: ServerThread) -> None:
    body = json.dumps(_trace(1)).encode()
    errors = publish(body, f"{lighthouse.http},127.0.0.1:1", ClientSecurity(token=SECRET), 2.0)
    assert len(errors) == 1 and "127.0.0.1:1" in errors[0]
    reader = ClientSecurity(token=c.reader_credential(SECRET, JOB))
    assert publish(body, lighthouse.http, reader, 2.0)[0].count("HTTP 403") == 1


def test_the_check_of_a_trace_body() -> None:
    assert check(json.dumps(_trace(4)).encode(), JOB).events == 4
    assert check(json.dumps({"traceEvents": []}).encode(), JOB).events == 0  # a job it does not name: accepted
    for bad in (b"\xff", b"[]", b'{"traceEvents": {}}', json.dumps(_trace(1, "x")).encode()):
        with pytest.raises(BadTrace):
            check(bad, JOB)
    with pytest.raises(BadTrace, match="limit"):
        check(b" " * (MAX_TRACE_BYTES + 1), JOB)
