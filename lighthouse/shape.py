"""What every replica of a job shares, checked at registration (``lighthouse.membership``): its number of ranks
(``shard_count``: one FTAR lane per rank) and its parallel layout inside (the mesh's dimensions, ``dp2xtp2``:
rank r of each replica exchanges its shards with rank r of the others; docs/design.md §3b)."""

from __future__ import annotations

from lighthouse.model import State


def check(state: State, shard_count: int, layout: str) -> str | None:
    """Why a registration of ``shard_count`` ranks laid out as ``layout`` is refused (None: it is not). The job's
    shard count is its live members'; its layout the first one named (``State.layout``); '' names none."""
    job_shards = next(iter(state.members.values())).shard_count if state.members else None
    if job_shards is not None and shard_count != job_shards:
        return f"shard_count {shard_count} differs from the job's {job_shards}"
    if layout and state.layout and layout != state.layout:
        return (f"replica layout {layout} differs from the job's {state.layout}: every replica must build the same "
                "device mesh (rank r of each exchanges its shards with rank r of the others)")
    return None
