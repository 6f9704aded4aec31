"""The emulated lanes' stores (``fthsdp.bench.lanes``, issue 39) in a process of their own: in a deployment a lane's
host is a rank on its own host, so its store does not share an interpreter with the hundreds of member clients a
worker of the emulator runs. Each worker has one store process; its replicas' ``RemoteHosting`` ask it to start
their store (the real ``LaneStoreServer``, on its first use: when the replica first hosts a lane or announces itself
as a candidate), tell it the epoch each holds (the store admits namespaces near it), and stop it when the replica
dies."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from ftar.lane_hosting import LaneHosting
from ftar.lane_store import LaneStoreServer
from lighthouse.epoch_view import EpochView
from lighthouse.proto_codec import epoch_from_pb, view_to_pb
from lighthouse.v1 import lighthouse_pb2 as pb


class RemoteHosting(LaneHosting):
    """A replica's ``LaneHosting`` whose lane store is served by the store process (``serve_stores``) over ``conn``
    (shared by a worker's replicas, one request at a time under ``lock``)."""

    def __init__(self, replica_id: str, job_id: str, key: str, epoch: Callable[[], EpochView | None], conn: Any,
                 lock: threading.Lock) -> None:
        super().__init__(replica_id, job_id, key, "127.0.0.1", epoch)
        self._conn, self._conn_lock = conn, lock
        self._served: str | None = None

    def address(self) -> str:
        with self._conn_lock:
            if self._served is None:
                self._conn.send(("serve", self.replica_id))
                self._served = str(self._conn.recv())
            return self._served

    def held(self, epoch: EpochView) -> None:
        """The replica holds ``epoch``: its store (if it serves one) admits that epoch's namespaces."""
        with self._conn_lock:
            if self._served is not None:
                self._conn.send(("epoch", self.replica_id, view_to_pb(epoch).SerializeToString()))

    def close(self) -> None:
        with self._conn_lock:
            if self._served is not None:
                self._conn.send(("stop", self.replica_id))
                self._served = None


def _held(epochs: dict[str, EpochView], rid: str) -> Callable[[], EpochView | None]:
    return lambda: epochs.get(rid)


def serve_stores(conn: Any, job_id: str, key: str) -> None:
    """A store process: a worker's replicas' lane stores, started, told their replica's epoch and stopped on the
    worker's requests over ``conn``, until it closes."""
    epochs: dict[str, EpochView] = {}
    servers: dict[str, LaneStoreServer] = {}
    while True:
        try:
            msg: tuple[Any, ...] = conn.recv()
        except EOFError:
            break
        if msg[0] == "serve":
            rid: str = msg[1]
            server = servers.get(rid)
            if server is None:
                server = servers[rid] = LaneStoreServer(job_id, key, "127.0.0.1", _held(epochs, rid))
            conn.send(server.address)
        elif msg[0] == "epoch":
            epochs[msg[1]] = epoch_from_pb(pb.Epoch.FromString(msg[2]))
        elif msg[0] == "stop":
            stopped = servers.pop(msg[1], None)
            if stopped is not None:
                stopped.close()
        else:
            break
    for server in servers.values():
        server.close()
