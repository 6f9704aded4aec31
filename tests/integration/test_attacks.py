"""Attacks on a running job, on loopback (issue 41): each fails to change membership, the trained state or
availability, with a clear error and nothing lost.

- A job started with per-replica credentials (``fthsdp run --credentials``) trains through, at once: a client
  without credentials, a client holding another replica's credential (and a reader's), forged epochs written
  into every replica group's torchrun store ahead of rank 0's, and 300 idle connections held open on the source's
  catch-up server (more than its handshake places) while a killed replica catches up from it. Every replica ends
  at the last step with one state, every batch of every slot trained once, the killed one back, and each attack
  was seen refused.
- A lying catch-up source (one that cannot prove the job's key, one that tampers with the bytes it sends) is
  refused by the joiner, which loads nothing from it.
- 10,000 silent registrations: refused outright without a credential, or with another replica's; with the job
  secret, the job's members stop at its limit (RESOURCE_EXHAUSTED), the durable document stays bounded, and the
  epoch never changes (a registration that never says it is ready never enters the data plane).
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import socket
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import grpc
import pytest
import torch
import torch.distributed as dist

from fthsdp.catchup.client import Fetch, Source
from fthsdp.catchup.server import CatchupServer
from fthsdp.catchup.wire import FetchFailed
from fthsdp.launch.cluster import Cluster
from fthsdp.launch.config import ClusterConfig, Kill
from fthsdp.launch.secrets import make, replica_ids
from fthsdp.runtime.epoch_relay import seal
from lighthouse import credentials as c
from lighthouse import membership as m
from lighthouse.client import LighthouseClient
from lighthouse.epoch_view import EpochView
from lighthouse.model import ACTIVE, JOINING, Endpoints, EpochMember
from lighthouse.security import ClientSecurity, ServerSecurity, read_token
from lighthouse.state_doc import state_to_doc
from lighthouse.v1 import lighthouse_pb2 as pb
from lighthouse.v1 import lighthouse_pb2_grpc as pb_grpc
from tests.helpers.cluster_checks import check_converged, check_exactly_once, check_rejoined, check_survivor
from tests.helpers.lighthouse import JOB, ServerThread, https_get, make_config, wait_until
from tests.helpers.proxy import Proxy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
FORGED_NUMBER = 1 << 53
TRANSPORT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
"""Outcomes of a call that say nothing about what the lighthouse allows (it was not reached, or not in time)."""
IDLE = 300
"""Idle connections the attacker holds on the catch-up source: more than its 256 handshake places."""
LIMIT = 64
"""The member limit of the silent-registrations test (the default, 4096, is the pure rule's test's)."""


def _md(token: str | None) -> tuple[tuple[str, str], ...]:
    return ClientSecurity(token=token).metadata()


def _code(call: Callable[[], Any]) -> grpc.StatusCode | None:
    try:
        call()
    except grpc.RpcError as e:
        return e.code()  # type: ignore[no-any-return,attr-defined]
    return None


def _worker_envs(mark: str) -> list[dict[str, str]]:
    """The environments of the training processes carrying ``mark`` (what a process on the host can read of its
    own user's processes: where each group's torchrun store listens)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            raw = pathlib.Path(f"/proc/{pid}/environ").read_bytes()
            env = dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)
            if env.get("FTHSDP_ATTACK_MARK") == mark and env.get("RANK") == "1" and env.get("MASTER_PORT"):
                out.append(env)
    return out


