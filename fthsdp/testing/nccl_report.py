"""The decisions of ``deploy/gpu/nccl_check.sh``, in Python so that they are tested without GPUs: where each rank
runs (``layout``: NCCL refuses a GPU twice in one communicator, and every rank is in two, its group's and its
lane's) and whether the run passed (``report`` reads the groups' progress files; ``problems`` is the verdict: it
never passes a run that did less than was asked, and a survivor that restarted fails it).

    python -m fthsdp.testing.nccl_report layout --replicas 2 --ranks 2 --gpus 2      # -> "shared 0,1;1,0"
    python -m fthsdp.testing.nccl_report report OUT MODE R S STEPS MODEL KILL STATUS WALL_S GPU_MAP [--asked R,S,KILL]
    python -m fthsdp.testing.nccl_report summary OUT                                   # the whole check's verdict
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
from typing import Any

DEDICATED, SHARED, ONE_GPU, SINGLE = "dedicated", "shared", "one-gpu", "single-gpu"


def layout(replicas: int, ranks: int, gpus: int, single: bool = False) -> tuple[str, list[list[int]]]:
    """(mode, GPUs of each group: local rank k of group i on ``[i][k]``). ``dedicated``: one GPU per rank (at least
    R*S GPUs); ``shared``: group i's rank k on GPU (i+k) mod G, a Latin square, so neither a group's ranks (FSDP2's
    communicator) nor a lane's (rank k of every group: FTAR's) share a GPU, on as few as max(R, S) GPUs (at least
    2); ``one-gpu`` otherwise: every rank on GPU 0, each a host of its own to NCCL (``NCCL_HOSTID``; nccl_check.sh
    first proves that this works here, and falls back to the smoke if not); ``single-gpu`` when asked: the smoke,
    one group of one rank on GPU 0."""
    if single:
        return SINGLE, [[0]]
    if gpus >= replicas * ranks:
        return DEDICATED, [[i * ranks + k for k in range(ranks)] for i in range(replicas)]
    if gpus >= 2 and gpus >= max(replicas, ranks):
        return SHARED, [[(i + k) % gpus for k in range(ranks)] for i in range(replicas)]
    return ONE_GPU, [[0] * ranks for _ in range(replicas)]


def _replica(rows: list[dict[str, Any]], restarts: int) -> dict[str, Any]:
    st = [x for x in rows if x.get("event") == "step"]
    normal = [x for x in st if not x.get("joined") and x.get("attempts", 1) == 1]
    final = next((x for x in reversed(rows) if x.get("event") == "final"), None)
    starts = [x["t"] for x in rows if x.get("event") == "start"]
    joined = [x for x in st if x.get("joined")]
    exchange = [x["exchange_s"] for x in normal if x.get("exchange_s") is not None]
    r: dict[str, Any] = {
        "incarnations": len(starts), "steps_committed": len(st),
        "median_step_s": round(statistics.median(x["step_s"] for x in normal), 4) if normal else None,
        "median_exchange_s": round(statistics.median(exchange), 4) if exchange else None,
        "max_attempts": max((x.get("attempts", 1) for x in st), default=None),
        "final_step": final["step"] if final else None, "param_hash": final.get("param_hash") if final else None,
        "fatal": [x["error"] for x in rows if x.get("event") == "fatal"],
        "restarts": restarts,  # new torchruns single_host.sh started for the group (a kill, a crash)
        "job_finished_before_back": any(x.get("event") == "job_finished" for x in rows)}
    if len(starts) > 1 and joined:
        before = [x["t"] for x in st if x["t"] < starts[-1]]
        r["registered_to_joined_step_s"] = round(joined[0]["t"] - starts[-1], 3)  # the new incarnation's catch-up
        if before:  # from its last commit before the kill to its first step as a joiner: restart + catch-up
            r["last_commit_to_joined_step_s"] = round(joined[0]["t"] - before[-1], 3)
    return r


def problems(report: dict[str, Any]) -> list[str]:
    """Why the run failed (empty: it passed): less ran than was asked (the smoke instead of R×S with a kill), a
    group exited non-zero, a final state hash differs or is missing, a group stopped short of the last step, a
    survivor (a group not killed) ran more than once, or the kill never fired (the killed group ran once: nothing
    was checked)."""
    groups = report["replica"]
    hashes = {v["param_hash"] for v in groups.values()}
    out = []
    asked = report.get("asked")
    ran = {"replicas": report["replicas"], "ranks": report["ranks_per_replica"], "kill": report.get("kill")}
    if asked and asked != ran:
        out.append(f"asked for {asked['replicas']} groups x {asked['ranks']} ranks, kill {asked['kill'] or 'none'}; "
                   f"ran {ran['replicas']} x {ran['ranks']}, kill {ran['kill'] or 'none'} ({report['mode']}): "
                   "what was asked was not checked")
    killed_index = (report.get("kill") or "").split("@", 1)[0]
    for index, v in groups.items():
        if index != killed_index and v["incarnations"] > 1:
            out.append(f"group {index} was not killed but ran {v['incarnations']} times: a survivor exited")
    if report["exit_status"] != 0:
        out.append(f"a group failed (exit status {report['exit_status']})")
    if len(hashes) != 1 or None in hashes or not groups:
        out.append(f"final state hashes differ or are missing: {sorted(map(str, hashes))}")
    if any(v["final_step"] != report["steps"] for v in groups.values()):
        out.append(f"a group did not reach step {report['steps']}")
    kill = report.get("kill")
    if kill:
        killed = groups.get(kill.split("@", 1)[0])
        if not killed or killed["restarts"] < 1:
            out.append(f"the kill {kill} never fired (the group ran once)")
        elif killed["job_finished_before_back"]:
            out.append("the killed group came back after the others had finished: its rejoin was not checked "
                       "(raise --steps or --min-step-s)")
    return out


def report(out: pathlib.Path, mode: str, replicas: int, ranks: int, steps: int, model: str, kill: str,
           status: int, wall_s: float, gpu_map: str, asked: tuple[int, int, str] | None = None) -> dict[str, Any]:
    """The run's report, from ``out/run/replica{i}.progress.jsonl`` and the files nccl_check.sh wrote (``run.txt``,
    single_host.sh's output, says which groups it restarted). ``asked``: (replicas, ranks, kill) as asked, when the
    run did less (a fallback); the report then fails."""
    def text(name: str) -> str:
        p = out / name
        return p.read_text() if p.exists() else ""

    rep: dict[str, Any] = {
        "mode": mode, "replicas": replicas, "ranks_per_replica": ranks, "steps": steps, "gpu_map": gpu_map.split(";"),
        "model": model, "kill": kill or None, "exit_status": status, "wall_s": round(wall_s, 1),
        "versions": json.loads(text("versions.json") or "{}"), "gpus": text("gpus.txt").strip().splitlines(),
        "asked": {"replicas": asked[0], "ranks": asked[1], "kill": asked[2] or None} if asked else None,
        "replica": {}}
    run = text("run.txt")
    for i in range(replicas):
        path = out / "run" / f"replica{i}.progress.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")] if path.exists() else []
        rep["replica"][str(i)] = _replica(rows, run.count(f"group {i}: exit status"))
    hashes = {v["param_hash"] for v in rep["replica"].values()}
    rep["all_final_hashes_equal"] = len(hashes) == 1 and None not in hashes
    rep["kill_fired"] = None if not kill else rep["replica"].get(kill.split("@", 1)[0], {}).get("restarts", 0) >= 1
    rep["problems"] = problems(rep)
    rep["ok"] = not rep["problems"]
    return rep


def _lines(path: pathlib.Path, prefix: str) -> list[dict[str, Any]]:
    text = path.read_text() if path.exists() else ""
    return [json.loads(x.split(" ", 1)[1]) for x in text.splitlines() if x.startswith(prefix + " ")]


def two_on_one(folder: pathlib.Path) -> dict[str, Any]:
    """Part A of the one-GPU mode, from ``folder/{control,hostid}.r{0,1}.log`` (deploy/gpu/two_on_one.py): do two
    ranks of one communicator work on one GPU with a ``NCCL_HOSTID`` each, and does NCCL refuse them without?"""
    control = [row for r in (0, 1) for row in _lines(folder / f"control.r{r}.log", "TWO_ON_ONE")]
    hostid = [row for r in (0, 1) for row in _lines(folder / f"hostid.r{r}.log", "TWO_ON_ONE")]
    return {"control": control, "hostid": hostid,
            "works": len(hostid) == 2 and all(x.get("ok") for x in hostid),
            "control_refused": not (len(control) == 2 and all(x.get("ok") for x in control))}


def summary(out: pathlib.Path) -> dict[str, Any]:
    """The whole check's verdict, from what nccl_check.sh left in ``out``: ``runs/<name>/report.json`` (each
    ``report``), and in the one-GPU mode ``two_on_one.json`` and ``peer_kill.<settings>.json``
    (deploy/gpu/peer_kill_check.py). ``ok`` only when every part asked for ran and passed."""
    runs = {d.name: json.loads((d / "report.json").read_text()) if (d / "report.json").exists() else None
            for d in sorted((out / "runs").glob("*")) if d.is_dir()}
    problems = [f"{name}: no report" for name, r in runs.items() if r is None]
    problems += [f"{name}: {p}" for name, r in runs.items() if r is not None for p in r["problems"]]
    notes: list[str] = []
    parts: dict[str, Any] = {"runs": runs}
    if (out / "two_on_one.json").exists():
        a = parts["two_on_one"] = json.loads((out / "two_on_one.json").read_text())
        if not a["works"]:
            problems.append("two ranks of one communicator do not work on one GPU here, even with NCCL_HOSTID: "
                            "no cross-replica exchange could run")
        elif not a["control_refused"]:
            notes.append("the control also worked: this NCCL accepts two ranks on one GPU without NCCL_HOSTID")
        for settings in ("fixed", "shipped"):
            path = out / f"peer_kill.{settings}.json"
            parts[f"peer_kill_{settings}"] = json.loads(path.read_text()) if path.exists() else None
        fixed, shipped = parts["peer_kill_fixed"], parts["peer_kill_shipped"]
        if a["works"] and not (fixed and fixed.get("ok")):
            problems.append("peer kill under fthsdp's settings: the survivor did not live, find the failure and "
                            f"rebuild ({'no result' if not fixed else fixed.get('last_event')})")
        if shipped:
            notes.append(f"peer kill under c10d's defaults (the control): survivor "
                         f"{'lived' if shipped.get('survived') else 'died'} (exit {shipped.get('survivor_exit')})")
    if not runs:
        problems.append("no run")
    return {**parts, "notes": notes, "problems": problems, "ok": not problems}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fthsdp.testing.nccl_report")
    sub = p.add_subparsers(dest="cmd", required=True)
    lay = sub.add_parser("layout", help="print MODE and the GPU map ('0,1;1,0': group i's GPUs, ';' between)")
    lay.add_argument("--replicas", type=int, required=True)
    lay.add_argument("--ranks", type=int, required=True)
    lay.add_argument("--gpus", type=int, required=True)
    lay.add_argument("--single", action="store_true")
    rep = sub.add_parser("report", help="print the JSON report; exit 1 when the check failed")
    for name in ("out", "mode", "replicas", "ranks", "steps", "model", "kill", "status", "wall_s", "gpu_map"):
        rep.add_argument(name)
    rep.add_argument("--asked", default="", help="R,S,KILL as asked, when the run fell back to less")
    two = sub.add_parser("two-on-one", help="print part A's JSON from the folder of its logs")
    two.add_argument("folder")
    summ = sub.add_parser("summary", help="print the whole check's JSON verdict; exit 1 when it failed")
    summ.add_argument("out")
    a = p.parse_args(argv)
    if a.cmd == "two-on-one":
        print(json.dumps(two_on_one(pathlib.Path(a.folder))))
        return 0
    if a.cmd == "summary":
        r = summary(pathlib.Path(a.out))
        print(json.dumps(r, indent=2))
        print("nccl_check: " + ("OK" if r["ok"] else "FAILED: " + "; ".join(r["problems"])), file=sys.stderr)
        return 0 if r["ok"] else 1
    if a.cmd == "layout":
        mode, gpus = layout(a.replicas, a.ranks, a.gpus, a.single)
        print(mode, ";".join(",".join(map(str, g)) for g in gpus))
        return 0
    asked = None
    if a.asked:
        r_, s_, kill = (a.asked.split(",", 2) + ["", ""])[:3]
        asked = (int(r_), int(s_), kill)
    r = report(pathlib.Path(a.out), a.mode, int(a.replicas), int(a.ranks), int(a.steps), a.model, a.kill,
               int(a.status), float(a.wall_s), a.gpu_map, asked)
    print(json.dumps(r, indent=2))
    print("nccl_check: " + ("OK" if r["ok"] else "FAILED: " + "; ".join(r["problems"])), file=sys.stderr)
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
