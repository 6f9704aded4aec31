"""The ``fthsdp`` command line, in-process: every command group's parser is built, and ``fthsdp sim`` prints its
table and its JSON (the same document the model returns)."""

from __future__ import annotations

import json

import pytest

from fthsdp.bench.sim import SimConfig, simulate
from fthsdp.cli.main import build_parser, main

SIM = ["sim", "--gpus", "98304", "--replica-gpus", "8192", "--mtbf-min", "18", "--sync-recovery-min", "10",
       "--stall-min", "3", "--rejoin-min", "10"]


@pytest.mark.parametrize("argv", [[], ["lighthouse"], ["status"], ["emulate"], ["demo"], ["chaos"], ["sim"],
                                  ["bench"], ["bench", "lighthouse"], ["bench", "ftar"], ["bench", "overhead"],
                                  ["bench", "recovery"]])
def test_every_command_has_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([*argv, "--help"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage: fthsdp")


def test_sim_prints_its_table_and_its_json(capsys: pytest.CaptureFixture[str]) -> None:
    main(SIM)
    table = capsys.readouterr().out
    assert table.splitlines() == [
        "12 replicas, 3333 failures over 1000 h (fixed arrivals)",
        "  sync    ETT 0.444  (closed form, fixed arrivals 0.444; Poisson limit 0.574)",
        "  fthsdp  ETT 0.801  (closed form, fixed arrivals 0.801; Poisson limit 0.819)"]
    main([*SIM, "--json"])
    doc = json.loads(capsys.readouterr().out)
    expected = simulate(SimConfig(98304, 8192, 18.0, 10.0, 3.0, 10.0)).to_json()
    assert doc == expected and list(doc) == ["config", "replicas", "horizon_min", "failures", "sync", "fthsdp"]


def test_bad_sim_input_exits_with_the_reason() -> None:
    with pytest.raises(SystemExit) as e:
        main(["sim", "--gpus", "100", "--replica-gpus", "7", *SIM[5:]])
    assert "multiple" in str(e.value.code)
