"""Per-replica and read-only credentials (issue 41): the pure rule (who may call what, as whom), the files
``fthsdp secrets`` writes and the runtime reads, and the lighthouse enforcing the rule on every method that names a
replica, on the data-plane rendezvous and on its HTTP port (in-process lighthouses, loopback)."""

from __future__ import annotations

import pathlib
import stat
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from fthsdp.launch.secrets import SecretsError, replica_ids
from fthsdp.runtime.config import ConfigError, RuntimeConfig
from lighthouse import credentials as c
from lighthouse.security import ClientSecurity, SecurityConfigError, ServerSecurity, read_catchup_key, read_token
from lighthouse.v1 import lighthouse_pb2 as pb
from lighthouse.v1 import lighthouse_pb2_grpc as pb_grpc
from tests.helpers.lighthouse import JOB, SLOW_POLICY, ServerThread, https_get

SECRET = "job-secret-0123456789abcdef"


# --- the pure rule --------------------------------------------------------------------------------------------------


def test_credentials_identify_their_holder_and_nothing_forges_one() -> None:
    a = c.replica_credential(SECRET, JOB, "replica-0")
    assert c.identify(SECRET, a) == c.Principal(c.Role.REPLICA, JOB, "replica-0")
    assert c.identify(SECRET, "Bearer " + a) == c.identify(SECRET, a)
    assert c.identify(SECRET, SECRET) == c.JOB_PRINCIPAL
    reader = c.reader_credential(SECRET, JOB)
    assert c.identify(SECRET, reader) == c.Principal(c.Role.READER, JOB)
    assert c.identify(SECRET, c.reader_credential(SECRET)) == c.Principal(c.Role.READER, c.ALL_JOBS)
    mac = a.rsplit("/", 1)[1]
    forged = [
        a.replace("replica-0", "replica-1"),  # another replica under my MAC
        a.replace(f"/{JOB}/", "/other/"),  # another job
        f"fthsdp1/reader/{JOB}/{mac}",  # my MAC as a reader's
        f"fthsdp1/job/{JOB}/replica-0/{mac}",  # an unknown role
        c.replica_credential("another-secret", JOB, "replica-0"),  # another job's secret
        a[:-1] + ("0" if a[-1] != "0" else "1"),  # one hex digit off
        a + "/x", "fthsdp1/replica", "", SECRET + "x", f"fthsdp1/replica/{JOB}/bad id/{mac}",
    ]
    assert [c.identify(SECRET, f) for f in forged] == [None] * len(forged)
    with pytest.raises(ValueError, match="identifier"):
        c.replica_credential(SECRET, JOB, "no/slash")


@pytest.mark.parametrize(("who", "method", "job", "replica", "refused"), [
    (c.JOB_PRINCIPAL, "Leave", "any", "anyone", None),
    (c.Principal(c.Role.REPLICA, JOB, "a"), "Register", JOB, "a", None),
    (c.Principal(c.Role.REPLICA, JOB, "a"), "Heartbeat", JOB, "a", None),
    (c.Principal(c.Role.REPLICA, JOB, "a"), "ReportFailure", JOB, "a", None),
    (c.Principal(c.Role.REPLICA, JOB, "a"), "Watch", JOB, "", None),
    (c.Principal(c.Role.REPLICA, JOB, "a"), "Status", JOB, "", None),
    (c.Principal(c.Role.REPLICA, JOB, "a"), "Rendezvous.Set", JOB, "", None),
    (c.Principal(c.Role.REPLICA, JOB, "a"), "Leave", JOB, "b", "cannot speak for replica 'b'"),
    (c.Principal(c.Role.REPLICA, JOB, "a"), "Session", JOB, "b", "cannot speak for replica 'b'"),
    (c.Principal(c.Role.REPLICA, JOB, "a"), "ReportFailure", JOB, "b", "cannot speak for replica 'b'"),
    (c.Principal(c.Role.REPLICA, JOB, "a"), "Watch", JOB, "b", "cannot speak for replica 'b'"),
    (c.Principal(c.Role.REPLICA, JOB, "a"), "Register", JOB, "", "must name its own replica"),
    (c.Principal(c.Role.REPLICA, JOB, "a"), "Register", "other", "a", "not valid for job 'other'"),
    (c.Principal(c.Role.REPLICA, JOB, "a"), "Rendezvous.Get", "other", "", "not valid for job 'other'"),
    (c.Principal(c.Role.READER, JOB), "Status", JOB, "", None),
    (c.Principal(c.Role.READER, c.ALL_JOBS), "Watch", "other", "", None),
    (c.Principal(c.Role.READER, JOB), "Status", "other", "", "not valid for job 'other'"),
    (c.Principal(c.Role.READER, JOB), "Register", JOB, "a", "may only read"),
    (c.Principal(c.Role.READER, JOB), "Rendezvous.Get", JOB, "", "may only read"),
])
def test_who_may_call_what(who: c.Principal, method: str, job: str, replica: str, refused: str | None) -> None:
    why = c.refusal(who, method, job, replica)
    assert (why is None) if refused is None else (why is not None and refused in why), why


