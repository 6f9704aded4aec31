"""Emulated lanes (issue 39): the data plane's rendezvous of many ranks after a membership change, with the real
protocol and no tensors, driven by the real lighthouse's epochs.

An emulated rank of lane L in replica R does what a real one does in ``ftar.group.EpochGroup.open``, with the same
code: it finds where the lane meets (``ftar.group.meet``: the lane host's store, whose address it kept, or looked up
on the lighthouse, or the lighthouse's own store), announces its lane store if it is one of the lane's candidates,
arrives, then makes the store calls of the backend's own connect, which are the only part emulated: ``mesh``, a Gloo
lane's (every pair connects as the group is built: a member sets its address and waits for and reads every
member's); ``nccl`` (rank 0 sets the unique id and the others read it); ``lazy`` (Gloo's pairs connecting on first
use: each member reads its two ring neighbours'; the lanes do not do it, ``docs/design.md`` §5). Then it learns its
lane's candidates (``LaneHosting.learn``; after the group's first collective, see below). The stores are the real
ones (the lighthouse's service, each replica's ``LaneStoreServer``), with the real keys and authentication (the job
token on the lighthouse, request MACs under the catch-up key on the lane stores).

Each emulated replica is one ``LaneHosting`` (one lane store for all its emulated lanes: a real replica has one per
rank, so this is the harder case for the host), in one of a few worker processes (``processes``). Every emulated
rank is a thread: the store clients are the runtime's own, which block. The lane stores themselves (the real
``LaneStoreServer``) run in a store process beside each worker (``fthsdp.bench.lane_stores``): in a deployment a
lane's host is a process on its own host, not one that shares an interpreter with hundreds of its members'
clients. A member learns the lane's candidates' addresses once every member of its lane in every worker connected
(``LaneEmulator.finished``), as a real member does after the group's first collective, which no member completes
before all connected.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import queue
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ftar.group import meet
from ftar.lane_hosting import LaneHosting
from ftar.store import StoreTarget
from fthsdp.bench.lane_stores import RemoteHosting, serve_stores
from lighthouse.epoch_view import EpochView
from lighthouse.proto_codec import epoch_from_pb, view_to_pb
from lighthouse.security import ClientSecurity
from lighthouse.v1 import lighthouse_pb2 as pb

BACKENDS = ("mesh", "nccl", "lazy")
"""How the backend's own connect uses the lane's store (see the module)."""
KEEP_DECODED = 16
"""Epochs (by number) below the newest that a worker keeps decoded."""
REPLY_GRACE_S = 30.0
"""How long past its deadline a worker process may take to report an epoch's rendezvous."""


def latest(a: float, b: float) -> float:
    """The later of two finish times, NaN if either is (a member that failed fails its lane)."""
    return max(a, b) if a == a and b == b else float("nan")


def backend_calls(store: Any, rank: int, world: int, backend: str) -> None:
    """The store calls a backend makes to connect a member of ``world`` (on ``store``, the group's prefix)."""
    pg = dist.PrefixStore("pg", store)
    if backend == "nccl":
        if rank == 0:
            pg.set("nccl_unique_id", "u" * 128)
        else:
            pg.get("nccl_unique_id")
        return
    pg.set(f"0/{rank}", "a" * 64)  # the member's address (Gloo: its pair listener)
    # Gloo's full mesh (``connectFullMesh``) reads every other member's address: its own it never waits for.
    peers = [r for r in range(world) if r != rank] if backend == "mesh" else sorted(
        {(rank - 1) % world, (rank + 1) % world} - {rank})
    # (``lazy``: Gloo's pairs connecting on first use, which the lanes do not do: ``ftar.group.configure_with_store``)
    for r in peers:
        pg.wait([f"0/{r}"])
        pg.get(f"0/{r}")