class Attacker:
    """Everything a process on the host without the job's secret (but with one replica's credential and the
    reader's) tries while the job trains; what each attempt got back is kept for the test to check."""

    def __init__(self, folder: pathlib.Path, mark: str) -> None:
        self.folder, self.mark = folder, mark
        self.addr = ""
        self.codes: dict[str, set[grpc.StatusCode | None]] = {}
        self.forged: set[tuple[str, str]] = set()
        self.idle_opened = 0
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self._idle: list[socket.socket] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _note(self, what: str, code: grpc.StatusCode | None) -> None:
        if code not in TRANSPORT:  # the lighthouse going down at the end of the job says nothing about the attack
            self.codes.setdefault(what, set()).add(code)

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                if self.addr:
                    self._round()
                self.stop.wait(0.2)  # pacing of the attack, not synchronisation
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.errors.append(e)
        finally:
            for s in self._idle:
                s.close()

    def _round(self) -> None:
        mine = read_token(self.folder / "replicas" / "replica-1.credential")
        reader = read_token(self.folder / "reader.credential")
        with grpc.insecure_channel(self.addr) as ch:
            stub = pb_grpc.LighthouseStub(ch)  # type: ignore[no-untyped-call]
            try:
                st = stub.Status(pb.StatusRequest(job_id=JOB), timeout=5, metadata=_md(reader))
            except grpc.RpcError:
                return  # the lighthouse is not up yet, or is going down
            members = {x.replica_id: x for x in st.epoch.members}
            victim = members.get("replica-0")
            if victim is not None:
                for token, what in ((None, "none"), ("wrong", "wrong"), (mine, "other"), (reader, "reader")):
                    self._calls(stub, victim.incarnation, st.epoch.number, token, what)
            self._forge(st)
            self._hold_catchup(st)

    def _calls(self, stub: Any, incarnation: str, epoch: int, token: str | None, what: str) -> None:
        """Speak as replica-0 with ``token``: make it leave, report its peer dead, register it again."""
        md = _md(token)
        self._note(f"leave/{what}", _code(lambda: stub.Leave(pb.LeaveRequest(
            job_id=JOB, replica_id="replica-0", incarnation=incarnation, reason="evil"), timeout=5, metadata=md)))
        self._note(f"report/{what}", _code(lambda: stub.ReportFailure(pb.FailureReport(
            job_id=JOB, reporter_replica_id="replica-0", reporter_incarnation=incarnation,
            suspect_replica_id="replica-1", epoch=epoch, reason="evil"), timeout=5, metadata=md)))
        self._note(f"register/{what}", _code(lambda: stub.Register(pb.RegisterRequest(
            job_id=JOB, replica_id="replica-0", incarnation="evil", shard_count=2), timeout=5, metadata=md)))

    def _forge(self, st: pb.StatusResponse) -> None:
        """Forged epochs (numbered 2^53, an attacker's rendezvous) under the next keys of every group's relay,
        written only where rank 0 has not written yet: rank 0's own write replaces each."""
        incarnations = {x.replica_id: x.incarnation for x in st.epoch.members}
        for env in _worker_envs(self.mark):
            rid = env["FTHSDP_REPLICA_ID"] if "FTHSDP_REPLICA_ID" in env else f"replica-{env['FTHSDP_REPLICA_INDEX']}"
            inc = incarnations.get(rid)
            if inc is None or (rid, inc) in self.forged:
                continue
            prefix = f"fthsdp/epochs/{rid}/{inc}/"
            try:
                store = dist.PrefixStore(prefix, dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                                                               is_master=False, timeout=timedelta(seconds=5),
                                                               wait_for_workers=False))
                forged = pb.Epoch(job_id=JOB, number=FORGED_NUMBER, rendezvous="127.0.0.1:1/evil", reason="forged")
                body = forged.SerializeToString()
                for k in range(1, 40):
                    name = str(k)
                    value = seal(b"not-the-group-key-0123456789", prefix + name, body) if k % 2 else body
                    store.compare_set(name, "", value)  # type: ignore[arg-type]  # only where nothing is yet
            except (dist.DistError, RuntimeError, OSError):
                continue  # that group is going down (the kill): its next incarnation gets its own
            self.forged.add((rid, inc))

    def _hold_catchup(self, st: pb.StatusResponse) -> None:
        """Keep ``IDLE`` idle connections open on the first active member's catch-up server (it drops them after its
        handshake deadline; they are opened again)."""
        self._idle = [s for s in self._idle if _open(s)]
        source = next((x.endpoints.catchup for x in st.epoch.members
                       if x.role == pb.ROLE_ACTIVE and x.endpoints.catchup), "")
        if not source:
            return
        host, port = source.rsplit(":", 1)
        while len(self._idle) < IDLE:
            with contextlib.suppress(OSError):
                self._idle.append(socket.create_connection((host, int(port)), timeout=5))
                self.idle_opened += 1
                continue
            break


def _open(s: socket.socket) -> bool:
    """Whether the server still holds ``s`` open (a closed one reads b'' without blocking)."""
    s.setblocking(False)
    try:
        data = s.recv(1 << 16, socket.MSG_PEEK)
        if data == b"":
            s.close()
            return False
        s.recv(1 << 16)  # the challenge it was sent: drop it, stay idle
        return True
    except BlockingIOError:
        return True
    except OSError:
        s.close()
        return False
    finally:
        with contextlib.suppress(OSError):
            s.setblocking(True)