# --- the files ------------------------------------------------------------------------------------------------------


def test_a_replica_file_carries_its_credential_and_the_jobs_catchup_key(tmp_path: pathlib.Path) -> None:
    secret_file, replica_file = tmp_path / "token", tmp_path / "replica-0.credential"
    secret_file.write_text(SECRET + "\n")
    replica_file.write_text(c.credential_file(SECRET, JOB, "replica-0"))
    assert read_token(replica_file) == c.replica_credential(SECRET, JOB, "replica-0")
    # Every replica of the job, whichever file it holds, proves the same catch-up key; another job's differs.
    assert read_catchup_key(replica_file, JOB) == read_catchup_key(secret_file, JOB) == c.catchup_key(SECRET, JOB)
    assert read_catchup_key(secret_file, "other") != read_catchup_key(secret_file, JOB)
    with pytest.raises(SecurityConfigError, match="not 'other'"):
        read_catchup_key(replica_file, "other")
    lone = tmp_path / "lone"
    lone.write_text(c.replica_credential(SECRET, JOB, "replica-0") + "\n")
    with pytest.raises(SecurityConfigError, match="without its catch-up key"):
        read_catchup_key(lone, JOB)
    three = tmp_path / "three"
    three.write_text("a\nb\nc\n")
    with pytest.raises(SecurityConfigError, match="more than two lines"):
        read_token(three)
    cfg = RuntimeConfig.from_env({"FTHSDP_LIGHTHOUSE": "127.0.0.1:1", "FTHSDP_REPLICA_INDEX": "0",
                                  "FTHSDP_NUM_REPLICAS": "2", "FTHSDP_JOB": JOB,
                                  "FTHSDP_TOKEN_FILE": str(replica_file)})
    assert cfg.token == c.catchup_key(SECRET, JOB) and cfg.security.token == read_token(replica_file)
    with pytest.raises(ConfigError, match="without its catch-up key"):
        RuntimeConfig.from_env({"FTHSDP_LIGHTHOUSE": "127.0.0.1:1", "FTHSDP_REPLICA_INDEX": "0",
                                "FTHSDP_NUM_REPLICAS": "2", "FTHSDP_TOKEN_FILE": str(lone)})


def test_the_lighthouse_takes_the_job_secret_not_a_credential() -> None:
    with pytest.raises(SecurityConfigError, match="job secret"):
        ServerSecurity(token=c.replica_credential(SECRET, JOB, "a"))


def test_fthsdp_secrets_writes_a_private_credential_per_replica(tmp_path: pathlib.Path) -> None:
    from fthsdp.launch.secrets import make

    made = make(tmp_path / "job", ["127.0.0.1"], days=1, job=JOB, replicas=replica_ids(2, ["spare-a"]))
    folder = made.folder
    files = sorted(p.name for p in (folder / "replicas").iterdir())
    assert files == ["replica-0.credential", "replica-1.credential", "spare-a.credential"]
    assert stat.S_IMODE((folder / "replicas").stat().st_mode) == 0o700
    secret = read_token(folder / "token")
    for name in files:
        path = folder / "replicas" / name
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        rid = name.removesuffix(".credential")
        assert c.identify(secret, read_token(path)) == c.Principal(c.Role.REPLICA, JOB, rid)
        assert read_catchup_key(path, JOB) == c.catchup_key(secret, JOB)
    assert c.identify(secret, read_token(folder / "reader.credential")) == c.Principal(c.Role.READER, JOB)
    with pytest.raises(SecretsError, match="repeat"):
        replica_ids(2, ["replica-1"])
    with pytest.raises(SecretsError, match="not an id"):
        replica_ids(0, ["a b"])


# --- the lighthouse enforcing it ------------------------------------------------------------------------------------


@pytest.fixture
def lighthouse(start_server: Callable[..., ServerThread]) -> Iterator[tuple[ServerThread, Any]]:
    s = start_server(SLOW_POLICY, rendezvous=True, security=ServerSecurity(token=SECRET))
    with grpc.insecure_channel(s.addr) as ch:
        yield s, pb_grpc.LighthouseStub(ch)  # type: ignore[no-untyped-call]


def md(token: str) -> tuple[tuple[str, str], ...]:
    return ClientSecurity(token=token).metadata()


def members(stub: Any) -> tuple[Any, ...]:
    st = stub.Status(pb.StatusRequest(job_id=JOB), timeout=5, metadata=md(SECRET))
    return st.epoch.number, tuple((x.replica_id, x.incarnation, x.role) for x in st.members)


