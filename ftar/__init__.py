"""FTAR: fault-tolerant all-reduce across replicas (see docs/design.md §5).

``LaneEngine`` (``ftar.engine``) is the API; its decisions are pure functions in ``ftar.rules``, its data plane
is ``ftar.group`` (torchft process groups and the rendezvous store) and ``ftar.packing``; what it needs from the
lighthouse is the ``Membership`` protocol (``ftar.membership``).
"""

from ftar.engine import LaneEngine
from ftar.errors import (
    AttemptsExhausted,
    EngineClosed,
    Excluded,
    FTARError,
    InputsConsumed,
    Interrupted,
    Misaligned,
    NoEpoch,
)
from ftar.exchange import ExchangeResult, FTARConfig, Handle
from ftar.membership import EpochFeed, LighthouseMembership, Membership

__all__ = [
    "AttemptsExhausted",
    "EngineClosed",
    "EpochFeed",
    "Excluded",
    "ExchangeResult",
    "FTARConfig",
    "FTARError",
    "Handle",
    "InputsConsumed",
    "Interrupted",
    "LaneEngine",
    "LighthouseMembership",
    "Membership",
    "Misaligned",
    "NoEpoch",
]
