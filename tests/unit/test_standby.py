"""A warm standby's first ``train_step`` (``roles.Standby``, ``fthsdp.runtime.standby``): it warms up without
changing the state, waits for its gate, and only then registers (``StepCore.register``: the role the lighthouse
gives, then what waited for the registration)."""

from __future__ import annotations

import pathlib
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from fthsdp.runtime import roles
from fthsdp.runtime.startup import Role as Given
from lighthouse.model import NO_SLOT


@dataclass
class FakeCore:
    """What a standby's turn uses of the step core."""

    config: Any
    opt: torch.optim.Optimizer
    joiner: Any = field(default_factory=lambda: type("J", (), {"warmed": False})())
    slot: int = 0
    calls: list[str] = field(default_factory=list)

    def register(self) -> Given:
        self.calls.append("register")
        return Given.JOINING

    def log(self, level: int, msg: str, *args: object) -> None:
        pass


def test_a_standby_warms_up_without_changing_its_state_and_registers_only_once_released(
        tmp_path: pathlib.Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    gate = tmp_path / "gate"
    cfg = type("C", (), {"join_warmup": True, "standby_gate": str(gate)})()
    ft = FakeCore(cfg, opt)
    warmed = threading.Event()

    def closure() -> torch.Tensor:
        warmed.set()
        return model(torch.ones(3, 4)).sum()

    turns: list[roles.Turn] = []
    t = threading.Thread(target=lambda: turns.append(roles.Standby().turn(ft, closure)))  # type: ignore[arg-type]
    t.start()
    assert warmed.wait(30)
    t.join(0.3)
    assert t.is_alive() and ft.calls == [], "registered before its gate existed"
    gate.write_text("go\n")
    t.join(30)
    assert not t.is_alive()
    assert ft.calls == ["register"] and ft.joiner.warmed
    assert turns[0].result is None and isinstance(turns[0].next, roles.Joining)  # the role the lighthouse gave
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)), "warm-up changed the state"
    assert all(p.grad is None for p in model.parameters()) and not opt.state


def test_a_spare_groups_standby_warms_up_on_a_lent_slot(tmp_path: pathlib.Path) -> None:
    """A spare group has no data slot: its standby's warm-up reads slot 0's batch (``lent_slot``) instead of
    failing in the trainer's ``cursor``, and is a spare again once released."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    gate = tmp_path / "gate"
    gate.write_text("go\n")
    cfg = type("C", (), {"join_warmup": True, "standby_gate": str(gate)})()
    ft = FakeCore(cfg, opt, slot=NO_SLOT)
    seen: list[int] = []

    def closure() -> torch.Tensor:
        if ft.slot == NO_SLOT:
            raise RuntimeError("a spare has no batch")  # what the trainer's cursor raises
        seen.append(ft.slot)
        return model(torch.ones(3, 4)).sum()

    assert roles.Standby().turn(ft, closure).result is None  # type: ignore[arg-type]  # the role given takes the next turn
    assert seen == [0] and ft.slot == NO_SLOT and ft.calls == ["register"] and ft.joiner.warmed