def refused(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()  # type: ignore[attr-defined]


def test_a_replica_credential_speaks_for_its_replica_only(lighthouse: tuple[ServerThread, Any]) -> None:
    s, stub = lighthouse
    a, b = c.replica_credential(SECRET, JOB, "a"), c.replica_credential(SECRET, JOB, "b")
    for rid, cred in (("a", a), ("b", b)):
        stub.Register(pb.RegisterRequest(job_id=JOB, replica_id=rid, incarnation=f"{rid}-1", shard_count=1),
                      timeout=5, metadata=md(cred))
    before = members(stub)
    assert [m[0] for m in before[1]] == ["a", "b"]
    as_b = [
        lambda: stub.Leave(pb.LeaveRequest(job_id=JOB, replica_id="b", incarnation="b-1"), timeout=5, metadata=md(a)),
        lambda: stub.Heartbeat(pb.HeartbeatRequest(job_id=JOB, replica_id="b", incarnation="b-1"), timeout=5,
                               metadata=md(a)),
        lambda: stub.Register(pb.RegisterRequest(job_id=JOB, replica_id="b", incarnation="b-2", shard_count=1),
                              timeout=5, metadata=md(a)),
        lambda: stub.Ready(pb.ReadyRequest(job_id=JOB, replica_id="b", incarnation="b-1"), timeout=5, metadata=md(a)),
        lambda: stub.ReportFailure(pb.FailureReport(job_id=JOB, reporter_replica_id="b", reporter_incarnation="b-1",
                                                    suspect_replica_id="a", epoch=before[0]), timeout=5,
                                   metadata=md(a)),
        lambda: list(stub.Session(iter([pb.SessionRequest(heartbeat=pb.HeartbeatRequest(
            job_id=JOB, replica_id="b", incarnation="b-1"))]), timeout=5, metadata=md(a))),
        lambda: stub.Register(pb.RegisterRequest(job_id=JOB, replica_id="c", incarnation="c-1", shard_count=1),
                              timeout=5, metadata=md(a)),
    ]
    for call in as_b:
        code, details = refused(call)
        assert code == grpc.StatusCode.PERMISSION_DENIED and "replica 'a'" in details and "cannot speak" in details
    assert members(stub) == before  # nothing changed
    # Its own calls go through; so does the job secret, for anyone.
    stub.Heartbeat(pb.HeartbeatRequest(job_id=JOB, replica_id="a", incarnation="a-1"), timeout=5, metadata=md(a))
    assert stub.Status(pb.StatusRequest(job_id=JOB), timeout=5, metadata=md(a)).epoch.number == before[0]
    stub.Leave(pb.LeaveRequest(job_id=JOB, replica_id="b", incarnation="b-1"), timeout=5, metadata=md(SECRET))
    assert [m[0] for m in members(stub)[1]] == ["a"]
    metrics = https_get(s.http, "/metrics", token=SECRET)[1]
    assert 'rpc_errors_total{code="PERMISSION_DENIED",method="Leave"} 1.0' in metrics


def test_a_credential_of_another_job_or_a_reader_changes_nothing(lighthouse: tuple[ServerThread, Any]) -> None:
    s, stub = lighthouse
    stub.Register(pb.RegisterRequest(job_id=JOB, replica_id="a", incarnation="a-1", shard_count=1), timeout=5,
                  metadata=md(SECRET))
    before = members(stub)
    other_job = c.replica_credential(SECRET, "other", "a")
    reader = c.reader_credential(SECRET, JOB)
    leave = pb.LeaveRequest(job_id=JOB, replica_id="a", incarnation="a-1")
    code, details = refused(lambda: stub.Leave(leave, timeout=5, metadata=md(other_job)))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "not valid for job" in details
    code, details = refused(lambda: stub.Leave(leave, timeout=5, metadata=md(reader)))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "may only read" in details
    rdzv = pb_grpc.RendezvousStub(grpc.insecure_channel(s.addr))  # type: ignore[no-untyped-call]
    code, _ = refused(lambda: rdzv.Set(pb.RendezvousRequest(job_id=JOB, namespace="x", keys=["k"], value=b"v"),
                                       timeout=5, metadata=md(reader)))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert members(stub) == before
    # A reader reads: the status, over gRPC and HTTP, and the metrics.
    assert stub.Status(pb.StatusRequest(job_id=JOB), timeout=5, metadata=md(reader)).epoch.number == before[0]
    assert https_get(s.http, "/status", token=reader)[0] == 200
    assert https_get(s.http, "/metrics", token=reader)[0] == 200
    assert https_get(s.http, "/status", token=c.reader_credential("wrong-secret", JOB))[0] == 401


def test_the_launcher_gives_each_group_its_own_credential(tmp_path: pathlib.Path) -> None:
    from fthsdp.launch.cluster import Cluster
    from fthsdp.launch.config import ClusterConfig

    folder = tmp_path / "creds"
    (folder / "replicas").mkdir(parents=True)
    with pytest.raises(ValueError, match="missing .*token.*reader.credential.*replica-0.credential"):
        Cluster(ClusterConfig(replicas=2, credentials=str(folder)), tmp_path / "run")
    for name in ("token", "reader.credential", "replicas/replica-1.credential"):
        (folder / name).write_text("x\n")
    # A host that runs only group 1 against an external lighthouse needs no job secret and no other group's file.
    (folder / "token").unlink()
    config = ClusterConfig(replicas=2, credentials=str(folder), lighthouse="127.0.0.1:1", groups=(1,))
    Cluster(config, tmp_path / "run")
    env = config.replica_env(1, "127.0.0.1:1", tmp_path / "p", tmp_path, None)
    assert env["FTHSDP_TOKEN_FILE"] == str(folder / "replicas" / "replica-1.credential")
