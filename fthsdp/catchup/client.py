"""The joiner's side: fetch one rank's snapshot of step S from several sources at once.

Each source (rank s of a healthy replica) is asked for the snapshot of the same step S; every one that has it
answers with the same manifest (healthy replicas are bitwise identical at a commit). The bytes are cut into
chunks on one shared work queue, so faster sources take more of it. A chunk whose CRC-32C does not match is
fetched again; a source that breaks gives its unfinished chunks back to the queue for the others.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ftar.devices import start_thread
from fthsdp.catchup import auth, wire
from fthsdp.catchup.server import tensor_bytes
from fthsdp.catchup.wire import CatchupError, FetchFailed, Hello, Kind, Manifest, ProtocolError, Refused

log = logging.getLogger("fthsdp.catchup")

MAX_CORRUPT_PER_SOURCE = 3
"""A source that sends this many bad chunks is dropped (something is wrong with it or the path to it)."""


@dataclass(frozen=True)
class Source:
    replica_id: str
    address: str
    """``host:port`` of the source replica's rank 0 (redirected to the rank asked for)."""


@dataclass
class FetchResult:
    step: int
    tensors: dict[str, torch.Tensor]
    bytes: int
    transfer_s: float
    """From the first manifest received to the last byte."""
    wait_s: float
    """From the start until the first manifest (the sources waiting for the commit of step S-1)."""
    sources: dict[str, int] = field(default_factory=dict)
    """Bytes received per source replica."""
    source_failures: list[str] = field(default_factory=list)
    refetched_chunks: int = 0


