"""The decisions of ``deploy/gpu/nccl_check.sh``, in Python so that they are tested without GPUs: where each rank
runs (``layout``: NCCL refuses a GPU twice in one communicator, and every rank is in two, its group's and its
lane's) and whether the run passed (``report`` reads the groups' progress files; ``problems`` is the verdict).

    python -m fthsdp.testing.nccl_report layout --replicas 2 --ranks 2 --gpus 2      # -> "shared 0,1;1,0"
    python -m fthsdp.testing.nccl_report report OUT MODE R S STEPS MODEL KILL STATUS WALL_S GPU_MAP
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
from typing import Any

DEDICATED, SHARED, SINGLE = "dedicated", "shared", "single-gpu"


def layout(replicas: int, ranks: int, gpus: int, single: bool = False) -> tuple[str, list[list[int]]]:
    """(mode, GPUs of each group: local rank k of group i on ``[i][k]``). ``dedicated``: one GPU per rank (at least
    R*S GPUs); ``shared``: group i's rank k on GPU (i+k) mod G, a Latin square, so neither a group's ranks (FSDP2's
    communicator) nor a lane's (rank k of every group: FTAR's) share a GPU, on as few as max(R, S) GPUs (at least
    2); ``single-gpu`` otherwise, or when asked: one group of one rank on GPU 0."""
    if not single and gpus >= replicas * ranks:
        return DEDICATED, [[i * ranks + k for k in range(ranks)] for i in range(replicas)]
    if not single and gpus >= 2 and gpus >= max(replicas, ranks):
        return SHARED, [[(i + k) % gpus for k in range(ranks)] for i in range(replicas)]
    return SINGLE, [[0]]


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
    """Why the run failed (empty: it passed): a group exited non-zero, a final state hash differs or is missing,
    a group stopped short of the last step, or the kill never fired (the killed group ran once: nothing was
    checked)."""
    groups = report["replica"]
    hashes = {v["param_hash"] for v in groups.values()}
    out = []
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
           status: int, wall_s: float, gpu_map: str) -> dict[str, Any]:
    """The run's report, from ``out/run/replica{i}.progress.jsonl`` and the files nccl_check.sh wrote (``run.txt``,
    single_host.sh's output, says which groups it restarted)."""
    def text(name: str) -> str:
        p = out / name
        return p.read_text() if p.exists() else ""

    rep: dict[str, Any] = {
        "mode": mode, "replicas": replicas, "ranks_per_replica": ranks, "steps": steps, "gpu_map": gpu_map.split(";"),
        "model": model, "kill": kill or None, "exit_status": status, "wall_s": round(wall_s, 1),
        "versions": json.loads(text("versions.json") or "{}"), "gpus": text("gpus.txt").strip().splitlines(),
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
    a = p.parse_args(argv)
    if a.cmd == "layout":
        mode, gpus = layout(a.replicas, a.ranks, a.gpus, a.single)
        print(mode, ";".join(",".join(map(str, g)) for g in gpus))
        return 0
    r = report(pathlib.Path(a.out), a.mode, int(a.replicas), int(a.ranks), int(a.steps), a.model, a.kill,
               int(a.status), float(a.wall_s), a.gpu_map)
    print(json.dumps(r, indent=2))
    print("nccl_check: " + ("OK" if r["ok"] else "FAILED: " + "; ".join(r["problems"])), file=sys.stderr)
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
