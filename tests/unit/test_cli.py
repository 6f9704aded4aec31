"""The ``fthsdp`` command line, in-process: every command group's parser is built, ``fthsdp sim`` prints its table
and its JSON (the same document the model returns), and ``fthsdp demo`` and ``fthsdp chaos`` exit non-zero when
their report says a check failed (hand-made reports fed through the exit decision)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import pytest

from fthsdp.bench.sim import SimConfig, simulate
from fthsdp.chaos import report as chaos_report
from fthsdp.chaos import run as chaos_run
from fthsdp.cli import demo
from fthsdp.cli.main import build_parser, main

SIM = ["sim", "--gpus", "98304", "--replica-gpus", "8192", "--mtbf-min", "18", "--sync-recovery-min", "10",
       "--stall-min", "3", "--rejoin-min", "10"]


@pytest.mark.parametrize("argv", [[], ["lighthouse"], ["status"], ["emulate"], ["run"], ["demo"], ["chaos"], ["sim"],
                                  ["bench"], ["bench", "lighthouse"], ["bench", "ftar"], ["bench", "overhead"],
                                  ["bench", "recovery"], ["bench", "catchup"]])
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


# --- truthful exits: a command that reports a failed check exits non-zero ----------------------------------------

def _demo_report(hashes: dict[str, str | None], steps: int = 30) -> dict[str, Any]:
    """A hand-made finished demo run: each replica's final state hash (None: no final state)."""
    return {"steps": steps, "replicas": len(hashes), "events": [], "survivor_max_stall_s": 0.1, "rejoin_s": None,
            "effective_training_time": 0.9,
            "final": {r: None if h is None else {"step": steps, "param_hash": h} for r, h in hashes.items()}}


def test_demo_exit_decision() -> None:
    assert demo.failures(_demo_report({"0": "aa", "1": "aa", "2": "aa"})) == []
    assert demo.exit_code(_demo_report({"0": "aa", "1": "aa", "2": "aa"})) == 0
    diverged = _demo_report({"0": "aa", "1": "aa", "2": "bb"})
    assert demo.exit_code(diverged) == 1 and any("diverged" in x for x in demo.failures(diverged))
    one_missing = _demo_report({"0": "aa", "1": None, "2": "aa"})
    assert demo.exit_code(one_missing) == 1 and any("replica 1 did not finish" in x
                                                    for x in demo.failures(one_missing))
    short = _demo_report({"0": "aa", "1": "aa"})
    short["final"]["1"]["step"] = 29
    assert demo.exit_code(short) == 1
    assert demo.exit_code(_demo_report({"0": None, "1": None})) == 1


class _FakeCluster:
    """Stands in for the launcher's ``Cluster``: its run returns a hand-made report."""

    report: dict[str, Any] = {}

    def __init__(self, config: Any, workdir: Any, on_tick: Any = None) -> None:
        self.groups: list[Any] = []

    def run(self) -> dict[str, Any]:
        return dict(self.report)


@pytest.mark.parametrize(("hashes", "code"), [({"0": "aa", "1": "aa", "2": "aa"}, None),
                                              ({"0": "aa", "1": "aa", "2": "bb"}, 1),
                                              ({"0": "aa", "1": None, "2": "aa"}, 1)])
