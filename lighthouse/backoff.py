"""Jittered exponential backoff for retries against the lighthouse."""

from __future__ import annotations

import asyncio
import contextlib
import random


class Backoff:
    """Jittered exponential backoff, 50 ms to 2 s."""

    def __init__(self, first: float = 0.05, cap: float = 2.0) -> None:
        self.first, self.cap, self.current = first, cap, first

    def reset(self) -> None:
        self.current = self.first

    def next(self) -> float:
        delay = self.current * random.uniform(0.5, 1.0)
        self.current = min(self.cap, self.current * 2)
        return delay

    async def wait(self, stop: asyncio.Event) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), self.next())
