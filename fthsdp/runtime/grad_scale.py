"""What the trainer did to a step's averaged gradients between ``backward()`` and ``step()``, so that the replicas
that did not run that code (a joiner replaying kept steps, a spare, a joiner's zero step) apply the same change.

In the trainer's own loop (``fthsdp.runtime.loop``) every active replica sees the step's averaged gradients as
``.grad`` (a copy: the bytes the runtime keeps to serve a lagging partner are never the trainer's) and may change
them in place, e.g. ``torch.nn.utils.clip_grad_norm_``. Every active replica runs the same code on the same bytes,
so they all change them the same way. A zero contributor commits the same step without running that code, so
the change must be one it can reproduce bitwise: a **uniform scaling** by one float32 factor (what
``clip_grad_norm_`` and ``grad.mul_(c)`` do, elementwise multiplication being correctly rounded), found here from
the gradients before and after (``scale_of``), exchanged with the others after the trainer's code ran (the
step's "post" exchange: ``pack``/``unpack``) and re-applied by ``apply``. Anything else (clipping by value,
per-parameter scales, added noise) is refused with ``UnreplayableGradients``.

Pure functions over tensors: no collectives, no clocks."""

from __future__ import annotations

import struct
from collections.abc import Sequence

import torch

BYTES = 4
WORDS = 2 * BYTES
"""Values per packed factor: its float32 bytes, each plus one, then their squares. An average of identical
contributions gives them back exactly (integers far below float32's 2^24); an average of different ones breaks
``square(mean) == mean(square)``, which ``unpack`` checks."""


class UnreplayableGradients(RuntimeError):
    """The trainer changed the averaged gradients in a way other replicas cannot reproduce bitwise."""


def _candidates(c: float) -> list[torch.Tensor]:
    """float32 values near ``c``: the rounding of ``before * c`` may be matched by a neighbour of the quotient."""
    mid = torch.tensor(c, dtype=torch.float32)
    out, up, down = [mid], mid, mid
    for _ in range(3):
        up = torch.nextafter(up, torch.tensor(float("inf")))
        down = torch.nextafter(down, torch.tensor(float("-inf")))
        out += [up, down]
    return out


def scale_of(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor]) -> float:
    """The float32 factor ``c`` with ``after[i] == before[i] * c`` bitwise for every tensor (1.0 when untouched).
    Raises ``UnreplayableGradients`` when there is none (the change is not a uniform scaling)."""
    if len(before) != len(after):
        raise ValueError(f"{len(before)} tensors before, {len(after)} after")
    if all(torch.equal(b, a) for b, a in zip(before, after, strict=True)):
        return 1.0
    # A candidate from the largest element (the quotient is closest to the factor there), then checked everywhere.
    best, quotient = 0.0, None
    for b, a in zip(before, after, strict=True):
        if b.numel():
            k = int(b.detach().abs().reshape(-1).argmax())
            mag = abs(float(b.reshape(-1)[k]))
            if mag > best:
                best, quotient = mag, float(a.reshape(-1)[k]) / float(b.reshape(-1)[k])
    if quotient is not None:
        for c in _candidates(quotient):
            if all(torch.equal(b * c, a) for b, a in zip(before, after, strict=True)):
                return float(c)
    if best == 0.0 and all(torch.equal(a, torch.zeros_like(a)) for a in after):
        return 1.0  # all zeros before and after: any factor
    raise UnreplayableGradients(
        "the gradients were changed between backward() and step() in a way a catching-up or spare replica cannot "
        "replay: only a uniform scaling by one factor (torch.nn.utils.clip_grad_norm_, grad.mul_(c)) can be. "
        "Clipping by value, per-parameter changes or noise would make the replicas' states differ.")


def check_agreed(step: int, factor: float, agreed: float) -> None:
    """``UnreplayableGradients`` unless the contributors scaled step ``step``'s gradients by this replica's
    ``factor`` (``agreed``: what their post exchange says)."""
    if agreed != factor:
        raise UnreplayableGradients(
            f"step {step}: this replica scaled the averaged gradients by {factor}, the others by {agreed}: every "
            "replica's trainer must run the same code on them")


def apply(grads: Sequence[torch.Tensor], factor: float) -> None:
    """Scale ``grads`` in place by ``factor`` as the trainer's code did (a no-op for 1.0)."""
    if factor != 1.0 and grads:
        c = torch.tensor(factor, dtype=torch.float32)
        with torch.no_grad():
            for g in grads:
                g.mul_(c.to(g.device))


def pack(factor: float | None) -> list[float]:
    """A contributor's words for ``factor`` (None: a zero contributor's, all 0). Every contributor sends the same
    words, so their average is exact."""
    if factor is None:
        return [0.0] * WORDS
    words = [b + 1 for b in struct.pack(">f", factor)]
    return [float(w) for w in words] + [float(w * w) for w in words]


def unpack(averaged: Sequence[float]) -> float:
    """The factor from the averaged words of ``pack`` (1.0 when nobody contributed one). Raises
    ``UnreplayableGradients`` when the contributors sent different factors."""
    if len(averaged) != WORDS:
        raise ValueError(f"{len(averaged)} values, not {WORDS}")
    if all(v == 0 for v in averaged):
        return 1.0
    words, squares = [round(v) for v in averaged[:BYTES]], [round(v) for v in averaged[BYTES:]]
    exact = all(abs(v - w) < 1e-3 for v, w in zip(averaged, words + squares, strict=True))
    if not exact or any(not 1 <= w <= 256 or w * w != q for w, q in zip(words, squares, strict=True)):
        raise UnreplayableGradients(f"the replicas changed this step's gradients differently (averaged factor words "
                                    f"{list(averaged)}): their trainers must run the same code on the same bytes")
    return float(struct.unpack(">f", bytes(w - 1 for w in words))[0])
