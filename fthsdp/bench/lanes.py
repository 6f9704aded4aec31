"""Emulated lanes (issue 39): the data plane's rendezvous of many ranks after a membership change, with the real
protocol and no tensors, driven by the real lighthouse's epochs.

An emulated rank of lane L in replica R does what a real one does in ``ftar.group.EpochGroup.open``, with the same
code: it finds where the lane meets (``ftar.group.meet``: the lane host's store, whose address it kept, or looked up
on the lighthouse, or the lighthouse's own store), announces its lane store if it is one of the lane's candidates,
arrives, then makes the store calls of the backend's own connect, which are the only part emulated: ``mesh``, a Gloo
lane's (every pair connects as the group is built: a member sets its address and waits for and reads every
member's); ``nccl`` (rank 0 sets the unique id and the others read it); ``lazy`` (Gloo's pairs connecting on first
use: each member reads its two ring neighbours'; the lanes do not do it, ``docs/design.md`` §5). Then it learns its
lane's candidates (``LaneHosting.learn``; the runtime does after the group's first collective, the emulator once the
candidates announced themselves). The stores are the real ones (the lighthouse's service, each replica's
``LaneStoreServer``), with the real keys and authentication (the job token on the lighthouse, request MACs under the
catch-up key on the lane stores).

Each emulated replica is one ``LaneHosting`` (one lane store for all its emulated lanes: a real replica has one per
rank, so this is the harder case for the host), in one of a few worker processes (``processes``: the stores and
their clients do not all share one interpreter). Every emulated rank is a thread: the store clients are the
runtime's own, which block.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ftar.group import meet
from ftar.lane_hosting import HOST_KEY, LaneHosting
from ftar.store import StoreTarget
from lighthouse.epoch_view import EpochView
from lighthouse.proto_codec import epoch_from_pb, view_to_pb
from lighthouse.security import ClientSecurity
from lighthouse.v1 import lighthouse_pb2 as pb

BACKENDS = ("mesh", "nccl", "lazy")
"""How the backend's own connect uses the lane's store (see the module)."""
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
    peers = range(world) if backend == "mesh" else sorted({(rank - 1) % world, (rank + 1) % world} - {rank})
    # (``lazy``: Gloo's pairs connecting on first use, which the lanes do not do: ``ftar.group.configure_with_store``)
    for r in peers:
        pg.wait([f"0/{r}"])
        pg.get(f"0/{r}")


class _Lanes:
    """The emulated ranks of ``lanes`` of some replicas of a job, in this process: each replica's start their
    rendezvous as soon as it holds a new epoch (``on_epoch``, from the replica's session), as a real replica's lanes
    do."""

    def __init__(self, lanes: list[int], job_id: str, key: str, lighthouse: StoreTarget, backend: str = "mesh",
                 timeout_s: float = 60.0, workers: int = 256) -> None:
        self.lanes = lanes
        self.job_id = job_id
        self.key = key
        self.backend = backend
        self.lighthouse = lighthouse
        self.timeout = timedelta(seconds=timeout_s)
        self.errors: list[str] = []
        self._hosting: dict[str, tuple[LaneHosting, list[EpochView | None]]] = {}
        self._runs: dict[int, list[tuple[int, concurrent.futures.Future[float]]]] = {}
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="lane-emu")

    def _replica(self, rid: str) -> tuple[LaneHosting, list[EpochView | None]]:
        with self._lock:
            entry = self._hosting.get(rid)
            if entry is None:
                held: list[EpochView | None] = [None]
                entry = self._hosting[rid] = (LaneHosting(rid, self.job_id, self.key, "127.0.0.1",
                                                          lambda: held[0]), held)
            return entry

    def on_epoch(self, rid: str, epoch: EpochView) -> None:
        """Replica ``rid`` holds ``epoch``: its emulated ranks start the epoch's rendezvous now (none for an epoch
        that keeps its data plane, or one without the replica)."""
        hosting, held = self._replica(rid)
        held[0] = epoch
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
            # ``base`` held to the end: the prefix stores hold the C++ side, not the Python object.
            base, store, _ = meet(epoch, rid, lane, self.timeout, lambda: False, self.lighthouse, hosting)
            backend_calls(store, epoch.replica_ids.index(rid), len(epoch.replica_ids), self.backend)
            # Learned after the first collective, when every candidate is sure to have announced itself: here, once
            # they did (every member of the epoch is alive in the emulator).
            others = [f"{HOST_KEY}/{c}" for c in hosting.unknown(epoch, lane)]
            if others:
                store.wait(others)
            hosting.learn(epoch, lane, store)
            del base
            return time.time()
        except Exception as e:  # counted and reported: a bench run with errors is not a result
            with self._lock:
                self.errors.append(f"{rid} lane {lane} epoch {epoch.number}: {type(e).__name__}: {e}"[:300])
            return float("nan")

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
        self._pool.shutdown(wait=True)
        with self._lock:
            entries, self._hosting = list(self._hosting.values()), {}
        for hosting, _ in entries:
            hosting.close()


def _worker(conn: Any, lanes: list[int], job_id: str, key: str, address: str, token: str, backend: str,
            timeout_s: float, workers: int) -> None:
    """A worker process: its replicas' emulated ranks (``_Lanes``), driven by the parent's commands over ``conn``."""
    lock = threading.Lock()
    emu = _Lanes(lanes, job_id, key, StoreTarget(address, ClientSecurity(token=token), job_id), backend, timeout_s,
                 workers)

    def reply(msg: tuple[Any, ...]) -> None:
        with lock:
            conn.send(msg)

    def finished(number: int, members: int, wait_s: float) -> None:
        reply(("finished", number, emu.finished(number, members, wait_s), list(emu.errors)))

    while True:
        msg = conn.recv()
        if msg[0] == "epoch":
            emu.on_epoch(msg[1], epoch_from_pb(pb.Epoch.FromString(msg[2])))
        elif msg[0] == "kill":
            emu.kill(msg[1])
        elif msg[0] == "finished":
            threading.Thread(target=finished, args=msg[1:], daemon=True).start()
        else:
            emu.close()
            reply(("closed",))
            return


class LaneEmulator:
    """The emulated ranks of ``lanes`` in every replica of a job, spread over ``processes`` worker processes by
    replica (so that the lane stores and their clients do not share one interpreter: in a deployment every rank is
    a process of its own). Each replica's ranks start their rendezvous as soon as its session holds a new epoch
    (``on_epoch``)."""

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
        for _ in range(processes):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(child, lanes, job_id, key, lighthouse.address,
                                                     lighthouse.security.token or "", backend, timeout_s, workers),
                               daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)

    def _of(self, rid: str) -> int:
        return self._owner.setdefault(rid, len(self._owner) % len(self._conns))

    def on_epoch(self, rid: str, epoch: EpochView) -> None:
        """Replica ``rid`` holds ``epoch``: its emulated ranks start the epoch's rendezvous now (in its worker)."""
        w = self._of(rid)
        if epoch.data_plane == epoch.number and epoch.member(rid) is not None:
            self._members.setdefault((epoch.number, w), set()).add(rid)
        self._conns[w].send(("epoch", rid, view_to_pb(epoch).SerializeToString()))

    def kill(self, rid: str) -> None:
        """The replica died: its lane stores go with it."""
        self._conns[self._of(rid)].send(("kill", rid))

    def finished(self, number: int, members: int, timeout_s: float) -> dict[int, float]:
        """lane -> when the last of epoch ``number``'s ``members`` ranks finished its rendezvous (NaN: one failed or
        never started within ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while sum(len(self._members.get((number, w), ())) for w in range(len(self._conns))) < members:
            if time.monotonic() > deadline:
                return {lane: float("nan") for lane in self.lanes}
            time.sleep(0.01)  # the last replicas' epochs are on their way (polling with a deadline)
        asked = [w for w in range(len(self._conns)) if self._members.get((number, w))]
        for w in asked:
            self._conns[w].send(("finished", number, len(self._members[(number, w)]),
                                 max(0.0, deadline - time.monotonic())))
        done = {lane: 0.0 for lane in self.lanes}
        for w in asked:
            while True:
                # The worker answers by the deadline it was given; a worker that does not is stuck or dead.
                if not self._conns[w].poll(max(0.0, deadline - time.monotonic()) + REPLY_GRACE_S):
                    raise TimeoutError(f"lane worker {w} did not report epoch {number}")
                msg = self._conns[w].recv()
                if msg[0] == "finished" and msg[1] == number:
                    break
            self.errors = sorted(set(self.errors) | set(msg[3]))
            for lane, t in msg[2].items():
                done[lane] = latest(done[lane], t)
        return done

    def close(self) -> None:
        for conn in self._conns:
            conn.send(("close",))
        for conn, proc in zip(self._conns, self._procs, strict=True):
            if conn.poll(30):
                conn.recv()
            proc.join(10)
