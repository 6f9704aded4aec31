"""The progress rows the example trainer (and the baselines' trainers) append, one JSON object per line, to
``replica<i>.progress.jsonl``, as one typed row: the launcher, the invariants, the benchmarks and the tests read
them through ``read_progress``.

Events (``event``): ``start`` (an incarnation registered: ``joining``, ``resumed_from``, ``step``), ``step`` (one
committed step: ``step``, ``loss`` — None on a joiner's zero-gradient step —, ``epoch``, ``contributors``,
``joined``, ``contributed`` (only when false), ``attempts``, ``step_s``, ``exchange_s``, ``batches`` as [slot, batch
index] pairs, ``lr_factor``, ``catchup``), ``active`` (the runtime's ``training()``/``init()``: the incarnation's
first commit as an active replica, ``step``), ``final`` (``step`` and ``param_hash``; the plain and restart
baselines write ``local_param_hash``), ``terminated`` (stopped by SIGTERM: ``step``, ``checkpoint``),
``job_finished`` (back after the job completed at ``step``, with no final checkpoint to take: no final state),
``fatal`` (``error``), ``unhealthy`` (``error``: the self-check failed; the group is not started again). The
whole-job restart baseline adds ``restored``, ``kill`` and ``checkpoint``. Every row has ``t`` (``time.time()``)
and, from rank 0 of a replica, ``replica``, ``incarnation`` and ``mode``. Keys this row does not name are kept in
``extra``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ProgressRow:
    """One progress line."""

    event: str
    t: float
    replica: int | None = None
    incarnation: str | int | None = None
    """fthsdp: the incarnation id; the baselines: torchrun's restart count + 1."""
    mode: str | None = None
    step: int | None = None
    loss: float | None = None
    epoch: int | None = None
    contributors: int | None = None
    joined: bool = False
    contributed: bool = True
    """fthsdp: False on a step this replica sent zeros in (the joined step and the one after it)."""
    attempts: int | None = None
    step_s: float | None = None
    exchange_s: float | None = None
    batches: list[list[int]] | None = None
    slot: int | None = None
    """fthsdp's example trainer: the data slot this replica trained in the step (its own, or one handed to it);
    None where it trained none (zeros) or the trainer does not say."""
    carried: list[int] | None = None
    """fthsdp with orphan slots carried: the slots besides its own of which this replica trained micro-batches."""
    samples: list[list[float]] | None = None
    """fthsdp's example trainer in its own loop: the micro-batches it trained in the step, each ``[slot, cursor,
    micro-batch, rank 0's loss]`` (the sample sequence a run with failures is compared by)."""
    lr_factor: float | None = None
    catchup: dict[str, Any] | None = None
    joining: bool = False
    resumed_from: int | None = None
    param_hash: str | None = None
    local_param_hash: str | None = None
    checkpoint: str | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Keys of the line this row does not name (baselines' ``load_s``, ``save_s``, ...)."""

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> ProgressRow:
        known = {k: v for k, v in obj.items() if k in _FIELDS}
        extra = {k: v for k, v in obj.items() if k not in _FIELDS}
        return cls(**known, extra=extra)

    def to_json(self) -> dict[str, Any]:
        """The line's object: the fields that are set (not their defaults) and ``extra``."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name != "extra" and (f.name in ("event", "t") or getattr(self, f.name) != f.default)}
        return {**out, **self.extra}

    def line(self) -> str:
        """The JSON line a writer appends."""
        return json.dumps(self.to_json()) + "\n"


_FIELDS = frozenset(f.name for f in dataclasses.fields(ProgressRow)) - {"extra"}


def parse_line(line: str | bytes) -> ProgressRow | None:
    """The row of one line; None for a torn or foreign line (a process killed mid-write)."""
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return ProgressRow.from_json(obj) if isinstance(obj, dict) and "event" in obj and "t" in obj else None


def _rows_of(data: bytes) -> list[ProgressRow]:
    """The rows of a file's bytes: lines that parse as rows (a torn, foreign or undecodable one is skipped)."""
    return [x for line in data.splitlines() if line.endswith(b"}") and (x := parse_line(line)) is not None]


class ProgressWriter:
    """Appends rows to a progress file, each with ``common`` and ``t``: line-buffered and held open, so a row per step
    costs a write, not an open. Writes nothing where ``path`` is empty or ``enabled`` false (a rank other than 0)."""

    def __init__(self, path: str | os.PathLike[str], enabled: bool = True, **common: Any) -> None:
        self.file = open(path, "a", buffering=1) if path and enabled else None  # noqa: SIM115 - closed by close()
        self.common = common

    def write(self, **kv: Any) -> None:
        if self.file is not None:
            self.file.write(ProgressRow.from_json({**self.common, **kv, "t": time.time()}).line())

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def read_progress(path: pathlib.Path) -> list[ProgressRow]:
    """A progress file's rows (none when it does not exist yet); a torn last line is skipped."""
    try:
        return _rows_of(path.read_bytes())
    except FileNotFoundError:
        return []


class ProgressTail:
    """A progress file read as it grows (rows are only appended): each call parses only the complete lines
    written since the last one, so a supervisor that looks every period does not parse the whole file each time
    (it would take the CPU the replicas train on). A file replaced by another (a new inode, or a shorter one) is
    read from its start."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self._offset = 0
        self._inode = -1
        self._rows: list[ProgressRow] = []

    def new(self) -> list[ProgressRow]:
        """The rows written since the last call (a torn last line waits for its end; a foreign one is skipped)."""
        try:
            with open(self.path, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_ino != self._inode or st.st_size < self._offset:
                    self._inode, self._offset, self._rows = st.st_ino, 0, []
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self._offset += end
        fresh = _rows_of(data[:end])
        self._rows += fresh
        return fresh

    def rows(self) -> list[ProgressRow]:
        """Every row so far (a copy), as ``read_progress`` would return them."""
        self.new()
        return list(self._rows)


def progress_path(workdir: pathlib.Path, replica: int) -> pathlib.Path:
    """Where the launcher has replica ``replica`` write its rows."""
    return workdir / f"replica{replica}.progress.jsonl"


def steps_of(rows: list[ProgressRow]) -> list[ProgressRow]:
    """The committed-step rows."""
    return [x for x in rows if x.event == "step"]


def trained_by(steps: Mapping[int, Sequence[ProgressRow]]) -> dict[int, dict[int, int]]:
    """Per data slot, per replica index: the steps in which that replica trained that slot's batch, or carried part
    of it (an orphan's: committed rows that name their ``slot`` and what they ``carried``; a step counted once).
    Empty where the trainer names no slots (a user's script)."""
    seen = {(slot, i, x.step) for i, rows in steps.items() for x in rows
            if x.event == "step" and x.slot is not None and x.contributed and not x.joined and x.step is not None
            for slot in (x.slot, *(x.carried or ()))}
    out: dict[int, dict[int, int]] = {}
    for (slot, i), n in sorted(Counter((slot, i) for slot, i, _ in seen).items()):
        out.setdefault(slot, {})[i] = n
    return out


def trained_by_json(steps: Mapping[int, Sequence[ProgressRow]]) -> dict[str, dict[str, int]]:
    """``trained_by`` as the reports' JSON has it (``fthsdp demo``'s, ``fthsdp run``'s): keys as strings."""
    return {str(k): {str(i): n for i, n in v.items()} for k, v in trained_by(steps).items()}


def carried_steps(steps: Mapping[int, Sequence[ProgressRow]]) -> dict[int, int]:
    """Per orphan slot: the committed steps in which other replicas than its holder trained its batch (orphan
    slots carried)."""
    seen = {(slot, x.step) for rows in steps.values() for x in rows
            if x.event == "step" and x.step is not None and x.contributed for slot in x.carried or ()}
    return dict(sorted(Counter(slot for slot, _ in seen).items()))


def slots_json(steps: Mapping[int, Sequence[ProgressRow]]) -> dict[str, Any]:
    """The reports' ``trained_by`` (``trained_by_json``), ``carried`` (``carried_steps``, keys as strings) and
    ``samples`` (``samples_json``)."""
    return {"trained_by": trained_by_json(steps), "carried": {str(k): n for k, n in carried_steps(steps).items()},
            "samples": samples_json(steps)}


Sample = tuple[int, int, int]
"""A micro-batch trained: (data slot, its cursor, micro-batch)."""


def sample_sequence(per_replica: Mapping[int, Sequence[ProgressRow]]) \
        -> tuple[dict[int, list[Sample]], dict[tuple[int, Sample], float], list[str]]:
    """What a run trained at each step, from the example trainer's ``samples`` (every replica's committed step rows):
    (step -> its micro-batches, sorted; (step, micro-batch) -> rank 0's loss on it; violations: a micro-batch
    trained twice in a step). Two runs of one seed train the same data at the same steps when their sequences are
    equal, whatever failed in either (issue 38: "same data, same step")."""
    seq: dict[int, list[Sample]] = {}
    losses: dict[tuple[int, Sample], float] = {}
    problems: list[str] = []
    for r in sorted(per_replica):
        for x in per_replica[r]:
            if x.event != "step" or x.step is None or not x.samples:
                continue
            for slot, cursor, micro, loss in x.samples:
                s = (int(slot), int(cursor), int(micro))
                if (x.step, s) in losses:
                    problems.append(f"step {x.step}: micro-batch {s} trained twice (replica {r} again)")
                losses[(x.step, s)] = float(loss)
                seq.setdefault(x.step, []).append(s)
    return {k: sorted(v) for k, v in sorted(seq.items())}, losses, problems


def samples_json(steps: Mapping[int, Sequence[ProgressRow]]) -> dict[str, Any] | None:
    """The reports' ``samples``: the run's sample sequence (``sample_sequence``) in short, ``{"micro_batches",
    "steps", "digest"}`` (SHA-256 of the sorted sequence, so two runs of one seed compare by one line); None where
    no row records its samples (a user's script)."""
    seq, _, problems = sample_sequence(steps)
    if not seq:
        return None
    text = json.dumps(sorted(seq.items()), separators=(",", ":"))
    return {"micro_batches": sum(len(v) for v in seq.values()), "steps": len(seq),
            "digest": hashlib.sha256(text.encode()).hexdigest()[:16], "problems": problems}
