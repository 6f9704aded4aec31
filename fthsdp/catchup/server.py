"""The catch-up server of one rank of a healthy replica.

A joiner asks for the snapshot of step S (the state after committing step S-1). The training thread tells the
server where it is: ``at_commit(S)`` at the commit boundary before step S, ``before_update(S)`` just before step
S's optimizer update, the first change to that state (its forward and backward leave the parameter and
optimizer-state shards alone). In between, the state of step S stands still, so a request for S that arrives
before ``before_update(S)`` (or for a later step) is registered, answered ``QUEUED``, and a snapshot thread copies
the state (the rank's parameter and optimizer-state shards, data cursors, trainer state and RNG as of the boundary)
while training goes on; ``before_update(S)`` waits for a copy in progress. The training thread copies nothing.
Connection threads stream from the copy and drop it once no joiner needs it. A joiner that waits for ``QUEUED``
before it lets step S commit (its zeros of step S) is sure to be served step S.

Every session starts with a challenge (``fthsdp.catchup.auth``): the joiner proves the job token without sending
it, and is admitted only as a joining member, with its incarnation, of this replica's current epoch; a request
refused is refused before it is registered, so no state is ever copied for it. The server proves the token back
in its manifest. Until it has answered, a connection holds one of ``max_pending`` handshake places for at most
``handshake_s``, never one of the ``max_sessions`` sessions; when every place is taken, the connection that has
held one longest is closed to make room: a joiner answers its challenge within milliseconds, so idle connections,
however many and from wherever, cannot keep it out. Without a token the server listens on loopback only, and says
so. A session that answers the challenge with ``TRACE`` instead reads the rank's step timeline (``fthsdp trace``:
``fthsdp.catchup.timeline``), proven the same way.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ftar.devices import start_thread
from fthsdp.catchup import auth, timeline, wire
from fthsdp.catchup.timeline import Reader
from fthsdp.catchup.wire import CatchupError, Entry, Kind, Manifest, ProtocolError
from lighthouse.epoch_view import EpochView

log = logging.getLogger("fthsdp.catchup")

HANDSHAKE_S = 5.0
"""How long a connection has to answer the challenge."""


class InsecureServing(CatchupError):
    """A catch-up server without a job token was asked to listen on a non-loopback address."""


SnapshotFn = Callable[[], Sequence[tuple[str, torch.Tensor]]]
"""Returns (name, CPU contiguous tensor) for everything a joiner needs, copied: the state of step S. Called on a
snapshot thread between ``at_commit(S)`` and ``before_update(S)``, while the training thread leaves that state
alone."""
SealFn = Callable[[list[tuple[str, torch.Tensor]]], Sequence[tuple[str, torch.Tensor]]]
"""Finishes a snapshot's copies (adds their digest): runs after ``before_update`` stopped waiting for them."""


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU contiguous tensor, without a copy."""
    return t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")


@dataclass
class _Snapshot:
    step: int
    entries: tuple[Entry, ...]
    views: list[memoryview]
    tensors: list[torch.Tensor]
    refs: int


class CatchupServer:
    """Serves snapshots of this rank's state to joiners. Thread-safe; ``close`` when done. ``epoch`` returns
    this replica's current epoch (who may fetch: ``auth.admit``)."""

    def __init__(self, *, job: str, replica_id: str, rank: int, world_size: int, snapshot: SnapshotFn,
                 epoch: Callable[[], EpochView | None], seal: SealFn = list, device: torch.device | None = None,
                 host: str = "127.0.0.1", port: int = 0, token: str = "", wait_s: float = 60.0,
                 idle_s: float = 60.0, max_sessions: int = 16, max_pending: int = 256,
                 handshake_s: float = HANDSHAKE_S, chunk_bytes: int = wire.DEFAULT_CHUNK,
                 on_chunk_sent: Callable[[int, int], None] | None = None,
                 corrupt: Callable[[int, int, bytearray], bool] | None = None) -> None:
        self.job, self.replica_id, self.rank, self.world_size = job, replica_id, rank, world_size
        self._take, self._seal = snapshot, seal
        self._epoch = epoch
        if not auth.serving_allowed(host, token):
            raise InsecureServing(f"the catch-up server has no job token (FTHSDP_TOKEN_FILE), so it serves on "
                                  f"loopback only, not on {host!r}")
        if not token:
            log.warning("catchup replica=%s rank=%d: NO JOB TOKEN: serving snapshots unauthenticated, on loopback "
                        "(%s) only", replica_id, rank, host)
        self._token = token
        self.wait_s, self.idle_s, self.max_sessions, self.chunk_bytes = wait_s, idle_s, max_sessions, chunk_bytes
        self.max_pending, self.handshake_s = max_pending, handshake_s
        self._on_chunk_sent = on_chunk_sent
        self._corrupt = corrupt
        self._lock = threading.Condition()
        self._step = -1
        self._active = False
        self._updating = False
        """The training thread passed ``before_update(self._step)``: the state of that step is gone."""
        self._copying: int | None = None
        """The step the snapshot thread is to copy or copies (its update waits)."""
        self._copy_running = False
        self._sealing: int | None = None
        """The step whose copies a snapshot thread is sealing (``seal``; its update need not wait)."""
        self._failed = -1
        """The last step whose copy failed."""
        self._requested: dict[int, int] = {}
        self._snapshots: dict[int, _Snapshot] = {}
        self._sessions = 0
        self._handshaking: dict[socket.socket, None] = {}
        """Connections that have not answered the challenge yet, oldest first."""
        self.evicted = 0
        """Handshaking connections closed to make room for newer ones."""
        self._closed = False
        self.directory: list[str] = []
        """Every rank's address (index = rank), for redirecting a joiner that asked the wrong rank."""
        self.incarnation = ""
        self.timeline: Reader | None = None
        """This incarnation's step timeline, for a timeline read (``fthsdp trace``); None: none to give."""
        self._sock = socket.create_server((host, port))
        self._sock.settimeout(0.2)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._threads: list[threading.Thread] = []
        self._acceptor = start_thread(self._accept_loop, name=f"catchup-accept-r{rank}", device=None)  # CPU only
        # One thread copies every snapshot (on the state's device), started here: it shares the constructing
        # thread's CPU affinity, not the training thread's, whatever thread asks for a copy.
        self._copier = start_thread(self._copy_loop, name=f"catchup-snapshot-r{rank}", device=device)

    # --- the training thread ------------------------------------------------------------------------------------

    def at_commit(self, step: int, active: bool) -> None:
        """Called at every commit boundary with the step about to be trained: its state stands still until
        ``before_update(step)``. Starts the snapshot of ``step`` if a joiner asked for it. Cheap otherwise."""
        with self._lock:
            self._step, self._active, self._updating = step, active, False
            late = [s for s in self._requested if s < step and s != self._sealing]  # a sealed copy serves its own
            for s in late:  # cannot happen with joiners that wait for QUEUED; fail them rather than hang them
                del self._requested[s]
            if self._requested.get(step) and active:
                self._start_copy(step)
            if late:
                self._lock.notify_all()

    def before_update(self, step: int) -> None:
        """Called on the training thread just before step ``step``'s optimizer update changes the state: waits for
        a snapshot of it in progress (copies run while the step's forward and backward do). Later requests for
        ``step`` are too late."""
        with self._lock:
            while self._copying == step:
                self._lock.wait(1.0)
            self._updating = True
            # Requests for this step are in the copy being sealed, if any; else (cannot happen: a request for the
            # current step starts its copy) they are too late.
            if self._sealing != step and self._requested.pop(step, 0):
                self._lock.notify_all()

    def _start_copy(self, step: int) -> None:
        """(Lock held.) Have the snapshot thread copy the state of ``step`` (the current one), once."""
        if self._copying is None and self._sealing != step and step not in self._snapshots:
            self._copying = step
            self._lock.notify_all()

    def _copy_loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and (self._copying is None or self._copy_running):
                    self._lock.wait()
                if self._closed:
                    return
                step, self._copy_running = self._copying, True
            assert step is not None
            self._copy(step)

    def _copy(self, step: int) -> None:
        t0 = time.perf_counter()
        pairs: Sequence[tuple[str, torch.Tensor]] | None = None
        try:
            copies: list[tuple[str, torch.Tensor]] | None = list(self._take())
        except Exception:  # a bug in the snapshot function: the joiners are refused, training goes on
            log.exception("catchup replica=%s rank=%d step=%d: the snapshot failed", self.replica_id, self.rank,
                          step)
            copies = None
        with self._lock:  # the copies are done: the update may run (the seal below does not read the state)
            self._copying, self._copy_running, self._sealing = None, False, step
            self._lock.notify_all()
        t_copy = time.perf_counter() - t0
        try:
            pairs = self._seal(copies) if copies is not None else None
        except Exception:
            log.exception("catchup replica=%s rank=%d step=%d: sealing the snapshot failed", self.replica_id,
                          self.rank, step)
        with self._lock:
            self._sealing = None
            waiting = self._requested.pop(step, 0)
            if pairs is None:
                self._failed = step
            elif waiting:
                tensors = [t for _, t in pairs]
                entries = tuple(Entry(n, str(t.dtype), tuple(t.shape), t.numel() * t.element_size()) for n, t in pairs)
                self._snapshots[step] = _Snapshot(step, entries, [tensor_bytes(t) for t in tensors], tensors, waiting)
                log.info("catchup replica=%s rank=%d step=%d snapshot taken for %d joiner session(s): %d tensors, "
                         "%.1f MB copied in %.3fs, sealed in %.3fs", self.replica_id, self.rank, step, waiting,
                         len(pairs), sum(e.nbytes for e in entries) / 1e6, t_copy, time.perf_counter() - t0 - t_copy)
            self._lock.notify_all()

    def _release(self, step: int) -> None:
        """(Lock held.) A session that registered for ``step`` is gone: its count is in ``_requested`` until the
        snapshot is taken, then in the snapshot's references."""
        if self._requested.get(step):
            self._requested[step] -= 1
            if not self._requested[step]:
                del self._requested[step]
        elif step in self._snapshots:
            self._snapshots[step].refs -= 1
            if self._snapshots[step].refs <= 0:
                del self._snapshots[step]
                self._lock.notify_all()

    def close(self, drain_s: float = 10.0) -> None:
        """Stop accepting; let transfers in progress finish for up to ``drain_s``; then drop every snapshot."""
        deadline = time.monotonic() + drain_s
        with self._lock:
            self._closed = True
            if not self._copy_running:
                self._copying = None  # a copy asked for and not begun never will be: nothing waits for it
            self._requested.clear()
            self._lock.notify_all()
            while self._snapshots and time.monotonic() < deadline:
                self._lock.wait(0.1)
            self._snapshots.clear()
        self._acceptor.join(2.0)
        self._copier.join(30.0)  # a copy in progress ends (it reads the state, nothing blocks it)
        self._sock.close()

    # --- connections ----------------------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            victim = None
            with self._lock:
                if len(self._handshaking) >= self.max_pending:  # the oldest has had longest to answer: it goes
                    victim = next(iter(self._handshaking))
                    del self._handshaking[victim]
                    self.evicted += 1
                self._handshaking[conn] = None
            if victim is not None:
                if self.evicted in (1, 10, 100) or self.evicted % 1000 == 0:
                    log.warning("catchup replica=%s rank=%d: %d handshake places full: closed the oldest (%d so far)",
                                self.replica_id, self.rank, self.max_pending, self.evicted)
                with contextlib.suppress(OSError):
                    victim.shutdown(socket.SHUT_RDWR)  # its thread's read ends, and the thread with it
            start_thread(self._session, args=(conn,), name=f"catchup-serve-r{self.rank}", device=None)

    @property
    def _pending(self) -> int:
        """Connections in their handshake now."""
        with self._lock:
            return len(self._handshaking)

    def _refuse(self, conn: socket.socket, code: str, message: str) -> None:
        log.warning("catchup replica=%s rank=%d step=%d refused a request: %s: %s", self.replica_id, self.rank,
                    self._step, code, message)
        wire.send_error(conn, code, message)

    def _session(self, conn: socket.socket) -> None:
        step = None
        admitted = False  # holds a session place (else, a handshake place)
        try:
            conn.settimeout(self.handshake_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
            nonce = auth.new_nonce()
            wire.send_control(conn, Kind.CHALLENGE, {"nonce": nonce})
            kind, obj = wire.recv_control(conn, (Kind.HELLO, Kind.TRACE))
            if kind == Kind.TRACE:  # a timeline read (fthsdp trace), not a joiner
                request = wire.parse_trace(obj)
                if (why := timeline.refusal(request, nonce, self._token, self.job, self.timeline)) is not None:
                    return self._refuse(conn, *why)
                assert self.timeline is not None
                return timeline.answer(conn, request.since, self.timeline, {
                    "replica": self.replica_id, "incarnation": self.incarnation, "rank": self.rank,
                    "directory": self.directory})
            hello = wire.parse_hello(obj)
            problem = self._check(hello, nonce)
            if problem is not None:
                self._refuse(conn, *problem)
                return
            with self._lock:  # from a handshake place to a session's, if one is free (and still held: not evicted)
                held = conn in self._handshaking
                admitted = held and self._sessions < self.max_sessions
                if admitted:
                    del self._handshaking[conn]
                    self._sessions += 1
            if not admitted:
                if held:
                    self._refuse(conn, "busy", f"{self.max_sessions} catch-up sessions already running")
                return
            conn.settimeout(self.idle_s)
            if hello.rank != self.rank:
                wire.send_control(conn, Kind.REDIRECT, {"addr": self.directory[hello.rank]})
                return
            snap = self._wait_for(conn, hello)
            if snap is None:
                return
            step = snap.step
            proof = auth.source_proof(self._token, hello, self.replica_id)
            wire.send_control(conn, Kind.MANIFEST, wire.manifest_doc(Manifest(snap.step, snap.entries,
                                                                               self.chunk_bytes, proof)))
            while True:
                kind, obj = wire.recv_control(conn, (Kind.GET, Kind.BYE))
                if kind == Kind.BYE:
                    return
                self._stream(conn, snap, wire.parse_ranges(obj, snap.entries))
        except ProtocolError as e:
            self._refuse(conn, "bad_request", str(e))
        except CatchupError as e:  # the joiner went away: nothing lost here
            log.info("catchup replica=%s rank=%d step=%d joiner session ended: %s", self.replica_id, self.rank,
                     self._step, e)
        finally:
            wire.linger_close(conn)
            with self._lock:
                if admitted:
                    self._sessions -= 1
                else:
                    self._handshaking.pop(conn, None)
                if step is not None and step in self._snapshots:
                    self._snapshots[step].refs -= 1
                    if self._snapshots[step].refs <= 0:
                        del self._snapshots[step]
                        self._lock.notify_all()

    def _check(self, hello: wire.Hello, nonce: str) -> tuple[str, str] | None:
        """The refusal of ``hello``, if any: before anything is registered, so nothing is copied for it."""
        if not auth.verify(self._token, nonce, hello):
            return "unauthenticated", "wrong or missing proof of the job token"
        if (refusal := auth.admit(self._epoch(), self.job, hello)) is not None:
            return refusal
        if hello.rank >= self.world_size:
            return "bad_request", f"rank {hello.rank} is outside this replica's {self.world_size} ranks"
        if hello.rank != self.rank and len(self.directory) != self.world_size:
            return "not_active", "this replica's directory of ranks is not known yet"
        return None

    def _wait_for(self, conn: socket.socket, hello: wire.Hello) -> _Snapshot | None:
        """Register the request for step S, answer ``QUEUED``, wait (bounded) for the snapshot thread to take it."""
        s = hello.step
        deadline = time.monotonic() + self.wait_s
        with self._lock:
            if self._closed:
                self._refuse(conn, "closed", "this replica is shutting down")
                return None
            if not self._active:
                self._refuse(conn, "not_active", "this replica is not active (it is joining itself)")
                return None
            if s in self._snapshots:
                self._snapshots[s].refs += 1
                return self._snapshots[s]
            if s < self._step or (s == self._step and self._updating):
                self._refuse(conn, "too_late", f"step {s} is past: this replica is at step {self._step}"
                             f"{' (updating)' if self._updating else ''}")
                return None
            self._requested[s] = self._requested.get(s, 0) + 1
            if s == self._step:
                self._start_copy(s)
        try:
            wire.send_control(conn, Kind.QUEUED, {"step": s})
        except BaseException:
            with self._lock:
                self._release(s)
            raise
        with self._lock:
            while s not in self._snapshots:
                left = deadline - time.monotonic()
                gone = s not in self._requested  # its count was dropped (taken, failed or too late): none comes
                if self._closed or left <= 0 or gone:
                    if not gone:
                        self._release(s)
                    code = ("closed" if self._closed else "timeout" if left <= 0 else
                            "unavailable" if self._failed == s else "too_late")
                    self._refuse(conn, code, f"no snapshot of step {s} (this replica is at step {self._step})")
                    return None
                self._lock.wait(min(left, 1.0))
            return self._snapshots[s]

    def _stream(self, conn: socket.socket, snap: _Snapshot, ranges: list[tuple[int, int, int]]) -> None:
        for entry, offset, length in ranges:
            view = snap.views[entry]
            end = offset + length
            while offset < end:
                n = min(self.chunk_bytes, end - offset)
                chunk = view[offset:offset + n]
                if self._corrupt is not None:
                    bad = bytearray(chunk)
                    crc = wire.checksum(chunk)
                    if self._corrupt(entry, offset, bad):
                        wire.send_data(conn, entry, offset, memoryview(bad), crc)
                    else:
                        wire.send_data(conn, entry, offset, chunk, crc)
                else:
                    wire.send_data(conn, entry, offset, chunk)
                if self._on_chunk_sent is not None:
                    self._on_chunk_sent(snap.step, n)
                offset += n
        wire.send_control(conn, Kind.END, {})
