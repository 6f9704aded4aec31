"""The data plane's rendezvous store (docs/design.md §5): a ``torch.distributed.Store`` over the lighthouse's
authenticated ``Rendezvous`` gRPC service, so that only holders of the job token (or a client certificate) can
read or write the keys the process groups meet on and blame is read from.

Process groups are built from this object (``ftar.group``), not from an address: Gloo and NCCL call it back for
their rendezvous. Blocking ``get``/``wait`` are one call each, waited for on the lighthouse.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import grpc
import torch.distributed as dist

from lighthouse.rendezvous import SCHEME, hosting_of
from lighthouse.security import LEADER_METADATA, ClientSecurity
from lighthouse.v1 import lighthouse_pb2 as pb
from lighthouse.v1 import lighthouse_pb2_grpc as pb_grpc

log = logging.getLogger("fthsdp.ftar")

RPC_MARGIN_S = 5.0
"""A call's deadline beyond the wait it asks the lighthouse for."""


class StoreRefused(dist.DistStoreError):
    """The lighthouse refused a rendezvous call (wrong token, a malformed or over-limit key or value, an epoch it
    no longer keeps) or could not be reached; the message says which."""


class StoreTimeout(dist.DistStoreError):
    """A ``get``/``wait`` on the rendezvous store timed out (the keys never appeared)."""


@dataclass(frozen=True)
class StoreTarget:
    """Where the rendezvous store of a job is, and how to authenticate to it."""

    address: str
    security: ClientSecurity
    job_id: str


def is_lighthouse_rendezvous(rendezvous: str) -> bool:
    """Whether an epoch's rendezvous is the lighthouse's gRPC service (else: a TCPStore address)."""
    return rendezvous.startswith(SCHEME)


class LighthouseStore(dist.Store):
    """The keys of one namespace (``<job>/epoch<N>``) of the lighthouse's rendezvous. Thread-safe."""

    def __init__(self, target: StoreTarget, namespace: str, timeout: timedelta) -> None:
        super().__init__()
        self.target = target
        self.namespace = namespace
        self._wait = timeout
        self._metadata = target.security.metadata()
        self._lock = threading.Lock()
        self._address = target.address
        self._channel: Any = None
        self._stub: Any = None
        self._clones: list[LighthouseStore] = []

    def _request(self, timeout_s: float, **fields: Any) -> pb.RendezvousRequest:
        """A request on this store's namespace (``timeout_s``: how long a ``Get``/``Wait`` may block)."""
        req = pb.RendezvousRequest(job_id=self.target.job_id, namespace=self.namespace, **fields)
        if timeout_s:
            req.timeout_s = timeout_s
        return req

    def _refused(self, what: str, method: str, e: grpc.RpcError) -> StoreRefused:
        """The store's error for a failed call."""
        code = e.code().name if hasattr(e, "code") else "UNKNOWN"
        details = e.details() if hasattr(e, "details") else str(e)
        return StoreRefused(f"{what} {method} at {self._address} ({self.namespace}): {code}: {details}")

    def _rpc(self, method: str, timeout_s: float = 0.0, **fields: Any) -> pb.RendezvousResponse:
        req = self._request(timeout_s, **fields)
        for attempt in (1, 2):  # a second only after a follower named the leader
            with self._lock:
                if self._stub is None:
                    self._channel = self.target.security.channel(self._address, aio=False)
                    self._stub = pb_grpc.RendezvousStub(self._channel)  # type: ignore[no-untyped-call]
                stub = self._stub
            try:
                resp: pb.RendezvousResponse = getattr(stub, method)(req, timeout=timeout_s + RPC_MARGIN_S,
                                                                     metadata=self._metadata)
                return resp
            except grpc.RpcError as e:
                leader = _leader(e)
                if attempt == 1 and leader and leader != self._address:
                    self._reconnect(leader)
                    continue
                raise self._refused("rendezvous", method, e) from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _reconnect(self, address: str) -> None:
        with self._lock:
            channel, self._channel, self._stub, self._address = self._channel, None, None, address
        if channel is not None:
            channel.close()

    def close(self) -> None:
        """Close the channel (a later call opens a new one)."""
        self._reconnect(self._address)

    # --- torch.distributed.Store ------------------------------------------------------------------------------

    def set(self, key: str, value: bytes | str) -> None:
        self._rpc("Set", keys=[key], value=_bytes(value))

    def get(self, key: str) -> bytes:
        wait = self._wait.total_seconds()
        resp = self._rpc("Get", wait, keys=[key])
        if not resp.ok:
            raise StoreTimeout(f"rendezvous key {key!r} of {self.namespace} did not appear within {wait:.1f}s")
        return resp.value

    def add(self, key: str, amount: int) -> int:
        return self._rpc("Add", keys=[key], amount=amount).number

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._rpc("CompareSet", keys=[key], expected=_bytes(expected), value=_bytes(desired)).value

    def check(self, keys: Sequence[str]) -> bool:
        return self._rpc("Check", keys=list(keys)).ok

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        wait = (timeout or self._wait).total_seconds()
        if not self._rpc("Wait", wait, keys=list(keys)).ok:
            raise StoreTimeout(f"rendezvous keys {list(keys)[:4]} of {self.namespace} did not all appear within "
                               f"{wait:.1f}s")

    def delete_key(self, key: str) -> bool:
        return self._rpc("DeleteKey", keys=[key]).ok

    def num_keys(self) -> int:
        return self._rpc("NumKeys").number

    def set_timeout(self, timeout: timedelta) -> None:
        self._wait = timeout

    def clone(self) -> LighthouseStore:
        """A store on the same namespace with a channel of its own (Gloo clones the store for its threads).
        Kept referenced here: the C++ side holds it but does not keep its Python object alive."""
        twin = LighthouseStore(StoreTarget(self._address, self.target.security, self.target.job_id),
                               self.namespace, self._wait)
        self._clones.append(twin)
        return twin


