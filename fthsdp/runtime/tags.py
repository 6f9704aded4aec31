"""The wire tag of a bucket of a step: what FTAR's exchanges are named by (``fthsdp.runtime.buckets``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BucketTag:
    """Bucket ``bucket`` of step ``step``. On the wire (FTAR's tag) it is ``step * buckets + bucket``: the same on
    every replica, increasing in exchange order. Encoded and decoded only here."""

    step: int
    bucket: int

    def encode(self, buckets: int) -> int:
        if not 0 <= self.bucket < buckets:
            raise ValueError(f"bucket {self.bucket} of {buckets}")
        return self.step * buckets + self.bucket

    @classmethod
    def decode(cls, tag: int, buckets: int) -> BucketTag:
        step, bucket = divmod(tag, buckets)
        return cls(step, bucket)

    def __str__(self) -> str:
        return f"step {self.step} bucket {self.bucket}"

    @classmethod
    def label(cls, tag: int, buckets: int) -> str:
        """How a log line names wire tag ``tag`` of a ``BucketExchange`` (``buckets``: its ``width``): by the training
        step and bucket it stands for (index 0 of a step is the post exchange of the step before)."""
        t = cls.decode(tag, buckets)
        return f"step={t.step - 1} post" if t.bucket == 0 else f"step={t.step} bucket={t.bucket - 1}"
