"""Who may fetch a snapshot (``fthsdp.catchup.auth``): the challenge-response over the job token, the admission
rule (a joining member of the source's current epoch, same incarnation), loopback-only serving without a token,
and that a source copies no state for a request it refuses."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fthsdp.catchup import auth
from fthsdp.catchup.client import Fetch, Source
from fthsdp.catchup.server import CatchupServer, InsecureServing
from fthsdp.catchup.wire import FetchFailed, Hello
from lighthouse.epoch_view import EpochView
from lighthouse.model import ACTIVE, JOINING, Endpoints, EpochMember
from tests.helpers.catchup import training

pytestmark = pytest.mark.timeout(60)
HELLO = Hello("job", "j", "inc1", 0, 12)
EPOCH = EpochView("job", 4, (EpochMember("src", "inc0", ACTIVE, 1, Endpoints()),
                             EpochMember("j", "inc1", JOINING, 1, Endpoints())), "", 0.0, "test")


def test_proof_verifies_only_for_the_same_token_nonce_and_request() -> None:
    nonce = auth.new_nonce()
    assert len(nonce) == 2 * auth.NONCE_BYTES and nonce != auth.new_nonce()
    good = dataclasses.replace(HELLO, proof=auth.proof("s3cret", nonce, HELLO))
    assert "s3cret" not in good.proof and len(good.proof) == 64
    assert auth.verify("s3cret", nonce, good)
    assert not auth.verify("other", nonce, good)
    assert not auth.verify("s3cret", auth.new_nonce(), good)  # a replayed proof, under a new challenge
    for change in ({"step": 13}, {"rank": 1}, {"replica": "k"}, {"incarnation": "inc2"}, {"job": "job2"}):
        assert not auth.verify("s3cret", nonce, dataclasses.replace(good, **change))  # type: ignore[arg-type]
    assert not auth.verify("s3cret", nonce, dataclasses.replace(good, proof=""))
    assert not auth.verify("s3cret", nonce, dataclasses.replace(good, replica="j\0", proof=good.proof))
    assert auth.verify("", nonce, HELLO)  # no token: nothing to prove (loopback only)


@pytest.mark.parametrize("epoch,hello,code", [
    (EPOCH, HELLO, None),
    (None, HELLO, "not_member"),
    (EPOCH, dataclasses.replace(HELLO, replica="stranger"), "not_member"),
    (EPOCH, dataclasses.replace(HELLO, replica="src", incarnation="inc0"), "not_joining"),
    (EPOCH, dataclasses.replace(HELLO, incarnation="inc-old"), "stale_incarnation"),
    (EPOCH, dataclasses.replace(HELLO, job="other"), "wrong_job"),
])
def test_admission_rule(epoch: EpochView | None, hello: Hello, code: str | None) -> None:
    refusal = auth.admit(epoch, "job", hello)
    assert (refusal[0] if refusal else None) == code


def test_without_a_token_only_loopback_is_served() -> None:
    assert auth.serving_allowed("127.0.0.1", "") and auth.serving_allowed("::1", "")
    assert auth.serving_allowed("localhost", "")
    assert not auth.serving_allowed("10.0.0.5", "") and not auth.serving_allowed("0.0.0.0", "")
    assert auth.serving_allowed("10.0.0.5", "tok")
    with pytest.raises(InsecureServing, match="loopback only"):
        CatchupServer(job="job", replica_id="r", rank=0, world_size=1, snapshot=lambda: [], epoch=lambda: EPOCH,
                      host="0.0.0.0")


def _source(epoch: EpochView | None, copies: list[int]) -> CatchupServer:
    def snapshot() -> list[tuple[str, torch.Tensor]]:
        copies.append(1)
        return [("w", torch.ones(4))]

    return CatchupServer(job="job", replica_id="src", rank=0, world_size=1, snapshot=snapshot, token="s3cret",
                         epoch=lambda: epoch, wait_s=5)


@pytest.mark.parametrize("token,replica,epoch,code", [
    ("wrong", "j", EPOCH, "unauthenticated"),
    ("", "j", EPOCH, "unauthenticated"),
    ("s3cret", "stranger", EPOCH, "not_member"),
    ("s3cret", "j", dataclasses.replace(EPOCH, members=EPOCH.members[:1]), "not_member"),
])
def test_a_refused_request_copies_no_state(token: str, replica: str, epoch: EpochView, code: str) -> None:
    copies: list[int] = []
    srv = _source(epoch, copies)
    try:
        with training(srv, 10):
            f = Fetch([Source("src", srv.address)], job="job", replica_id=replica, incarnation="inc1", rank=0,
                      step=30, token=token).start()
            with pytest.raises(FetchFailed, match=code):
                f.result(30)
            assert not copies and not srv._requested and not srv._snapshots
    finally:
        srv.close(drain_s=1)


def test_an_admitted_joiner_with_the_token_is_served() -> None:
    copies: list[int] = []
    srv = _source(EPOCH, copies)
    try:
        with training(srv, 10):
            got = Fetch([Source("src", srv.address)], job="job", replica_id="j", incarnation="inc1", rank=0,
                        step=40, token="s3cret").start().result(30)
        assert got.step == 40 and torch.equal(got.tensors["w"], torch.ones(4)) and copies == [1]
    finally:
        srv.close(drain_s=1)
