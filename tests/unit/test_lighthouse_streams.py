"""The lighthouse's record of its members' watch streams (``lighthouse.server.jobs.Job``), the evidence behind a
death confirmed at once: which incarnation's stream closed from the replica's end and was not replaced."""

from __future__ import annotations

from lighthouse import membership as m
from lighthouse.server.jobs import Job

POLICY = m.Policy(min_replicas=1, expected_replicas=2, heartbeat_interval_s=1.0, heartbeat_timeout_s=30.0,
                  confirm_age_s=1.0)


def job_with(*ids: str) -> Job:
    state = m.State()
    for rid in ids:
        state = m.decide(state, m.Register(rid, f"{rid}-1", 1, m.Endpoints(), 0.0), POLICY).state
    return Job("default", state, "", 0.0)


def test_a_stream_closed_by_the_replica_is_evidence_until_replaced() -> None:
    job = job_with("a", "b")
    job.stream_opened("b", "b-1")
    job.stream_opened("b", "b-1")  # its second rank
    assert job.disconnected_s("b", 10.0) is None
    job.stream_closed("b", "b-1", 10.0)  # one rank died (the other's stream is still open): the replica cannot go on
    assert job.disconnected_s("b", 10.5) == 0.5
    job.stream_opened("b", "b-1")  # a reconnect: no longer evidence
    assert job.disconnected_s("b", 11.0) is None


def test_a_stream_the_server_ended_is_no_evidence() -> None:
    job = job_with("a", "b")
    job.stream_opened("b", "b-1")
    job.stream_closed("b", "b-1", None)
    assert job.disconnected_s("b", 10.0) is None


def test_evidence_is_about_one_incarnation() -> None:
    job = job_with("a", "b")
    job.stream_opened("b", "b-0")
    job.stream_closed("b", "b-0", 5.0)  # an older incarnation of b
    assert job.disconnected_s("b", 10.0) is None  # b-1 is the member
    assert job.disconnected_s("nobody", 10.0) is None


def test_streams_of_replicas_that_are_no_members_are_forgotten() -> None:
    job = job_with("a")
    for i in range(200):
        job.stream_opened(f"x{i}", "i")
        job.stream_closed(f"x{i}", "i", 1.0)
    job.stream_opened("a", "a-1")
    job.stream_closed("a", "a-1", 2.0)
    assert job.disconnected_s("a", 3.0) == 1.0
    assert len(job._disconnected) <= 2 * len(job.state.members) + 64 + 1