def test_demo_exits_non_zero_when_the_final_states_differ(hashes: dict[str, str | None], code: int | None,
                                                           monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(_FakeCluster, "report", _demo_report(hashes))
    monkeypatch.setattr(demo, "Cluster", _FakeCluster)
    if code is None:
        main(["demo", "--model", "tiny", "--steps", "30"])
        assert "final state hash equal on all 3 replicas: True" in capsys.readouterr().out
        return
    with pytest.raises(SystemExit) as e:
        main(["demo", "--model", "tiny", "--steps", "30"])
    assert e.value.code == code
    out = capsys.readouterr()
    assert "final state hash equal on all 3 replicas: False" in out.out
    assert "fthsdp demo: FAILED: " in out.err


def _soak_summary(violations: dict[int, list[str]]) -> dict[str, Any]:
    return {"runs": 1, "seeds": [16], "faults_injected": 3, "by_kind": {"hang": 1}, "not_fired": 0,
            "violations": violations, "wall_s": 1.0, "results": []}


def test_chaos_exit_decision() -> None:
    assert chaos_report.exit_code(_soak_summary({})) == 0
    assert chaos_report.exit_code(_soak_summary({16: ["only-failed-pays: replica 2 (no fault targeted it) "
                                                      "exited 1 time(s), status [1]"]})) == 1


@pytest.mark.parametrize("as_json", [False, True])
def test_chaos_exits_non_zero_when_a_run_broke_an_invariant(as_json: bool, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str],
                                                            tmp_path: pathlib.Path) -> None:
    broken = "only-failed-pays: replica 2 (no fault targeted it) restarted: ran as 2 incarnations"
    monkeypatch.setattr(chaos_run, "soak", lambda *a, **k: _soak_summary({16: [broken]}))
    argv = ["chaos", "--seed", "16", "--workdir", str(tmp_path), *(["--json"] if as_json else [])]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 1
    assert broken in capsys.readouterr().out
    monkeypatch.setattr(chaos_run, "soak", lambda *a, **k: _soak_summary({}))
    main(argv)  # every invariant held: returns, exit status 0
    out = capsys.readouterr().out
    if as_json:
        assert json.loads(out)["violations"] == {}
    else:
        assert "invariants: all held" in out and "only the failed replica pays" in out


def test_chaos_refuses_a_soak_of_no_run(tmp_path: pathlib.Path) -> None:
    with pytest.raises(SystemExit) as e:
        main(["chaos", "--runs", "0", "--workdir", str(tmp_path)])
    assert "--runs must be at least 1" in str(e.value.code)