def test_a_job_with_credentials_trains_through_every_attack(tmp_path: pathlib.Path) -> None:
    folder = make(tmp_path / "creds", ["127.0.0.1"], days=1, job=JOB, replicas=replica_ids(2, [])).folder
    mark = str(tmp_path)
    attacker = Attacker(folder, mark)
    steps = 160  # paced at 0.15 s; the kill at step 20, and from step 130 the other group holds until the killed
    # one is back in the job (FTHSDP_FAULT_HOLD_UNTIL), so its restart and catch-up fit however slow the machine
    config = ClusterConfig(replicas=2, ranks=2, steps=steps, model="tiny", kills=(Kill(1, 20, "forward"),),
                           restart_delay_s=0.5, timeout_s=240, min_step_s=0.15, credentials=str(folder),
                           env={i: {"FTHSDP_ATTACK_MARK": mark, "FTHSDP_JOB": JOB,
                                    "FTHSDP_FAULT_HOLD_UNTIL": "130:2"} for i in range(2)})

    def tick(cluster: Cluster) -> None:
        attacker.addr = cluster.addr

    attacker.thread.start()
    try:
        report = Cluster(config, tmp_path / "run", on_tick=tick).run()
    finally:
        attacker.stop.set()
        attacker.thread.join(30)
    assert not attacker.errors, attacker.errors
    # Trained state and availability: both at the last step with one state, every batch once, the killed one back.
    check_converged(report, steps)
    check_survivor(tmp_path / "run", 0, steps)
    check_rejoined(tmp_path / "run", 1, report)
    check_exactly_once(tmp_path / "run", 2, steps)
    # Membership: only the kill changed it; epochs go up one by one, never to the forged number.
    epochs = [e for e in report["events"] if e["event"] == "epoch"]
    numbers = [e["epoch"] for e in epochs]
    assert numbers == sorted(set(numbers)) and max(numbers) < 100, numbers
    assert not [e for e in epochs if "evil" in e["reason"] or "left" in e["reason"]], epochs
    # Each attack was made, and refused with the status that says why.
    unauth, denied = {grpc.StatusCode.UNAUTHENTICATED}, {grpc.StatusCode.PERMISSION_DENIED}
    for call in ("leave", "report", "register"):
        assert attacker.codes[f"{call}/none"] == unauth and attacker.codes[f"{call}/wrong"] == unauth
        assert attacker.codes[f"{call}/other"] == denied and attacker.codes[f"{call}/reader"] == denied
    assert {rid for rid, _ in attacker.forged} == {"replica-0", "replica-1"}, attacker.forged
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "run").glob("replica*.log"))
    assert "did not write (forged?): refused" in logs
    assert attacker.idle_opened >= IDLE


# --- a lying catch-up source ------------------------------------------------------------------------------------


def _tamper(upstream: str, at: int = 100_000, every: int = 0) -> Proxy:
    """A proxy in front of a catch-up server that flips the byte at ``at`` of what the server sends (past the
    handshake), and then every ``every`` bytes (0: once), on each connection."""

    def flip(offset: int, data: bytes) -> bytes:
        out = bytearray(data)
        for pos in range(max(at, offset), offset + len(data)):
            if pos == at or (every and (pos - at) % every == 0):
                out[pos - offset] ^= 0xFF
        return bytes(out)

    return Proxy(upstream, down=flip)


@contextlib.contextmanager
def _source(key: str, replica: str, state: dict[str, torch.Tensor]) -> Iterator[CatchupServer]:
    epoch = EpochView(JOB, 2, (EpochMember(replica, "i0", ACTIVE, 1, Endpoints()),
                               EpochMember("joiner", "i1", JOINING, 1, Endpoints())), "", 0.0, "test")
    srv = CatchupServer(job=JOB, replica_id=replica, rank=0, world_size=1, token=key, epoch=lambda: epoch,
                        snapshot=lambda: [(n, t.clone()) for n, t in state.items()], wait_s=10,
                        chunk_bytes=64 << 10)
    stop = threading.Event()
    srv.step = 1  # type: ignore[attr-defined]  # where the test reads the source's step

    def train() -> None:  # commits steps, so that the joiner's step comes
        while not stop.is_set():
            srv.at_commit(srv.step, active=True)  # type: ignore[attr-defined]
            stop.wait(0.01)  # a step's worth of time (pacing)
            srv.before_update(srv.step)  # type: ignore[attr-defined]
            srv.step += 1  # type: ignore[attr-defined]

    t = threading.Thread(target=train, daemon=True)
    t.start()
    try:
        yield srv
    finally:
        stop.set()
        t.join(5)
        srv.close(drain_s=1)


