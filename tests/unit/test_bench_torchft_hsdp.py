"""torchft on the HSDP shape (``fthsdp bench recovery --vs torchft --ranks 2``): what a healing rank fetches
(``_LocalState``) restores its parameter shards and AdamW state bitwise, with FSDP2 and without; every baseline of
the side-by-side runs on fthsdp's shape; the benchmark page renders the table."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from fthsdp.bench import vs
from fthsdp.bench.baselines.torchft_train import _LocalState, _state_hash
from fthsdp.bench.docs import section_recovery_vs_hsdp
from fthsdp.examples.data import batch
from fthsdp.examples.gpt import GPT, GPTConfig

CFG = GPTConfig.named("tiny")


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # in-process, no network
    try:
        yield
    finally:
        dist.destroy_process_group()


def _job(seed: int, fsdp: bool) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer, GPT]:
    torch.manual_seed(seed)
    model = GPT(CFG)
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (1,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    return params, torch.optim.AdamW(params, lr=1e-2), model


def _step(model: GPT, opt: torch.optim.Optimizer, step: int) -> None:
    opt.zero_grad(set_to_none=False)
    model.loss(batch(0, step, 0, 0, 2, CFG.seq_len, CFG.vocab)).backward()
    opt.step()


def _heal_and_compare(fsdp: bool) -> None:
    params, opt, model = _job(0, fsdp)
    for s in range(2):
        _step(model, opt, s)
    live = _LocalState(params, opt)
    new_params, new_opt, new_model = _job(1, fsdp)  # other weights, no optimizer state yet: a restarted group
    assert _state_hash(new_params, new_opt) != _state_hash(params, opt)
    _LocalState(new_params, new_opt).load_state_dict(live.state_dict())
    assert _state_hash(new_params, new_opt) == _state_hash(params, opt)
    _step(model, opt, 2)  # the step they then train together (the AdamW step count came across too)
    _step(new_model, new_opt, 2)
    assert _state_hash(new_params, new_opt) == _state_hash(params, opt)


def test_a_healed_plain_module_is_bitwise_the_live_one_and_steps_like_it() -> None:
    _heal_and_compare(fsdp=False)


def test_a_healed_fsdp2_shard_is_bitwise_the_live_one_and_steps_like_it(one_rank_group: None) -> None:
    _heal_and_compare(fsdp=True)


def test_a_second_heal_copies_into_the_state_it_already_has() -> None:
    params, opt, model = _job(0, False)
    _step(model, opt, 0)
    other_params, other_opt, other_model = _job(1, False)
    _step(other_model, other_opt, 0)  # state exists: loading copies into it
    before = {id(t) for st in other_opt.state.values() for t in st.values()}
    _LocalState(other_params, other_opt).load_state_dict(_LocalState(params, opt).state_dict())
    assert _state_hash(other_params, other_opt) == _state_hash(params, opt)
    assert {id(t) for st in other_opt.state.values() for t in st.values()} == before


def test_every_baseline_of_the_side_by_side_runs_on_the_requested_shape(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: pathlib.Path) -> None:
    seen: dict[str, int] = {}

    def fake(name: str) -> Any:
        def run(work: Any, **kw: Any) -> dict[str, Any]:
            seen[f"{name}:{work.name}"] = kw["ranks"]
            return {"step_s": 1.0, "loadavg_1min": [0.0, 0.0], "replica_steps_trained": 170, "wall_s": 60.0}
        return run

    monkeypatch.setattr(vs, "run_plain", fake("plain"))
    monkeypatch.setattr(vs, "run_torchft", fake("torchft"))
    monkeypatch.setattr(vs, "run_restart", fake("restart"))
    doc = vs.compare({"step_s": 1.0}, tmp_path, ranks=2)
    assert seen == {"plain:plain": 2, "torchft:torchft": 2, "restart:restart": 2, "plain:plain-after": 2}
    assert doc["workload"]["ranks_per_replica"] == 2


def test_the_benchmark_page_renders_the_hsdp_side_by_side() -> None:
    assert section_recovery_vs_hsdp(None, None) == []
    doc = {"workload": {"replicas": 3, "ranks_per_replica": 2, "steps": 60, "kill": "1@20"},
           "table": [{"system": "fthsdp", "step_s": 1.2, "ett_common_step": 0.9, "final_equal": True},
                     {"system": "torchft", "step_s": 1.1, "ett_common_step": 0.8, "final_equal": False}],
           "torchft": {"settings": {"join_timeout_ms": 1000, "timeout_s": 5.0}}}
    text = "\n".join(section_recovery_vs_hsdp(doc, {"vs_hsdp": ["A note."]}))
    assert "--vs torchft --ranks 2" in text and "3 replica groups x 2 ranks" in text
    assert "| torchft | 1.100 |" in text and "**no**" in text and "A note." in text
