"""The joiner's announcement to the lighthouse (``fthsdp.runtime.join.Joiner._announce``)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from fthsdp.runtime.config import RuntimeConfig
from fthsdp.runtime.errors import RejoinRequired
from fthsdp.runtime.join import Joiner
from lighthouse.errors import FencedOut


class FinishedLighthouse:
    """A lighthouse that finished the job while this replica was fetching: its Ready is refused."""

    def ready(self, role: str) -> int:
        raise FencedOut("FAILED_PRECONDITION: incarnation 'i' of replica 'r1' is over: the job finished at step 120")


def test_a_ready_refused_because_the_job_finished_sends_the_replica_back_not_a_crash() -> None:
    """Seen in a CI run: the refusal escaped as a traceback (exit 1); it must be RejoinRequired (exit 75), after
    which the next incarnation is told the job finished and takes the final checkpoint."""
    def log(level: int, msg: str, *args: object) -> None:
        logging.getLogger("test").log(level, msg, *args)

    client: Any = FinishedLighthouse()
    config = RuntimeConfig(lighthouse="127.0.0.1:1", replica_index=1, num_replicas=3, replica_id="r1", rank=0,
                           world_size=1)
    joiner = Joiner(config, 0, 1, client, None, torch.device("cpu"), log)  # type: ignore[arg-type]
    with pytest.raises(RejoinRequired, match="job finished"):
        joiner._announce()