class _Lanes:
    """The emulated ranks of ``lanes`` of some replicas of a job, in this process: each replica's start their
    rendezvous as soon as it holds a new epoch (``on_epoch``, from the replica's session), as a real replica's lanes
    do."""

    def __init__(self, lanes: list[int], job_id: str, key: str, lighthouse: StoreTarget, stores: Any,
                 backend: str = "mesh", timeout_s: float = 60.0, workers: int = 256) -> None:
        self.lanes = lanes
        self.job_id = job_id
        self.key = key
        self.backend = backend
        self.lighthouse = lighthouse
        self.timeout = timedelta(seconds=timeout_s)
        self.errors: list[str] = []
        self._hosting: dict[str, tuple[RemoteHosting, list[EpochView | None]]] = {}
        self._runs: dict[int, list[tuple[int, concurrent.futures.Future[float]]]] = {}
        self._met: dict[int, list[tuple[LaneHosting, EpochView, int, Any, Any]]] = {}
        """epoch -> (hosting, epoch, lane, the lane's store, its base) of each member that connected, until it
        learned its lane's candidates."""
        self._stores, self._stores_lock = stores, threading.Lock()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lane-emu")

    def _replica(self, rid: str) -> tuple[RemoteHosting, list[EpochView | None]]:
        with self._lock:
            entry = self._hosting.get(rid)
            if entry is None:
                held: list[EpochView | None] = [None]
                entry = self._hosting[rid] = (RemoteHosting(rid, self.job_id, self.key, lambda: held[0],
                                                             self._stores, self._stores_lock), held)
            return entry

    def on_epoch(self, rid: str, epoch: EpochView) -> None:
        """Replica ``rid`` holds ``epoch``: its emulated ranks start the epoch's rendezvous now (none for an epoch
        that keeps its data plane, or one without the replica)."""
        hosting, held = self._replica(rid)
        held[0] = epoch
        hosting.held(epoch)
        if epoch.data_plane != epoch.number or epoch.member(rid) is None:
            return
        runs = [(lane, self._pool.submit(self._member, hosting, epoch, rid, lane)) for lane in self.lanes]
        with self._lock:
            self._runs.setdefault(epoch.number, []).extend(runs)

    def kill(self, rid: str) -> None:
        """The replica died: its lane stores go with it (a restart is a new replica with nothing kept)."""
        with self._lock:
            entry = self._hosting.pop(rid, None)
        if entry is not None:
            entry[0].close()

    def _member(self, hosting: LaneHosting, epoch: EpochView, rid: str, lane: int) -> float:
        """One rank's rendezvous of ``epoch``; when it finished (``time.time()``), or NaN if it failed."""
        try:
            # ``base`` kept with the store until the member learned: the prefix stores hold the C++ side only.
            base, store, _ = meet(epoch, rid, lane, self.timeout, lambda: False, self.lighthouse, hosting)
            backend_calls(store, epoch.replica_ids.index(rid), len(epoch.replica_ids), self.backend)
            done = time.time()
            with self._lock:
                self._met.setdefault(epoch.number, []).append((hosting, epoch, lane, store, base))
            return done
        except Exception as e:  # counted and reported: a bench run with errors is not a result
            self._error(f"{rid} lane {lane} epoch {epoch.number}", e)
            return float("nan")

    def _error(self, where: str, e: Exception) -> None:
        with self._lock:
            self.errors.append(f"{where}: {type(e).__name__}: {e}"[:300])

    def learn(self, number: int) -> None:
        """Every member that connected in epoch ``number`` learns its lane's candidates, as a real one does after
        the group's first collective (the caller knows every member of the lane connected)."""
        with self._lock:
            met = self._met.pop(number, [])

        def one(hosting: LaneHosting, epoch: EpochView, lane: int, store: Any, base: Any) -> None:
            try:
                hosting.learn(epoch, lane, store)
            except Exception as e:  # counted and reported, as a rendezvous's
                self._error(f"{hosting.replica_id} lane {lane} epoch {epoch.number} learning", e)
            del base

        concurrent.futures.wait([self._pool.submit(one, *m) for m in met])

    def finished(self, number: int, members: int, timeout_s: float) -> dict[int, float]:
        """Wait until every lane of epoch ``number`` has ``members`` ranks (of this process's replicas) done; lane ->
        when its last one finished (NaN: one failed, or not all started within ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                runs = list(self._runs.get(number, []))
            if len(runs) >= members * len(self.lanes) or time.monotonic() > deadline:
                break
            time.sleep(0.01)  # polling for the last replicas' epochs, with a deadline
        concurrent.futures.wait([f for _, f in runs], timeout=max(0.0, deadline - time.monotonic()))
        done: dict[int, float] = {lane: 0.0 for lane in self.lanes}
        counts: dict[int, int] = {lane: 0 for lane in self.lanes}
        for lane, f in runs:
            t = f.result() if f.done() else float("nan")
            done[lane] = latest(done[lane], t)
            counts[lane] += 1
        return {lane: (t if counts[lane] >= members else float("nan")) for lane, t in done.items()}

    def close(self) -> None:
        """End the emulated ranks and their stores, and the store process."""
        self._pool.shutdown(wait=True)
        with self._lock:
            entries, self._hosting = list(self._hosting.values()), {}
        for hosting, _ in entries:
            hosting.close()
        with self._stores_lock:
            self._stores.send(("close",))


def _worker(conn: Any, stores: Any, lanes: list[int], job_id: str, key: str, address: str, token: str,
            backend: str, timeout_s: float, workers: int) -> None:
    """A worker process: its replicas' emulated ranks (``_Lanes``), driven by the parent's commands over ``conn``,
    their lane stores in its store process (over ``stores``)."""
    lock = threading.Lock()
    emu = _Lanes(lanes, job_id, key, StoreTarget(address, ClientSecurity(token=token), job_id), stores, backend,
                 timeout_s, workers)

    def reply(msg: tuple[Any, ...]) -> None:
        with lock:
            conn.send(msg)

    def finished(number: int, members: int, wait_s: float) -> None:
        reply(("finished", number, emu.finished(number, members, wait_s), list(emu.errors)))

    def learn(number: int) -> None:
        emu.learn(number)
        reply(("learned", number, list(emu.errors)))

    epochs: dict[int, EpochView] = {}
    while True:
        msg = conn.recv()
        if msg[0] == "epochs":
            for rid, number, encoded in msg[1]:
                # An epoch is the job's, the same for every replica that holds it: decoded once per process.
                if encoded is not None:
                    epochs[number] = epoch_from_pb(pb.Epoch.FromString(encoded))
                    for old in [n for n in epochs if n < number - KEEP_DECODED]:
                        del epochs[old]
                emu.on_epoch(rid, epochs[number])
        elif msg[0] == "kill":
            emu.kill(msg[1])
        elif msg[0] == "finished":
            threading.Thread(target=finished, args=msg[1:], daemon=True).start()
        elif msg[0] == "learn":
            threading.Thread(target=learn, args=msg[1:], daemon=True).start()
        else:
            emu.close()
            reply(("closed",))
            return


class LaneEmulator:
    """The emulated ranks of ``lanes`` in every replica of a job, spread over ``processes`` worker processes by
    replica, each worker's replicas' lane stores in a store process beside it (so that the stores and their clients
    do not share one interpreter: in a deployment every rank is a process of its own). Each replica's ranks start
    their rendezvous as soon as its session holds a new epoch (``on_epoch``)."""

    def __init__(self, lanes: list[int], job_id: str, key: str, lighthouse: StoreTarget, backend: str = "mesh",
                 timeout_s: float = 60.0, workers: int = 256, processes: int = 2) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, not {backend!r}")
        self.lanes = lanes
        self.errors: list[str] = []
        self._owner: dict[str, int] = {}
        self._members: dict[tuple[int, int], set[str]] = {}
        """(epoch, worker) -> the replicas whose ranks that worker started for the epoch."""
        ctx = multiprocessing.get_context("spawn")
        self._conns = []
        self._procs = []
        self._encoding = threading.Lock()
        self._outbox: queue.Queue[tuple[int, tuple[Any, ...]] | None] = queue.Queue()
        """What goes to the workers, written by one thread (``_sender``): the epochs of many replicas that come at
        once go to a worker in one message, which its one reading thread (beside hundreds of emulated ranks wanting
        the interpreter) takes in once, not once per replica."""
        self._encoded: dict[int, bytes] = {}
        self._sent: set[tuple[int, int]] = set()
        """(worker, epoch number) sent whole: each worker decodes an epoch once (a real replica decodes its own, as
        every other does, at the same time: not N times one after another)."""
        self._store_procs = []
        for _ in range(processes):
            served, stores = ctx.Pipe()
            store_proc = ctx.Process(target=serve_stores, args=(served, job_id, key), daemon=True)
            store_proc.start()
            self._store_procs.append(store_proc)
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, stores, lanes, job_id, key, lighthouse.address,
                                                     lighthouse.security.token or "", backend, timeout_s, workers),
                               daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        self._sender_thread = threading.Thread(target=self._sender, name="lane-emu-sender", daemon=True)
        self._sender_thread.start()

    def _send(self, w: int, msg: tuple[Any, ...]) -> None:
        self._outbox.put((w, msg))

    def _sender(self) -> None:
        """Send the outbox's messages in order, consecutive epochs for one worker as one ``epochs`` message."""
        while True:
            first = self._outbox.get()
            batch = [first]
            while True:
                try:
                    batch.append(self._outbox.get_nowait())
                except queue.Empty:
                    break
            out: list[list[tuple[Any, ...]]] = [[] for _ in self._conns]
            for item in batch:
                if item is None:
                    continue
                w, msg = item
                if msg[0] == "epoch" and out[w] and out[w][-1][0] == "epochs":
                    out[w][-1][1].append(msg[1:])
                else:
                    out[w].append(("epochs", [msg[1:]]) if msg[0] == "epoch" else msg)
            for w, msgs in enumerate(out):
                for msg in msgs:
                    self._conns[w].send(msg)
            if None in batch:
                return

    def _of(self, rid: str) -> int:
        return self._owner.setdefault(rid, len(self._owner) % len(self._conns))

    def on_epoch(self, rid: str, epoch: EpochView) -> None:
        """Replica ``rid`` holds ``epoch``: its emulated ranks start the epoch's rendezvous now (in its worker)."""
        w = self._of(rid)
        if epoch.data_plane == epoch.number and epoch.member(rid) is not None:
            self._members.setdefault((epoch.number, w), set()).add(rid)
        with self._encoding:
            encoded = self._encoded.get(epoch.number)
            if encoded is None:
                encoded = self._encoded[epoch.number] = view_to_pb(epoch).SerializeToString()
                for old in [n for n in self._encoded if n < epoch.number - KEEP_DECODED]:
                    del self._encoded[old]
            first = (w, epoch.number) not in self._sent
            if first:  # the worker forgets the epochs this far below it as it decodes it: sent whole again if needed
                self._sent = {(x, n) for x, n in self._sent if x != w or n >= epoch.number - KEEP_DECODED}
                self._sent.add((w, epoch.number))
        self._send(w, ("epoch", rid, epoch.number, encoded if first else None))

    def kill(self, rid: str) -> None:
        """The replica died: its lane stores go with it."""
        self._send(self._of(rid), ("kill", rid))

    def finished(self, number: int, members: int, timeout_s: float) -> dict[int, float]:
        """lane -> when the last of epoch ``number``'s ``members`` ranks finished its rendezvous (NaN: one failed or
        never started within ``timeout_s``). Then, every member having connected, they learn their lanes'
        candidates (as after a first collective), before this returns."""
        deadline = time.monotonic() + timeout_s
        while sum(len(self._members.get((number, w), ())) for w in range(len(self._conns))) < members:
            if time.monotonic() > deadline:
                return {lane: float("nan") for lane in self.lanes}
            time.sleep(0.01)  # the last replicas' epochs are on their way (polling with a deadline)
        asked = [w for w in range(len(self._conns)) if self._members.get((number, w))]
        for w in asked:
            self._send(w, ("finished", number, len(self._members[(number, w)]),
                                 max(0.0, deadline - time.monotonic())))
        done = {lane: 0.0 for lane in self.lanes}
        for w in asked:
            msg = self._reply(w, "finished", number, deadline)
            self.errors = sorted(set(self.errors) | set(msg[3]))
            for lane, t in msg[2].items():
                done[lane] = latest(done[lane], t)
        for w in asked:
            self._send(w, ("learn", number))
        for w in asked:
            self.errors = sorted(set(self.errors) | set(self._reply(w, "learned", number, time.monotonic())[2]))
        return done

    def _reply(self, w: int, kind: str, number: int, deadline: float) -> tuple[Any, ...]:
        """Worker ``w``'s ``kind`` reply for epoch ``number``; it answers by ``deadline`` (and a grace), or it is stuck
        or dead."""
        while True:
            if not self._conns[w].poll(max(0.0, deadline - time.monotonic()) + REPLY_GRACE_S):
                raise TimeoutError(f"lane worker {w} did not report epoch {number} ({kind})")
            msg: tuple[Any, ...] = self._conns[w].recv()
            if msg[0] == kind and msg[1] == number:
                return msg

    def close(self) -> None:
        for w in range(len(self._conns)):
            self._send(w, ("close",))
        self._outbox.put(None)
        self._sender_thread.join(30)
        for conn, proc in zip(self._conns, self._procs, strict=True):
            if conn.poll(30):
                conn.recv()
            proc.join(10)
        for store_proc in self._store_procs:
            store_proc.join(10)
