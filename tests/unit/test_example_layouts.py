"""The example trainer's layouts (fthsdp/examples/layouts.py) and ``fthsdp bench overhead --layout``: what can be
checked without processes (the runs themselves: tests/integration/test_layouts.py for the runtime, the bench's
figures in docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from fthsdp.bench.docs import section_layouts
from fthsdp.bench.overhead import bench_overhead
from fthsdp.examples import train
from fthsdp.examples.gpt import GPT, GPTConfig
from fthsdp.examples.layouts import Stage, mesh_for
from fthsdp.runtime.config import TrainerSettings


def test_pipeline_stages_keep_the_whole_models_names_and_split_it() -> None:
    """Checkpoint keys of every stage live in one namespace: the whole model's, with no stage's key another's."""
    gpt = GPT(GPTConfig.named("tiny"))
    whole = {name for name, _ in gpt.named_parameters()}
    first, last = ({n for n, _ in Stage(gpt, lo, hi).named_parameters()} for lo, hi in ((0, 1), (1, 2)))
    assert first | last == whole and not first & last
    assert "tok.weight" in first and "head.weight" in last and "blocks.1.qkv.weight" in last


def test_bad_layout_settings_are_refused_before_anything_runs() -> None:
    with pytest.raises(ValueError, match="--layout must be one of"):
        bench_overhead(layout="tp3")
    with pytest.raises(ValueError, match="even --ranks"):
        bench_overhead(layout="pp2", ranks=3)
    with pytest.raises(ValueError, match="even number of ranks"):
        mesh_for("tp2", 3)
    with pytest.raises(ValueError, match="layout must be one of"):
        mesh_for("fsdp", 2)
    with pytest.raises(SystemExit):  # a layout's backward is its own: the closure helper cannot run it
        train._args(["--layout", "pp2", "--api", "closure"], TrainerSettings.from_env())


def test_the_layouts_section_has_a_row_per_layout() -> None:
    def doc(layout: str, ratio: float) -> dict:
        return {"layout": layout, "replicas": 2, "ranks_per_replica": 4, "model": "reference", "baseline_step_s": 1.0,
                "fthsdp_step_s": ratio, "step_time_ratio": ratio, "round_ratios": [ratio]}

    lines = section_layouts([doc("tp2", 1.04), doc("pp2", 1.1)], {"layouts": ["A note."]})
    rows = [line for line in lines if line.startswith("| tp2") or line.startswith("| pp2")]
    assert len(rows) == 2 and "**1.04**" in rows[0] and "A note." in lines
    assert section_layouts([], None) == []