class Fetch:
    """One fetch of a rank's snapshot; ``start()`` runs it on background threads, ``result()`` waits for it."""

    def __init__(self, sources: Sequence[Source], *, job: str, replica_id: str, rank: int, step: int,
                 incarnation: str = "", token: str = "",
                 expected: Sequence[tuple[str, str, tuple[int, ...]]] | None = None, max_bytes: int | None = None,
                 connect_timeout_s: float = 10.0, wait_s: float = 60.0, io_timeout_s: float = 30.0,
                 batch_bytes: int = 8 << 20, on_chunk: Callable[[int, int], None] | None = None) -> None:
        self.sources = list(sources)
        self.hello = Hello(job, replica_id, incarnation, rank, step)
        self._token = token
        self.expected = [(n, d, tuple(s)) for n, d, s in expected] if expected is not None else None
        """The (name, dtype, shape) of the snapshot's ``param/`` entries, as this rank's own: a manifest whose
        parameters differ is refused before anything is allocated."""
        self.max_bytes = max_bytes
        """The most a snapshot may hold: a bigger manifest is refused before anything is allocated."""
        self.connect_timeout_s, self.wait_s, self.io_timeout_s = connect_timeout_s, wait_s, io_timeout_s
        self.batch_bytes = batch_bytes
        self._on_chunk = on_chunk
        self._lock = threading.Condition()
        self._manifest: Manifest | None = None
        self._buffers: list[torch.Tensor] = []
        self._views: list[memoryview] = []
        self._work: queue.Queue[list[tuple[int, int, int]]] = queue.Queue()
        self._remaining = -1
        self._alive = len(self.sources)
        self._registered = 0
        """Sources that registered the request (``QUEUED``) or already had the snapshot."""
        self._error: str = "" if self.sources else "no healthy replica to fetch from"
        self._t0 = time.perf_counter()
        self._t_manifest = 0.0
        self._t_done = 0.0
        self._per_source: dict[str, int] = {}
        self._failures: list[str] = []
        self._refetched = 0
        self._cancelled = False
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []

    def start(self) -> Fetch:
        """Start one fetching thread per source (sockets and CPU buffers only: no device)."""
        self._threads = [start_thread(self._run_source, args=(s,), device=None,
                                      name=f"catchup-fetch-r{self.hello.rank}-{s.replica_id}") for s in self.sources]
        return self

    def done(self) -> bool:
        with self._lock:
            return self._ended()

    def _ended(self) -> bool:
        """(Lock held.) Every byte is in, every source is gone, or the fetch was cancelled."""
        return self._remaining == 0 or self._alive == 0 or self._cancelled

    def wait_registered(self, timeout: float) -> int:
        """Wait until every source registered the request or failed (or ``timeout`` passed); returns how many
        registered. A source that registered step S serves it: it cannot pass S's update while this replica
        holds S's commit back, so a joiner waits for this before it sends its share of step S."""
        with self._lock:
            self._lock.wait_for(lambda: self._registered + len(self.sources) - self._alive >= len(self.sources)
                                or self._cancelled, timeout)
            return self._registered

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for the fetch to end (done, failed or cancelled); returns ``done()``."""
        with self._lock:
            return self._lock.wait_for(self._ended, timeout)

    def cancel(self) -> None:
        """Abandon the fetch: connections are cut (the sources drop their snapshots), ``result`` raises."""
        with self._lock:
            self._cancelled = True
            socks = list(self._socks)
            self._lock.notify_all()
        for s in socks:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def _cut_others(self, mine: socket.socket | None) -> None:
        """Everything is in: end the other sessions now (a source still waiting for its snapshot, or idle), so
        that no thread lingers and every source drops its snapshot."""
        with self._lock:
            others = [s for s in self._socks if s is not mine]
        for s in others:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def result(self, timeout: float | None = None) -> FetchResult:
        """Wait for the fetch; raises ``FetchFailed`` if no source could complete it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not self._ended():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise FetchFailed(f"fetch of step {self.hello.step} did not finish in {timeout}s")
                self._lock.wait(left if left is not None else 1.0)
            if self._cancelled:
                raise FetchFailed(f"fetch of step {self.hello.step} cancelled")
            if self._remaining != 0:
                raise FetchFailed(f"no source could supply the snapshot of step {self.hello.step}: "
                                  f"{'; '.join(self._failures) or self._error or 'cancelled'}")
            assert self._manifest is not None
        for t in self._threads:
            t.join(2.0)
        m = self._manifest
        return FetchResult(m.step, {e.name: b for e, b in zip(m.entries, self._buffers, strict=True)},
                           sum(e.nbytes for e in m.entries), self._t_done - self._t_manifest,
                           self._t_manifest - self._t0, dict(self._per_source), list(self._failures),
                           self._refetched)

    # --- per source ---------------------------------------------------------------------------------------------

    def _connect(self, src: Source) -> socket.socket:
        address = src.address
        for _ in range(2):  # at most one redirect (rank 0 -> rank s)
            sock = socket.create_connection(wire.split_address(address), timeout=self.connect_timeout_s)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
            with self._lock:
                self._socks.append(sock)
                if self._cancelled:
                    raise FetchFailed("cancelled")
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.wait_s + self.io_timeout_s)
            _, challenge = wire.recv_control(sock, (Kind.CHALLENGE,))
            nonce = wire.parse_challenge(challenge)
            hello = dataclasses.replace(self.hello, proof=auth.proof(self._token, nonce, self.hello),
                                        nonce=auth.new_nonce())
            wire.send_control(sock, Kind.HELLO, wire.hello_doc(hello))
            kind, obj = wire.recv_control(sock, (Kind.REDIRECT, Kind.QUEUED, Kind.MANIFEST))
            if kind != Kind.REDIRECT:
                with self._lock:
                    self._registered += 1
                    self._lock.notify_all()
            if kind == Kind.QUEUED:
                if (queued := wire.parse_queued(obj)) != self.hello.step:
                    raise ProtocolError(f"asked for step {self.hello.step}, queued for step {queued}")
                kind, obj = wire.recv_control(sock, (Kind.MANIFEST,))
            if kind == Kind.MANIFEST:
                sock.settimeout(self.io_timeout_s)
                manifest = wire.parse_manifest(obj)
                if not auth.verify_source(self._token, hello, src.replica_id, manifest.proof):
                    raise ProtocolError(f"{src.replica_id} at {address} did not prove the job token: not a replica of "
                                        "this job, refused")
                self._accept_manifest(manifest)
                return sock
            sock.close()
            address = wire.str_field(obj, "addr", 300)
        raise ProtocolError("redirected more than once")

    def _accept_manifest(self, m: Manifest) -> None:
        if m.step != self.hello.step:
            raise ProtocolError(f"asked for step {self.hello.step}, got a snapshot of step {m.step}")
        with self._lock:
            if self._manifest is not None:
                if m.entries != self._manifest.entries:
                    raise ProtocolError("this source's snapshot layout differs from the other sources'")
                return
            total = sum(e.nbytes for e in m.entries)
            if self.max_bytes is not None and total > self.max_bytes:
                raise wire.CatchupError(f"the source's snapshot holds {total} bytes, more than the {self.max_bytes} "
                                        "this rank's state can (same model, shard count and optimizer needed)")
            if self.expected is not None:
                got = [(e.name, e.dtype, e.shape) for e in m.entries if e.name.startswith("param/")]
                if got != self.expected:
                    diff = next((f"{g} vs {w}" for g, w in zip(got, self.expected, strict=False) if g != w),
                                f"{len(got)} vs {len(self.expected)} tensors")
                    raise wire.CatchupError(f"snapshot layout differs from this replica's (source vs mine: {diff}): "
                                            "same model, shard count and optimizer needed")
            for e in m.entries:
                dtype = getattr(torch, e.dtype.removeprefix("torch."), None)
                if not isinstance(dtype, torch.dtype):
                    raise ProtocolError(f"unknown dtype {e.dtype!r}")
                t = torch.empty(e.shape, dtype=dtype)
                if t.numel() * t.element_size() != e.nbytes:
                    raise ProtocolError(f"entry {e.name}: {e.nbytes} bytes does not match {e.dtype}{list(e.shape)}")
                self._buffers.append(t)
                self._views.append(tensor_bytes(t))
            self._manifest = m
            self._t_manifest = time.perf_counter()
            batch: list[tuple[int, int, int]] = []
            size = 0
            # Small enough batches that every source gets several: a snapshot of a few MB still spreads.
            per_batch = max(1, min(self.batch_bytes, total // (4 * len(self.sources))))
            for i, e in enumerate(m.entries):
                for off in range(0, e.nbytes, m.chunk_bytes):
                    n = min(m.chunk_bytes, e.nbytes - off)
                    batch.append((i, off, n))
                    size += n
                    if size >= per_batch:
                        self._work.put(batch)
                        batch, size = [], 0
            if batch:
                self._work.put(batch)
            self._remaining = sum(e.nbytes for e in m.entries)
            if self._remaining == 0:
                self._t_done = self._t_manifest
            self._lock.notify_all()

    def _run_source(self, src: Source) -> None:
        sock = None
        pending: dict[tuple[int, int], int] = {}
        received: queue.Queue[tuple[int, int, int, int] | None] = queue.Queue()
        dropped: list[str] = []
        verifier = start_thread(self._verify, args=(src, received, dropped), device=None,
                                name=f"catchup-verify-r{self.hello.rank}-{src.replica_id}")
        try:
            sock = self._connect(src)
            while True:
                with self._lock:
                    if self._remaining == 0 or self._cancelled:
                        break
                if dropped:
                    raise CatchupError(dropped[0])
                try:
                    mine = self._work.get(timeout=0.05)
                except queue.Empty:
                    continue
                pending = {(e, off): n for e, off, n in mine}
                wire.send_control(sock, Kind.GET, {"ranges": [list(r) for r in mine]})
                while True:
                    kind, length = wire.recv_header(sock)
                    if kind == Kind.END:
                        wire.recv_exact(sock, length)
                        break
                    if kind != Kind.DATA:
                        wire.recv_exact(sock, min(length, wire.MAX_CONTROL))
                        raise ProtocolError(f"unexpected {kind.name} during a transfer")
                    e, off, n, crc = wire.CHUNK.unpack(wire.recv_exact(sock, wire.CHUNK.size))
                    if pending.get((e, off)) != n or length != wire.CHUNK.size + n:
                        raise ProtocolError(f"chunk ({e}, {off}, {n}) was not asked for")
                    wire.recv_into_exact(sock, self._views[e][off:off + n])
                    del pending[(e, off)]
                    # Checked on another thread (the checksum runs off the GIL) while the next chunk arrives.
                    received.put((e, off, n, crc))
            wire.send_control(sock, Kind.BYE, {})
        except (CatchupError, OSError, ValueError) as e:
            if pending:  # unfinished chunks go back for the other sources
                self._work.put([(e_, off, n) for (e_, off), n in pending.items()])
            with self._lock:
                if self._remaining == 0:
                    return  # cut off after the fetch completed: not a failure
            why = f"{src.replica_id}: {e}"
            log.warning("catchup replica=%s rank=%d step=%d source %s", self.hello.replica, self.hello.rank,
                        self.hello.step, why)
            with self._lock:
                self._failures.append(why)
                if isinstance(e, Refused):
                    self._error = why
        finally:
            received.put(None)
            verifier.join(30.0)  # the chunks received so far are checked (and counted) before this source ends
            if sock is not None:
                sock.close()
            with self._lock:
                self._alive -= 1
                self._lock.notify_all()

    def _verify(self, src: Source, received: queue.Queue[tuple[int, int, int, int] | None],
                dropped: list[str]) -> None:
        """Check each received chunk's CRC-32C: count a good one, send a bad one back to the work queue (a
        source that sends ``MAX_CORRUPT_PER_SOURCE`` bad ones is dropped)."""
        corrupt = 0
        while (item := received.get()) is not None:
            e, off, n, crc = item
            if wire.checksum(self._views[e][off:off + n]) != crc:
                corrupt += 1
                with self._lock:
                    self._refetched += 1
                log.warning("catchup replica=%s rank=%d step=%d chunk (%d, %d) from %s failed its checksum; "
                            "fetching it again", self.hello.replica, self.hello.rank, self.hello.step, e, off,
                            src.replica_id)
                self._work.put([(e, off, n)])
                if corrupt >= MAX_CORRUPT_PER_SOURCE and not dropped:
                    dropped.append(f"{corrupt} corrupted chunks")
                continue
            with self._lock:
                self._remaining -= n
                self._per_source[src.replica_id] = self._per_source.get(src.replica_id, 0) + n
                done = self._remaining == 0
                if done:
                    self._t_done = time.perf_counter()
                    self._lock.notify_all()
            if done:
                self._cut_others(None)
            if self._on_chunk is not None:
                self._on_chunk(self.hello.step, n)
