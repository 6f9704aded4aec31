"""Degraded-mode learning rate: fewer replicas contributing means a smaller effective batch, so the step is
scaled down by ``f(N_contributing / N_total)`` (docs/design.md §7). Pure functions."""

from __future__ import annotations

import math

from fthsdp.runtime.config import LR_RULES


def lr_factor(rule: str, contributing: int, total: int) -> float:
    """``sqrt`` (default: the square-root scaling rule for a batch shrunk by that ratio), ``linear``, or ``none``.

    More contributors than configured (a spare) is capped at 1."""
    if rule not in LR_RULES:
        raise ValueError(f"learning-rate rule must be one of {LR_RULES}, got {rule!r}")
    if total < 1 or contributing < 0:
        raise ValueError(f"need total >= 1 and contributing >= 0, got {contributing}/{total}")
    ratio = min(contributing / total, 1.0)
    if rule == "none":
        return 1.0
    return math.sqrt(ratio) if rule == "sqrt" else ratio
