"""torchft's lighthouse under N replica groups (``fthsdp bench lighthouse --vs torchft``): the peer of our growth
curve, on the same machine in the same invocation.

torchft 0.2.0's lighthouse (its ``torchft_lighthouse`` binary, in its own process) and N emulated torchft replica
groups in this process, a thread each, and a ``LighthouseClient`` (its own connection) each up to ``MAX_CLIENTS``. A
torchft group learns its membership only by calling ``quorum`` (its Manager does at every step), and a group is
dropped only when its heartbeats stop for the heartbeat timeout: there is no push and no evidence of a death. So:

- *bootstrap*: every group calls ``quorum`` -> the last one has a quorum of N;
- *death -> all*: one group stops (no more heartbeats, no more quorum calls) and every other one calls ``quorum``
  again, as at its next step -> the last one has the quorum without it. Of that, ``after_timeout_s`` is what
  follows the end of the victim's heartbeat timeout, counted from its last heartbeat (forming and answering N - 1
  quorum calls); the rest is the timeout.

Heartbeats go out at the same budget as ours (``fthsdp.bench.lighthouse.auto_interval``: 1,000 per second at any
N, from a few threads), and the timeout is five intervals. torchft's Manager heartbeats every 100 ms by default:
at 5,000 groups that would be 50,000 per second.
"""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

from fthsdp.bench.baselines.torchft_run import _lighthouse_binary
from fthsdp.launch.procutil import stop_process
from fthsdp.testing.ports import free_port, wait_port

log = logging.getLogger("fthsdp.bench")

QUORUM_TICK_MS = 100
MAX_CLIENTS = 2000
MAX_REPLICAS = 1000
"""Sizes above this are not run: the emulation itself, one thread per group blocked in torchft's client, saturates
2 cores beyond it (measured: 1-minute load 800 at 2,000 groups, its heartbeat threads starved and the bootstrap
160 s; 2,000 and 5.9 GB at 5,000, no quorum in 12 minutes). Those figures are the emulator's, not torchft's."""
HEARTBEAT_THREADS = 4
TIMEOUT_INTERVALS = 5


