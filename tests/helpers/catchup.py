"""What the catch-up tests share: a source replica's training thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from fthsdp.catchup.server import CatchupServer


@contextmanager
def training(srv: CatchupServer, first_step: int) -> Iterator[None]:
    """While inside, ``srv``'s replica commits a step every 10 ms from ``first_step`` on (snapshots are of the
    state between ``at_commit`` and ``before_update``), as an active member."""
    stop = threading.Event()

    def train() -> None:
        step = first_step
        while not stop.is_set():
            srv.at_commit(step, active=True)
            stop.wait(0.01)  # a training step's worth of time (pacing, not synchronisation)
            srv.before_update(step)
            step += 1

    trainer = threading.Thread(target=train, daemon=True)
    trainer.start()
    try:
        yield
    finally:
        stop.set()
        trainer.join(5)
