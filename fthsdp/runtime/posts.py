"""The post exchange of a step in the trainer's own loop (``BucketExchange.launch_post``), read behind the step."""

from __future__ import annotations

from ftar import FTARError
from fthsdp.runtime import grad_scale
from fthsdp.runtime.buckets import BucketExchange


def agree(buckets: BucketExchange, wait_s: float) -> None:
    """Read the post exchange this lane sent last as a contributor and did not wait for (``Steps.finish``; the
    lane's exchanges after it are done, so it is too): raise ``UnreplayableGradients`` when the others scaled that
    step's gradients by another factor. One lost with its epoch is not read: the vote's redo sent it again, and that
    one is read next time."""
    if (sent := buckets.unchecked) is None:
        return
    buckets.unchecked = None
    step, factor, handle = sent
    try:
        agreed, _ = buckets.post_of(handle.wait(wait_s))
    except FTARError:
        return
    grad_scale.check_agreed(step, factor, agreed)
