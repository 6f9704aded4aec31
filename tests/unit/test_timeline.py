"""The demo's timeline: each replica's states over a run (``fthsdp.launch.lanes``, pure) and the PNG that draws
them as one lane per replica (``fthsdp.cli.demo.plot_timeline``)."""

from __future__ import annotations

import pathlib

from fthsdp.cli.demo import LANE_COLOURS, plot_timeline, smoothed
from fthsdp.launch.lanes import lanes
from fthsdp.launch.progress import ProgressRow


def step(t: float, n: int, inc: str, **kw: object) -> ProgressRow:
    return ProgressRow.from_json({"event": "step", "t": t, "step": n, "replica": 1, "incarnation": inc, **kw})


EVENTS = [{"event": "start", "t": 0.0, "replica": 1, "incarnation": 1},
          {"event": "start", "t": 0.0, "replica": 0, "incarnation": 1},
          {"event": "exit", "t": 10.5, "replica": 1, "code": -9, "killed": True},
          {"event": "start", "t": 12.5, "replica": 1, "incarnation": 2},
          {"event": "finished", "t": 25.5, "replica": 1}]
ROWS = [*(step(2.0 + k, k, "a") for k in range(9)),
        step(10.4, 9, "a"),  # written as it went down
        ProgressRow.from_json({"event": "start", "t": 15.0, "replica": 1, "incarnation": "b", "joining": True}),
        step(18.0, 14, "b", joined=True, contributed=False),
        step(18.5, 15, "b", contributed=False),
        *(step(19.0 + k, 16 + k, "b") for k in range(6))]


def test_a_killed_replica_reads_as_down_then_starting_joining_and_training_again() -> None:
    got = lanes(ROWS, EVENTS, 1, t_end=30.0)
    assert got == [("starting", 0.0, 2.0), ("training", 2.0, 10.5), ("down", 10.5, 12.5),
                   ("starting", 12.5, 15.0), ("joining", 15.0, 19.0), ("training", 19.0, 25.5)]
    # Not yet restarted when the run ended: down to the end.
    assert lanes(ROWS[:10], EVENTS[:3], 1, t_end=11.0)[-1] == ("down", 10.5, 11.0)
    assert lanes([], [], 1, t_end=5.0) == []


def test_the_png_draws_each_state_in_its_colour(tmp_path: pathlib.Path) -> None:
    import matplotlib.image
    import numpy as np

    report = {"t_start": 0.0, "replicas": 2, "ranks_per_replica": 2, "events": EVENTS,
              "lanes": {"1": [[s, a, b] for s, a, b in lanes(ROWS, EVENTS, 1, 30.0)], "0": [["training", 1.0, 25.0]]},
              "loss": {"0": [[k, 5.0 - 0.1 * k] for k in range(25)], "1": [[k, 5.1 - 0.1 * k] for k in range(20)]}}
    png = tmp_path / "t.png"
    plot_timeline(report, png)
    img = matplotlib.image.imread(str(png))
    flat = (img[..., :3] * 255).round().astype(np.int16).reshape(-1, 3)
    for state, colour in LANE_COLOURS.items():
        rgb = np.array([int(colour[i:i + 2], 16) for i in (1, 3, 5)])
        assert int((np.abs(flat - rgb).max(axis=1) <= 3).sum()) >= 200, f"{state} not drawn"


def test_smoothing_is_a_trailing_mean() -> None:
    assert smoothed([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]
    assert smoothed([]) == []