def test_chaos_sim_reports_and_exits_non_zero_on_a_violation(capsys: pytest.CaptureFixture[str]) -> None:
    main(["chaos", "--sim", "--runs", "5", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["runs"] == 5 and out["violations"] == 0 and sum(out["faults_injected"].values()) > 0
    assert {"runs", "violations", "faults_injected", "seconds"} <= set(out)
    with pytest.raises(SystemExit) as e:  # seed 3 breaks invariant 7 under the broken variant: replay it
        main(["chaos", "--sim", "--seed", "3", "--trace", "--sim-variant", "no-confirm", "--sim-plane", "membership"])
    assert e.value.code == 1 and "VIOLATION only-failed-pays" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:  # seed 84: a survivor rejoins without step reconciliation
        main(["chaos", "--sim", "--seed", "84", "--trace", "--sim-variant", "local-vote"])
    assert e.value.code == 1 and "this replica is behind the others" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--sim-variant must be one of no-confirm, reuse-epochs, local-vote"):
        main(["chaos", "--sim", "--sim-variant", "no-such"])
    with pytest.raises(SystemExit, match="needs --sim-plane lanes"):
        main(["chaos", "--sim", "--sim-variant", "local-vote", "--sim-plane", "membership"])
    with pytest.raises(SystemExit, match="--sim-plane must be one of lanes, membership"):
        main(["chaos", "--sim", "--sim-plane", "bytes"])


def test_a_confirm_age_of_one_heartbeat_interval_is_flagged() -> None:
    from fthsdp.cli.lighthouse import confirm_age_risk

    assert "not above the heartbeat interval 0.5" in confirm_age_risk(0.5, 0.5)
    assert confirm_age_risk(0.4, 0.5) and confirm_age_risk(1.0, 0.5) == ""


def test_run_passes_the_scripts_own_arguments_untouched() -> None:
    a = build_parser().parse_args(["run", "--replicas", "3", "train.py", "--steps", "5", "--replicas", "9", "-x"])
    assert a.replicas == 3 and a.script == "train.py" and a.args == ["--steps", "5", "--replicas", "9", "-x"]


def test_run_takes_the_collective_timeout_from_the_flag_else_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fthsdp run`` used to set every group's FTHSDP_TIMEOUT to 5 s, whatever the environment said."""
    from fthsdp.cli.run import collective_timeout

    monkeypatch.delenv("FTHSDP_TIMEOUT", raising=False)
    assert collective_timeout(build_parser().parse_args(["run", "t.py"])) == 5.0
    monkeypatch.setenv("FTHSDP_TIMEOUT", "30")
    assert collective_timeout(build_parser().parse_args(["run", "t.py"])) == 30.0
    assert collective_timeout(build_parser().parse_args(["run", "--collective-timeout", "12", "t.py"])) == 12.0
    for bad in ("soon", "0"):
        monkeypatch.setenv("FTHSDP_TIMEOUT", bad)
        with pytest.raises(ValueError, match="FTHSDP_TIMEOUT|> 0"):
            collective_timeout(build_parser().parse_args(["run", "t.py"]))


def test_run_refuses_a_missing_script_and_judges_final_states(tmp_path: pathlib.Path) -> None:
    from fthsdp.cli.run import problems

    with pytest.raises(SystemExit, match="no such script"):
        main(["run", str(tmp_path / "nope.py")])
    same = {"step": 5, "param_hash": "ab"}
    assert problems({"0": same, "1": dict(same)}) == []
    assert problems({"0": same, "1": None}) == ["replica 1 wrote no final state"]
    assert "differ" in problems({"0": same, "1": {"step": 5, "param_hash": "cd"}})[0]


def test_the_lane_spread_is_the_lighthouses_and_a_lane_of_fewer_than_two_is_refused(tmp_path: pathlib.Path) -> None:
    """One number for the whole job (stamped on every epoch): a local cluster passes it to its lighthouse only when
    asked to, and the lighthouse refuses what no lane could spread over."""
    from fthsdp.launch.cluster import Cluster
    from fthsdp.launch.config import ClusterConfig
    from lighthouse.config import LighthouseConfig

    assert "--lane-spread-from" not in Cluster(ClusterConfig(replicas=3), tmp_path).lighthouse_args()
    spread = Cluster(ClusterConfig(replicas=3, lane_spread_from=2), tmp_path).lighthouse_args()
    assert spread[spread.index("--lane-spread-from") + 1] == "2"
    for bad in ("1", "0", "-3"):
        refused = build_parser().parse_args(["lighthouse", "--bind", "127.0.0.1:0", "--http", "",
                                             "--lane-spread-from", bad])
        with pytest.raises(SystemExit, match=f"--lane-spread-from must be >= 2 \\(members of a lane\\), not {bad}"):
            refused.fn(refused)  # returns only by refusing: it never serves
    with pytest.raises(SystemExit):
        build_parser().parse_args(["lighthouse", "--lane-spread-from", "many"])
    with pytest.raises(ValueError, match=r"lane_spread_from=1 must be >= 2"):  # embedded, without the CLI
        LighthouseConfig(lane_spread_from=1)


def test_run_one_hosts_groups_needs_the_jobs_lighthouse_and_valid_groups(tmp_path: pathlib.Path) -> None:
    from fthsdp.launch.cluster import Cluster
    from fthsdp.launch.config import ClusterConfig, Kill

    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(SystemExit, match="need --lighthouse"):
        main(["run", "--group", "1", str(script)])
    with pytest.raises(SystemExit, match=r"each must be one of 0\.\.1, once"):
        main(["run", "--replicas", "2", "--lighthouse", "127.0.0.1:1", "--group", "2", str(script)])
    assert ClusterConfig(replicas=4).indices() == (0, 1, 2, 3)
    spares = ClusterConfig(replicas=2, spares=1)
    assert spares.indices() == (0, 1, 2)  # the spare group is index 2 (it asks for no slot)
    env = spares.replica_env(2, "h:1", tmp_path / "p", tmp_path, None)
    assert (env["FTHSDP_REPLICA_INDEX"], env["FTHSDP_NUM_REPLICAS"], env["FTHSDP_SPARES"]) == ("2", "2", "1")
    args = Cluster(spares, tmp_path).lighthouse_args()
    assert args[args.index("--expected-replicas") + 1] == "3"  # the first epoch waits for the spare too
    # ... but a group that never registers holds it only the join window: half the replicas' epoch wait, <= 30 s
    assert args[args.index("--join-window") + 1] == "30.0"
    short = ClusterConfig(replicas=2, env={1: {"FTHSDP_EPOCH_WAIT": "10"}})
    assert Cluster(short, tmp_path).join_window_s == 5.0  # the smallest wait of any group
    assert Cluster(ClusterConfig(join_window_s=0.0), tmp_path).join_window_s == 0.0  # wait for every group
    for window in (-1.0, 10.0):
        with pytest.raises(ValueError, match="below the replicas' FTHSDP_EPOCH_WAIT"):
            Cluster(dataclasses.replace(short, join_window_s=window), tmp_path)
    assert ClusterConfig(replicas=4, lighthouse="h:1", groups=(3, 1)).indices() == (1, 3)
    for bad in [(1, 1), (-1,), (4,)]:
        with pytest.raises(ValueError, match="once"):
            ClusterConfig(replicas=4, lighthouse="h:1", groups=bad).indices()
    with pytest.raises(ValueError, match="needs the job's lighthouse"):
        ClusterConfig(replicas=4, groups=(1,)).indices()
    with pytest.raises(ValueError, match=r"kill of replica 0: this launcher runs replica groups \[1\]"):
        Cluster(ClusterConfig(replicas=2, lighthouse="h:1", groups=(1,), kills=(Kill(0, 5),)), tmp_path)
    for nice in (-1, 20):
        with pytest.raises(ValueError, match=f"standby_nice {nice}: a nice value from 0"):
            Cluster(ClusterConfig(standby_nice=nice), tmp_path)
    cluster = Cluster(ClusterConfig(replicas=3, lighthouse="h:1", groups=(2,)), tmp_path)
    assert [g.index for g in cluster.groups] == [2]
    cluster.start_lighthouse()  # an external one: only addressed, nothing started
    assert (cluster.addr, cluster.http, cluster.lighthouse) == ("h:1", "", None)
    with pytest.raises(ValueError, match="no lighthouse HTTP address"):
        cluster.status()


def test_demo_kill_all_is_its_own_scenario() -> None:
    def kills(*argv: str) -> list[tuple[int, int]]:
        return [(k.replica, k.step) for k in demo.kills_of(build_parser().parse_args(["demo", *argv]))]

    assert kills() == [(1, 20)]
    assert kills("--kill-all", "17") == [(0, 17), (1, 17), (2, 17)]  # not also replica 1 at step 20
    assert kills("--kill", "2@5", "--kill-all", "17") == [(2, 5), (0, 17), (1, 17), (2, 17)]
    assert kills("--no-kill") == []


def test_a_standby_lost_while_held_is_forgotten_its_kill_kept_and_too_many_fail_the_job(
        tmp_path: pathlib.Path) -> None:
    from fthsdp.launch.cluster import Cluster, Standby
    from fthsdp.launch.config import ClusterConfig, Kill, ReplicaFailed

    class Exited:
        pid, returncode = 0, 1

        def poll(self) -> int:
            return 1

    cluster = Cluster(ClusterConfig(replicas=1, warm_restarts=True, max_restarts=1), tmp_path)
    g = cluster.groups[0]
    g.standby = Standby(Exited(), tmp_path / "gate", tmp_path / "standby.log", Kill(0, 5))  # type: ignore[arg-type]
    g.restart_at = 0.0  # restarting: no new standby is started by the check below
    cluster._ensure_standby(g)
    assert g.standby is not None  # a restart takes care of it
    g.restart_at = None
    g.finished = True
    cluster._ensure_standby(g)
    assert g.standby is not None and not cluster.events  # nothing to replace in a finished group
    g.finished = False
    cluster._standby_lost(g, g.standby)
    assert g.pending_faults == [Kill(0, 5)]  # armed again for the next incarnation
    assert [(e["event"], e["replica"], e["code"]) for e in cluster.events] == [("standby_lost", 0, 1)]
    with pytest.raises(ReplicaFailed, match="2 warm standbys exited while held"):
        cluster._standby_lost(g, Standby(Exited(), tmp_path / "gate", tmp_path / "standby.log", None))  # type: ignore[arg-type]


def test_run_summary_gives_each_slots_batches_and_names_groups_back_after_the_end() -> None:
    from fthsdp.cli.run import job_cursors, summary

    final: dict[str, dict[str, Any] | None] = {
        "0": {"step": 160, "param_hash": "ab", "cursors": [160, 73, 160]},
        "1": {"step": 160, "param_hash": "ab", "cursors": [160, 73, 160], "late": True},
        "2": {"step": 160, "param_hash": "ab", "cursors": [160, 73, 160]}}
    lines = summary(final)
    assert lines[0] == "batches trained per data slot: [160, 73, 160] (steps: 160); short: slot 1: 73 of 160"
    assert "replica group(s) [1] came back after the job had ended" in lines[1]
    assert job_cursors(final) == [160, 73, 160]  # the JSON report's "cursors", one per slot
    assert summary({"0": {"step": 5, "param_hash": "ab"}}) == []  # a script that reports no cursors: nothing to say
    assert job_cursors({"0": {"step": 5, "param_hash": "ab"}, "1": None}) is None
    by = {"0": {"0": 160}, "1": {"1": 10, "2": 63}, "2": {"2": 97, "10": 63}}  # the report's trained_by
    assert summary(final, by)[1] == ("trained by: slot 0: replica 0 (160); slot 1: replica 1 (10), replica 2 (63); "
                                     "slot 2: replica 2 (97), replica 10 (63)")


def test_trained_by_counts_each_replicas_steps_of_each_slot_once() -> None:
    from fthsdp.launch.progress import ProgressRow, trained_by

    def row(step: int, slot: int | None, **kw: Any) -> ProgressRow:
        return ProgressRow("step", float(step), step=step, slot=slot, **kw)

    spare = [row(0, None, contributed=False), row(1, 1), row(2, 1), row(2, 1)]  # a step's row twice: counted once
    killed = [row(0, 1), row(1, 1, joined=True, contributed=False), row(2, None, contributed=False)]
    assert trained_by({0: [row(0, 0), row(1, 0), row(2, 0)], 1: killed, 2: spare}) == {
        0: {0: 3}, 1: {1: 1, 2: 2}}
    assert trained_by({0: [ProgressRow("step", 0.0, step=0)]}) == {}  # a trainer that names no slot


def test_an_orphan_slots_carriers_are_counted_with_its_steps_carried() -> None:
    """Orphan slots carried: replica 1 died after step 1; replicas 0 and 2 carried slot 1 in steps 2 and 3 (both in
    step 2, replica 2 alone in step 3): slot 1 was trained by all three, and carried in 2 steps."""
    from fthsdp.cli.run import summary
    from fthsdp.launch.progress import ProgressRow, carried_steps, trained_by

    def row(step: int, slot: int, carried: list[int] | None = None) -> ProgressRow:
        return ProgressRow("step", float(step), step=step, slot=slot, carried=carried)

    rows = {0: [row(0, 0), row(1, 0), row(2, 0, [1]), row(3, 0)], 1: [row(0, 1), row(1, 1)],
            2: [row(0, 2), row(1, 2), row(2, 2, [1]), row(3, 2, [1]), row(3, 2, [1])]}
    assert trained_by(rows) == {0: {0: 4}, 1: {0: 1, 1: 2, 2: 2}, 2: {2: 4}}
    assert carried_steps(rows) == {1: 2}
    final: dict[str, dict[str, Any] | None] = {"0": {"step": 4, "param_hash": "ab", "cursors": [4, 4, 4]}}
    assert summary(final, None, {"1": 2})[1] == "orphan slots carried by the other replicas: slot 1 in 2 steps"


def test_the_sample_sequence_is_the_same_whoever_trained_each_micro_batch_and_a_repeat_is_named() -> None:
    """The same micro-batches at the same steps give one digest, whichever replicas trained them (a failure-free
    run against one where replica 0 carried slot 1 from step 1); one trained twice in a step is a problem, which
    ``fthsdp demo`` counts as a failure."""
    from fthsdp.cli.demo import failures
    from fthsdp.cli.run import summary
    from fthsdp.launch.progress import ProgressRow, samples_json

    def row(step: int, *samples: tuple[int, int]) -> ProgressRow:
        return ProgressRow("step", float(step), step=step,
                           samples=[[slot, step, micro, 1.5] for slot, micro in samples])

    free = {0: [row(0, (0, 0), (0, 1)), row(1, (0, 0), (0, 1))], 1: [row(0, (1, 0), (1, 1)), row(1, (1, 0), (1, 1))]}
    carried = {0: [row(0, (0, 0), (0, 1)), row(1, (1, 1), (0, 0), (0, 1))], 1: [row(0, (1, 0), (1, 1)), row(1, (1, 0))]}
    a, b = samples_json(free), samples_json(carried)
    assert a is not None and b is not None
    assert a == b and a["micro_batches"] == 8 and a["steps"] == 2 and a["problems"] == []
    assert samples_json({0: [ProgressRow("step", 0.0, step=0)]}) is None  # a trainer that records none
    twice = samples_json({0: [row(0, (0, 0))], 1: [row(0, (0, 0))]})
    assert twice is not None and twice["problems"] == ["step 0: micro-batch (0, 0, 0) trained twice (replica 1 again)"]
    final: dict[str, dict[str, Any] | None] = {"0": {"step": 2, "param_hash": "ab"}}
    assert summary(final, samples=a) == [f"sample sequence: 8 micro-batches in 2 steps, digest {a['digest']} (with "
                                         "orphan slots carried, a run of the same seed has this one, failures or not)"]
    report = {"steps": 2, "final": {"0": {"step": 2, "param_hash": "ab"}}, "samples": twice}
    assert failures(report) == twice["problems"]


def test_carrying_orphan_slots_beside_spares_is_refused_before_anything_starts() -> None:
    from fthsdp.launch.config import ClusterConfig

    for kw in ({"carry_orphans": True}, {"deterministic": True}):
        with pytest.raises(ValueError, match="with --spares: a spare takes a dead group's slot"):
            ClusterConfig(spares=1, **kw).indices()  # type: ignore[arg-type]
    assert ClusterConfig(deterministic=True).replica_env(0, "127.0.0.1:1", pathlib.Path("p"), pathlib.Path("."),
                                                         None)["FTHSDP_DETERMINISTIC"] == "1"


def test_run_says_once_when_the_lighthouse_refuses_it_its_status(capsys: pytest.CaptureFixture[str]) -> None:
    import urllib.error

    from fthsdp.cli.run import StatusView

    class Refused:
        http = "127.0.0.1:1"
        groups: list[object] = []

        def status(self) -> dict[str, object]:
            raise urllib.error.HTTPError("http://127.0.0.1:1/status", 401, "Unauthorized", {}, None)  # type: ignore[arg-type]

    view = StatusView(period_s=0.0)
    view(Refused())  # type: ignore[arg-type]
    view(Refused())  # type: ignore[arg-type]
    err = capsys.readouterr().err
    assert err.count("refuses its status") == 1 and "HTTP 401" in err and "--credentials" in err