class _Members:
    """N emulated torchft groups: their clients, their quorum threads (one round at a time), their heartbeats."""

    def __init__(self, addr: str, n: int, interval: float, call_timeout_s: float) -> None:
        from torchft.coordination import LighthouseClient

        self.n, self.interval, self.call_timeout = n, interval, timedelta(seconds=call_timeout_s)
        # One client (its own connection) per group, up to MAX_CLIENTS: beyond, groups share them (this process's
        # open-file limit; torchft's clients hold several descriptors each).
        self.clients = [LighthouseClient(addr, timedelta(seconds=60)) for _ in range(min(n, MAX_CLIENTS))]
        self.last_beat = [0.0] * n
        self.alive = [True] * n
        self.got: list[dict[int, tuple[float, int]]] = [{} for _ in range(n)]
        """Per group: round -> (time it got its quorum, the quorum's size)."""
        self.errors: list[str] = []
        self.beaten = [False] * n
        """Whether each group has heartbeated once (torchft waits for every heartbeating group to join a quorum)."""
        self._round = 0
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._member, args=(i,), daemon=True) for i in range(n)]
        self._beaters = [threading.Thread(target=self._beat, args=(k,), daemon=True) for k in range(HEARTBEAT_THREADS)]

    def start(self) -> None:
        for t in [*self._threads, *self._beaters]:
            t.start()

    def _client(self, i: int) -> Any:
        return self.clients[i % len(self.clients)]

    def next_round(self) -> int:
        """Every live group calls ``quorum`` once more (as at its next step); returns the round's number."""
        with self._cond:
            self._round += 1
            self._cond.notify_all()
            return self._round

    def _member(self, i: int) -> None:
        done = 0

        def due() -> bool:
            return self._stop.is_set() or (self._round > done and self.alive[i])

        while not self._stop.is_set():
            with self._cond:
                self._cond.wait_for(due)
                if self._stop.is_set():
                    return
                r = self._round
            try:
                q = self._client(i).quorum(replica_id=f"tft-{i:05d}", timeout=self.call_timeout, address=f"a{i}",
                                           store_address=f"s{i}", step=r, world_size=8)
                self.got[i][r] = (time.time(), len(q.participants))
            except Exception as e:  # noqa: BLE001 - torchft raises plain exceptions; counted and reported
                self.errors.append(f"tft-{i:05d} round {r}: {e}")
            done = r

    def _beat(self, k: int) -> None:
        mine = list(range(k, self.n, HEARTBEAT_THREADS))
        period = self.interval / max(1, len(mine))
        next_at = time.monotonic()
        while not self._stop.is_set():
            for i in mine:
                if self._stop.is_set():
                    return
                if self.alive[i]:
                    try:
                        self._client(i).heartbeat(f"tft-{i:05d}", timedelta(seconds=5))
                        self.beaten[i], self.last_beat[i] = True, time.time()
                    except Exception as e:  # noqa: BLE001 - counted and reported
                        self.errors.append(f"heartbeat tft-{i:05d}: {e}")
                next_at += period
                self._stop.wait(max(0.0, next_at - time.monotonic()))  # the heartbeat pace

    def wait_beaten(self, timeout: float) -> bool:
        """Wait until every group has heartbeated once."""
        end = time.monotonic() + timeout
        while not all(self.beaten):
            if time.monotonic() > end:
                return False
            self._stop.wait(0.05)  # polling the heartbeat threads' records, with a deadline
        return True

    def wait_round(self, r: int, size: int, timeout: float) -> float | None:
        """When the last live group got round ``r``'s quorum of ``size`` (None at the deadline)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            live = [self.got[i].get(r) for i in range(self.n) if self.alive[i]]
            if all(g is not None and g[1] == size for g in live):
                return max(g[0] for g in live if g is not None)
            self._stop.wait(0.05)  # polling the threads' records, with a deadline
        return None

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()


def bench_torchft_lighthouse(n: int, interval: float, deaths: int = 1) -> dict[str, Any]:
    """One size: bootstrap and ``deaths`` deaths of torchft's lighthouse with ``n`` emulated groups (above
    ``MAX_REPLICAS``: a row that says it was not run, and why)."""
    timeout_s = TIMEOUT_INTERVALS * interval
    row: dict[str, Any] = {"replicas": n, "heartbeat_interval_s": interval, "heartbeat_timeout_s": timeout_s}
    if n > MAX_REPLICAS:
        row["skipped"] = (f"not run above {MAX_REPLICAS:,} groups: a thread per emulated torchft group saturates this "
                          "machine (see MAX_REPLICAS)")
        return row
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="fthsdp-bench-tftlh-") as tmp, \
            open(pathlib.Path(tmp) / "lighthouse.log", "wb") as lh_log:
        # A quorum needs n - deaths groups, and waits for every group that heartbeats (up to the join timeout).
        proc = subprocess.Popen([_lighthouse_binary(), "--bind", f"127.0.0.1:{port}", "--min_replicas",
                                 str(n - deaths),
                                 "--join_timeout_ms", str(int(1000 * timeout_s)),
                                 "--heartbeat_timeout_ms", str(int(1000 * timeout_s)),
                                 "--quorum_tick_ms", str(QUORUM_TICK_MS)],
                                stdout=lh_log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "RUST_LOG": "warn"})
        members: _Members | None = None
        try:
            wait_port(port, 30, proc)
            call_timeout = 120 + n / 20
            members = _Members(f"http://127.0.0.1:{port}", n, interval, call_timeout)
            members.start()
            if not members.wait_beaten(30 + 2 * interval):
                row["error"] = f"not every group could heartbeat ({len(members.errors)} call errors)"
                return row
            t0 = time.time()
            r = members.next_round()
            last = members.wait_round(r, n, call_timeout)
            if last is None:
                row["error"] = f"no quorum of {n} within {call_timeout:.0f} s ({len(members.errors)} call errors)"
                return row
            row["bootstrap_s"] = round(last - t0, 3)
            totals, after = [], []
            for d in range(deaths):
                victim = max(i for i in range(n) if members.alive[i])
                members.alive[victim] = False  # its heartbeats and its quorum calls stop: a SIGKILL
                killed = time.time()
                r = members.next_round()
                last = members.wait_round(r, n - d - 1, timeout_s + call_timeout)
                if last is None:
                    row["error"] = f"death {d}: no quorum of {n - d - 1} within the timeout"
                    break
                totals.append(last - killed)
                after.append(last - members.last_beat[victim] - timeout_s)  # its silence counts from its last beat
                log.info("bench lighthouse torchft replicas=%d death=%d all=%.3fs after timeout=%.3fs", n, d,
                         totals[-1], after[-1])
            row["death_to_all_s"] = round(max(totals), 3) if totals else None
            row["after_timeout_s"] = round(max(after), 3) if after else None
            row["call_errors"] = len(members.errors)
            if members.errors:
                row["first_error"] = members.errors[0][:300]
            row["loadavg_1min"] = round(os.getloadavg()[0], 2)
            return row
        finally:
            if members is not None:
                members.close()
            stop_process(proc)