def test_a_lying_catchup_source_is_refused_and_nothing_is_loaded() -> None:
    key = c.catchup_key("job-secret-for-catchup", JOB)
    state = {"param/0": torch.randn(200_000, generator=torch.Generator().manual_seed(1))}

    def fetch(address: str, source: str, srv: CatchupServer) -> Any:
        step = srv.step + 50  # type: ignore[attr-defined]  # a step the source reaches soon
        return Fetch([Source(source, address)], job=JOB, replica_id="joiner", incarnation="i1", rank=0, step=step,
                     token=key, expected=[("param/0", "torch.float32", (200_000,))]).start().result(60)

    with (_source(c.catchup_key("another-jobs-secret", JOB), "impostor", state) as impostor,
          pytest.raises(FetchFailed, match="did not prove|unauthenticated")):
        fetch(impostor.address, "impostor", impostor)
    with _source(key, "honest", state) as honest:
        liar = _tamper(honest.address, every=50_000)  # every chunk it sends is corrupted
        try:
            with pytest.raises(FetchFailed, match="no source could supply"):
                fetch(liar.address, "honest", honest)
        finally:
            liar.close()
        once = _tamper(honest.address)  # one corrupted chunk: caught by its checksum, fetched again
        try:
            got = fetch(once.address, "honest", honest)
        finally:
            once.close()
        assert got.refetched_chunks >= 1 and torch.equal(got.tensors["param/0"], state["param/0"])


# --- 10,000 silent registrations ----------------------------------------------------------------------------------


def test_ten_thousand_silent_registrations_change_nothing_or_stay_bounded(tmp_path: pathlib.Path) -> None:
    secret = "job-secret-silent-registrations"
    srv = ServerThread(make_config(m.Policy(heartbeat_interval_s=0.2, heartbeat_timeout_s=2.0, confirm_age_s=0.5,
                                            expected_replicas=2, max_members=LIMIT),
                                   security=ServerSecurity(token=secret)))
    real = [LighthouseClient(srv.addr, JOB, rid, shard_count=1,
                             security=ClientSecurity(token=c.replica_credential(secret, JOB, rid)))
            for rid in ("replica-0", "replica-1")]
    try:
        for cl in real:
            cl.start()
        wait_until(lambda: (e := real[0].epoch) is not None and len(e.members) == 2, 30, what="both in an epoch")
        first = real[0].epoch
        assert first is not None
        with grpc.insecure_channel(srv.addr) as ch:
            stub = pb_grpc.LighthouseStub(ch)  # type: ignore[no-untyped-call]

            def register(i: int, token: str | None) -> grpc.StatusCode | None:
                return _code(lambda: stub.Register(pb.RegisterRequest(
                    job_id=JOB, replica_id=f"silent-{i}", incarnation="s", shard_count=1), timeout=10,
                    metadata=_md(token)))

            other = c.replica_credential(secret, JOB, "replica-1")
            refused = {register(i, other if i % 2 else None) for i in range(10_000)}
            assert refused == {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}
            assert real[0].epoch is not None and real[0].epoch.number == first.number  # nothing changed
            # A holder of the job secret (a leaked one, a runaway tool): bounded by the job's member limit. (The
            # silent ones time out meanwhile and free places, so how many get in depends on the pace.)
            job = srv.lh.jobs[JOB]
            most = [0]
            codes = []
            for i in range(10_000):
                codes.append(register(i, secret))
                most[0] = max(most[0], len(job.state.members))
        assert set(codes) == {None, grpc.StatusCode.RESOURCE_EXHAUSTED} and codes[:LIMIT - 2] == [None] * (LIMIT - 2)
        assert codes[LIMIT - 2] == grpc.StatusCode.RESOURCE_EXHAUSTED or most[0] == LIMIT
        assert most[0] == LIMIT, most
        # The silent ones time out. None ever entered the data plane (a joiner enters when it says it is ready),
        # so the epoch never changed: the real members' first one is still theirs.
        wait_until(lambda: len(job.state.members) == 2, 120, interval=0.2, what="the silent registrations dropped")
        last = real[0].epoch
        assert last is not None and last.number == first.number and job.number == first.number
        assert sorted(x.replica_id for x in last.members) == ["replica-0", "replica-1"]
        doc = state_to_doc(job.state)
        assert len(str(doc)) < 1_500_000 and len(doc["departed"]) <= 2048
        assert https_get(srv.http, "/healthz")[0] == 200
    finally:
        for cl in real:
            cl.close()
        srv.stop()