def _bytes(value: bytes | str | Sequence[int]) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _leader(e: grpc.RpcError) -> str:
    """The leader a following lighthouse named in its refusal ('' if none)."""
    try:
        md = cast(Iterable[tuple[str, str | bytes]], e.trailing_metadata() or ())
    except Exception:
        return ""
    for key, value in md:
        if key == LEADER_METADATA:
            return value if isinstance(value, str) else value.decode("ascii", "replace")
    return ""


def on_lighthouse(rendezvous: str) -> str:
    """The lighthouse's namespace of an epoch's rendezvous, wherever its lanes meet (``lighthouse:<job>/epoch<N>``);
    a TCPStore's address as it is."""
    hosting = hosting_of(rendezvous)
    return SCHEME + hosting[1] if hosting is not None else rendezvous


def open_store(rendezvous: str, target: StoreTarget | Callable[[], StoreTarget] | None,
               timeout: timedelta) -> Any:
    """The store of an epoch's rendezvous: ``LighthouseStore`` for ``lighthouse:<job>/epoch<N>`` (``target``
    says where and how to authenticate), else the TCPStore at ``host:port/prefix`` (torchft's client). A rendezvous
    on the members' stores is ``ftar.lane_hosting``'s."""
    if hosting_of(rendezvous) is not None and not is_lighthouse_rendezvous(rendezvous):
        raise StoreRefused(f"rendezvous {rendezvous!r} is on the lanes' members' stores (ftar.lane_hosting)")
    if not is_lighthouse_rendezvous(rendezvous):
        from torchft.process_group import create_store_client

        return create_store_client(rendezvous, timeout=timeout)
    if target is None:
        raise StoreRefused(f"rendezvous {rendezvous!r} is on the lighthouse, but this membership does not say "
                           "how to reach it")
    return LighthouseStore(target() if callable(target) else target, rendezvous[len(SCHEME):], timeout)
