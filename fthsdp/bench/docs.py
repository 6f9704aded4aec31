#!/usr/bin/env python3
"""Regenerate ``docs/benchmarks.md`` and its plots (``docs/img/bench-*.png``) from the benchmark JSONs.

    .venv/bin/python -m fthsdp.bench.docs [--import out/bench]      (make benchmarks-doc)

Data: ``docs/bench-data/*.json`` (committed). ``--import DIR`` first copies the known files found in DIR (fresh
runs, e.g. ``out/bench/``) over them. Known files:

- ``recovery.json``: ``fthsdp bench recovery --vs torchft --json`` (fthsdp, torchft, whole-job restart, plain);
  a ``table`` list as ``fthsdp.bench.vs.compare`` returns it, at the top level or under ``vs``;
- ``baselines.json``: ``python -m fthsdp.bench.vs --json`` without an fthsdp result (used while ``recovery.json``
  does not exist: the fthsdp row is then marked as a placeholder);
- ``lighthouse.json``: ``fthsdp bench lighthouse --replicas 1000 5000 10000 --vs torchft --json`` (``sizes``,
  ``torchft``; an older file with ``results`` reads too);
- ``saturation.json``: ``python -c "import json; from fthsdp.bench.lighthouse import saturation; print(json.dumps(
  saturation(1000)))"`` (heartbeats offered faster and faster to one lighthouse);
- ``notes.json``: ``{"conditions": [lines], "lighthouse": [lines], "saturation": [lines]}``, prose written after
  looking at a run (machine load, the profile): the generator cannot know it;
- ``overhead.json``, ``ftar.json``: ``fthsdp bench overhead|ftar --json`` (optional);
- ``recovery-vs-hsdp.json``: ``fthsdp bench recovery --vs torchft --ranks 2 --json`` (every system on the HSDP
  shape, torchft with FSDP2 inside each group; optional);
- ``recovery-double.json``: ``fthsdp bench recovery --kill 1@20 --kill 2@20 --json`` (optional);
- ``straggler.json``: ``fthsdp bench straggler --json`` (optional);
- ``checkpoint.json``: ``fthsdp bench checkpoint --json`` (optional);
- ``lanes-12x8192.json``, ``lanes-12x8192-4lanes.json``, ``lanes-12x8192-nccl.json``, ``lanes-1000x8-nccl.json``:
  ``fthsdp bench lighthouse --replicas 12 --ranks-per-group 8192 [--lanes 4 | --lane-backend nccl] --json`` and
  ``--replicas 1000 --ranks-per-group 8 --lane-backend nccl`` (their ``lanes``: the lanes' rebuild after a death;
  optional);
- ``failover.json``: ``fthsdp bench failover --json`` (optional).

The simulator section is computed here (``fthsdp.bench.sim``) from the measured stalls.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]

from fthsdp.bench.sim import SimConfig, simulate  # noqa: E402

LANES = ("lanes-12x8192.json", "lanes-12x8192-4lanes.json", "lanes-12x8192-nccl.json", "lanes-1000x8-nccl.json")
KNOWN = ("recovery.json", "recovery-hsdp.json", "recovery-double.json", "baselines.json", "lighthouse.json",
         "saturation.json", "overhead.json", "ftar.json", "notes.json", "straggler.json", "checkpoint.json",
         "recovery-cold.json", "recovery-warm.json", "catchup.json", "recovery-spares.json",
         "recovery-spares-warm.json", "recovery-vs-hsdp.json", "overhead-timeline.json", "failover.json",
         "overhead-tp2.json", "overhead-pp2.json") + LANES
PLACEHOLDER = "**(placeholder: run `fthsdp bench recovery --vs torchft --json > out/bench/recovery.json`, then " \
              "`make benchmarks-doc`)**"

# The FT-HSDP paper's scale point: 12 replicas x 8,192 GPUs, a failure every 18 minutes, 10 minutes per
# whole-job restart (and, at that scale, about 10 minutes to bring a replaced replica back).
PAPER = {"gpus": 98304, "replica_gpus": 8192, "mtbf_min": 18.0, "sync_recovery_min": 10.0, "stall_min": 3.0,
         "rejoin_min": 10.0}


def paragraphs(notes: dict[str, Any] | None, *keys: str) -> list[str]:
    """The prose of ``notes.json`` under ``keys`` (in order), each paragraph followed by a blank line."""
    return [line for key in keys for para in (notes or {}).get(key, []) for line in (para, "")]


def _read(f: pathlib.Path) -> dict[str, Any] | None:
    """The JSON in ``f``, or None when it is missing, empty or not JSON (a run still writing it, a failed one)."""
    try:
        doc = json.loads(f.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def load(data: pathlib.Path, name: str) -> dict[str, Any] | None:
    return _read(data / name)


def fmt(v: Any, spec: str = ".3f") -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "**no**"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def recovery_table(rec: dict[str, Any] | None, base: dict[str, Any] | None) -> tuple[list[dict[str, Any]], str, bool]:
    """Rows of the side-by-side table, its source, and whether the fthsdp row is real."""
    doc = rec if rec is not None else base
    if doc is None:
        return [], "", False
    table = doc.get("table") or (doc.get("vs") or {}).get("table") or []
    fthsdp_real = rec is not None and any(r["system"] == "fthsdp" and r.get("step_s") for r in table)
    return table, "recovery.json" if rec is not None else "baselines.json", fthsdp_real


def section_recovery(rec: dict[str, Any] | None, base: dict[str, Any] | None, img: pathlib.Path) -> list[str]:
    table, source, fthsdp_real = recovery_table(rec, base)
    out = ["## Recovery: fthsdp vs torchft vs whole-job restart", ""]
    if not table:
        return out + ["No data yet: " + PLACEHOLDER, ""]
    doc = rec if rec is not None else base
    assert doc is not None
    w = doc.get("workload") or (doc.get("vs") or {}).get("workload") or {}
    out += [f"`fthsdp bench recovery --vs torchft --json` (data: `docs/bench-data/{source}`). The reference workload "
            f"(docs/design.md §12): {w.get('replicas', 3)} replica groups x {w.get('ranks_per_replica', 1)} "
            f"rank, GPT 4.24 M parameters, batch 8, AdamW, {w.get('steps', 60)} steps, SIGKILL of group "
            f"{w.get('kill', '1@20')} (the whole group), restarted {w.get('restart_delay_s', 2.0)} s later, Gloo "
            "on loopback, 2 shared CPU cores. Every figure of one table comes from the same invocation; the step "
            "ratio is against plain FSDP2-HSDP measured in it (the mean of a run before and one after the failure "
            "runs).", ""]
    if not fthsdp_real:
        out += ["The fthsdp row is a placeholder until its recovery run exists: " + PLACEHOLDER, ""]
    out += _vs_rows(table, fthsdp_real)
    ft = doc.get("fthsdp") if fthsdp_real else None
    if isinstance(ft, dict):
        extra = [(k, label) for k, label in (("catchup_step_ratio", "survivors' step while the joiner catches up / "
                                              "while it was down"), ("join_s", "joiner process start -> active (s)"),
                                             ("transfer_ratio", "catch-up transfer / plain socket copy measured "
                                              "while training"),
                                             ("final_equal", "final states equal"))
                 if ft.get(k) is not None]
        if extra:
            out += ["fthsdp's own recovery figures in the same run (`fthsdp.bench.recovery`): "
                    + "; ".join(f"{label} {fmt(ft[k], '.3f')}" for k, label in extra) + ".", ""]
    tft = doc.get("torchft") or (doc.get("vs") or {}).get("torchft") or {}
    rst = doc.get("restart") or (doc.get("vs") or {}).get("restart") or {}
    if tft.get("settings"):
        s = tft["settings"]
        out += [f"torchft {_torchft_version()} settings: its lighthouse with `--min_replicas "
                f"{s.get('lighthouse_min_replicas')} --join_timeout_ms {s.get('join_timeout_ms')} "
                f"--heartbeat_timeout_ms {s.get('heartbeat_timeout_ms')} --quorum_tick_ms {s.get('quorum_tick_ms')}`"
                f" (the default join timeout is 60 s, which the survivors would wait at every failure), Manager "
                f"and `ProcessGroupGloo` timeouts {s.get('timeout_s')} s, asynchronous quorum, `init_sync=False`, "
                f"`min_replica_size={s.get('manager_min_replica_size')}`; gradients averaged with "
                "`manager.allreduce` on one flat bucket after backward, optimizer step only when "
                "`manager.should_commit()` (torchft's DDP wrapper crashed the survivors on a kill on this stack). "
                "torchft trains the plain module, without FSDP2: with one rank per group there is nothing to shard; "
                "that makes its step lighter than FSDP2-HSDP's and fthsdp's, which run FSDP2 even on one rank (the "
                "next table runs every system, torchft included, with FSDP2 on 3 groups x 2 ranks). "
                "The restarted group heals from a live one (torchft's HTTP checkpoint transport)."
                + (f" Survivors' total excess over the failure window: {fmt(tft.get('lost_s'), '.2f')} s." if
                   tft.get("lost_s") is not None else ""), ""]
    if rst.get("settings"):
        out += [f"Whole-job restart: one torchrun of all ranks, plain FSDP2-HSDP, DCP checkpoint every "
                f"{rst['settings'].get('checkpoint_every')} steps, `--max-restarts 1` with "
                "`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`; torchrun restarts every worker at once (no 2 s delay: "
                f"generous to it). Kill to first new step {fmt(rst.get('resume_s'), '.2f')} s (checkpoint load "
                f"{fmt(rst.get('checkpoint_load_s'), '.2f')} s of it). The stall column adds the average loss of a "
                f"failure at a random time, checkpoint_every / 2 steps; this run lost {rst.get('lost_steps')} "
                f"steps (stall as measured: {fmt(rst.get('stall_measured_s'), '.2f')} s).", ""]
    out += ["Definitions: steady step = median gap between two commits of one replica (steps >= 5); stall = the "
            "survivors' longest gap after the failure less the median step; rejoin = kill -> first step committed "
            "by the restarted replica (including the 2 s restart delay and process start-up); effective training "
            "time = what the job trained x median step / (replicas x wall time from first to last commit), counted in "
            "distinct (slot, batch) pairs where the progress rows list them (fthsdp's, since 2026-12-06: "
            "`ett_basis` \"batches\") and in distinct replica-steps otherwise (the baselines': \"replica-steps\"); "
            "the two agree while each contributing replica trains one batch of one slot per step, so earlier figures "
            "read the same; on plain's step = the same with plain FSDP2-HSDP's steady step in place of the system's "
            "own, so that a slower step cannot score better (\"–\": data measured before that column existed). "
            "`fthsdp/launch/recovery_metrics.py` computes all of them for every system.", ""]
    _plot_recovery(table, fthsdp_real, img / "bench-recovery.png")
    out += ["![recovery](img/bench-recovery.png)", ""]
    return out


def _vs_rows(table: list[dict[str, Any]], fthsdp_real: bool = True) -> list[str]:
    """The side-by-side table of ``fthsdp.bench.vs.compare``'s document, as Markdown."""
    out = ["| system | steady step (s) | step / plain FSDP2 | survivors' stall per failure (s) | rejoin (s) | "
           "effective training time | on plain's step | final state equal |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for r in table:
        placeholder = r["system"] == "fthsdp" and not fthsdp_real
        cells = ["*pending*"] * 7 if placeholder else [
            fmt(r.get("step_s")), fmt(r.get("step_ratio"), ".2f"), fmt(r.get("stall_s"), ".2f"),
            fmt(r.get("rejoin_s"), ".2f"), fmt(r.get("ett"), ".3f"), fmt(r.get("ett_common_step"), ".3f"),
            fmt(r.get("final_equal"))]
        out.append(f"| {r['system']} | " + " | ".join(cells) + " |")
    return [*out, ""]


def section_recovery_vs_hsdp(doc: dict[str, Any] | None, notes: dict[str, Any] | None) -> list[str]:
    """``fthsdp bench recovery --vs torchft --ranks 2``: every system on the HSDP shape, torchft with FSDP2
    inside each group."""
    if not doc or not doc.get("table"):
        return []
    w = doc.get("workload", {})
    tft = (doc.get("torchft") or {}).get("settings", {})
    out = ["## Recovery vs torchft on the HSDP shape: 3 replica groups x 2 ranks", "",
           f"`fthsdp bench recovery --vs torchft --ranks 2 --json` (data: `docs/bench-data/recovery-vs-hsdp.json`): "
           f"the reference model, {w.get('replicas', 3)} replica groups x {w.get('ranks_per_replica', 2)} ranks "
           f"with FSDP2 inside each group for every system, {w.get('steps', 60)} steps, SIGKILL of group "
           f"{w.get('kill', '1@20')} (the whole group), restarted {w.get('restart_delay_s', 2.0)} s later; one "
           "invocation, the step ratio and the common step against plain FSDP2-HSDP on the same shape measured in "
           "it (the mean of a run before and one after the failure runs).", ""]
    out += _vs_rows(doc["table"])
    out += [f"torchft {_torchft_version()} on this shape (`fthsdp/bench/baselines/torchft_train.py`): each group "
            "shards the model with FSDP2 over its two ranks (the same `fully_shard` calls as plain FSDP2-HSDP and "
            "fthsdp), each rank has its own `Manager` (its group's rank 0 hosts the group's manager server, as in "
            "torchft's HSDP recipe), and after backward each rank all-reduces its FSDP2-reduced gradient shard with "
            "the same rank of the other groups (`manager.allreduce` on one flat bucket), stepping only when "
            "`manager.should_commit()` agrees; a restarted group heals rank by rank from a live group's same rank "
            "(its shard of parameters and AdamW state, read from the sharded parameters, never from the module's "
            "state dict mid-forward). The same lighthouse settings and timeouts as the table above"
            + (f" (`--join_timeout_ms {tft.get('join_timeout_ms')}`, timeouts {tft.get('timeout_s')} s, "
               "asynchronous quorum)" if tft else "") + ".", ""]
    out += paragraphs(notes, "vs_hsdp")
    return out


def _torchft_version() -> str:
    try:
        from importlib.metadata import version

        return version("torchft")
    except Exception:
        return ""


def _plot_recovery(table: list[dict[str, Any]], fthsdp_real: bool, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in table if r.get("stall_s") is not None or (r["system"] == "fthsdp")]
    rows = [r for r in rows if not (r["system"] == "fthsdp" and not fthsdp_real) and "plain" not in r["system"]]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, key, title in zip(axes, ("stall_s", "rejoin_s", "ett"),
                              ("survivors' stall per failure (s)", "rejoin (s)", "effective training time"),
                              strict=True):
        names = [r["system"] for r in rows]
        vals = [r.get(key) or 0.0 for r in rows]
        ax.bar(names, vals, color=[f"C{i}" for i in range(len(rows))])
        ax.set_title(title)
        ax.tick_params(axis="x", labelrotation=15)
        for i, v in enumerate(vals):
            ax.text(i, v, f"{v:.2f}", ha="center", va="bottom")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _torchft_lighthouse_rows(rows: list[dict[str, Any]] | None) -> list[str]:
    """torchft's lighthouse in the same invocation (``--vs torchft``), if it ran."""
    if not rows:
        return []
    out = ["torchft 0.2.0's lighthouse in the same invocation (`--vs torchft`, "
           "`fthsdp/bench/baselines/torchft_lighthouse.py`): its `torchft_lighthouse` process and N emulated torchft "
           "groups, a thread and a client each, heartbeating at the same interval, heartbeat timeout five intervals. "
           "A torchft group learns its membership only from its own `quorum` call (at its next step) and a death only "
           "from the victim's silence: *death -> all* = kill -> the last survivor's next `quorum` returns without it; "
           "*after its timeout* = the part after the victim's last heartbeat plus the timeout.", "",
           "| replicas | hb interval (s) | heartbeat timeout (s) | bootstrap (s) | death -> all (s) | "
           "after its timeout (s) | call errors | load (1 min) |", "|" + " ---: |" * 8]
    for r in rows:
        if r.get("skipped"):
            out.append(f"| {r['replicas']:,} | {r['heartbeat_interval_s']:g} | {r['heartbeat_timeout_s']:g} | "
                       f"{r['skipped']} | | | | |")
            continue
        out.append(f"| {r['replicas']:,} | {r['heartbeat_interval_s']:g} | {r['heartbeat_timeout_s']:g} | "
                   f"{fmt(r.get('bootstrap_s'), '.1f')} | {fmt(r.get('death_to_all_s'), '.2f')} | "
                   f"{fmt(r.get('after_timeout_s'), '.2f')} | {r.get('call_errors', '–')} | "
                   f"{r.get('loadavg_1min', '–')} |" + (f" {r['error']}" if r.get("error") else ""))
    return [*out, ""]


def section_lighthouse(lh: dict[str, Any] | None, sat: dict[str, Any] | None, notes: dict[str, Any] | None,
                       img: pathlib.Path) -> list[str]:
    out = ["## Lighthouse at scale: emulated replica groups", ""]
    if lh is None:
        return out + ["No data yet: run `fthsdp bench lighthouse --replicas 1000 5000 10000 --json > "
                      "out/bench/lighthouse.json`.", ""]
    res = lh.get("sizes") or lh["results"]
    ranks = sorted({r.get("ranks_per_replica", 1) for r in res})
    out += [f"`fthsdp bench lighthouse --replicas {' '.join(str(r['replicas']) for r in res)} --json` "
            "(data: `docs/bench-data/lighthouse.json`): one real lighthouse process (`fthsdp lighthouse`, in-memory "
            f"store) and N emulated replica groups of {'/'.join(map(str, ranks))} ranks (control plane only: "
            "register, one session per group with heartbeats up and epochs down as deltas, the group's other ranks "
            f"served in-process by the session's holder; one process, one event loop, one TCP connection per "
            f"group) on the same {lh.get('cpus', 2)} cores. The heartbeat interval is max(1 s, N / 1,000). Each "
            "death: a group's process is killed (its session closes), a peer reports it (as FTAR's blame does), the "
            "lighthouse confirms it at once on that evidence and pushes the new epoch as a delta; each rejoin: the "
            "same replica comes back as a new incarnation, registers, joins, turns active (two epochs). *bytes per "
            "change* = what one death's epoch cost each member on its session; *detect* = kill -> epoch formed, "
            "*push* = epoch formed -> received, per member; *death -> all* = kill -> the last member has it; "
            "*rejoin -> all* = registration -> the last member has the epoch with it active; *conns / streams* = "
            "TCP connections to the lighthouse and sessions + watch streams it holds, in steady state.", ""]
    out += ["| replicas | ranks/group | hb interval (s) | bootstrap (s) | full epoch (KB) | bytes per change | "
            "lighthouse CPU % steady | conns / streams | detect p50 (s) | push p50 / p99 (s) | "
            "death -> all p50 / p99 (s) | rejoin -> all p99 (s) | cancelled calls | healthy evicted | load (1 min) |",
            "|" + " ---: |" * 15]
    for r in res:
        out.append(
            f"| {r['replicas']:,} | {r.get('ranks_per_replica', 1)} | {r['heartbeat_interval_s']:g} | "
            f"{fmt(r['bootstrap_s'], '.1f')} | {fmt(r.get('epoch_message_bytes', 0) / 1e3, '.0f')} | "
            f"{r.get('epoch_change_bytes', '–')} | {r['lighthouse_cpu_pct']} | "
            f"{r.get('lighthouse_connections', '–')} / {r.get('lighthouse_streams', '–')} | "
            f"{fmt(r['detect_p50_s'], '.3f')} | {fmt(r['push_p50_s'], '.3f')} / {fmt(r['push_p99_s'], '.3f')} | "
            f"{fmt(r['death_to_all_p50_s'], '.2f')} / {fmt(r['death_to_all_p99_s'], '.2f')} | "
            f"{fmt(r.get('rejoin_to_all_p99_s'), '.2f')} | {r.get('cancelled_calls', '–')} | "
            f"{r.get('healthy_evicted', '–')} | {r.get('loadavg_1min', '–')} |")
    out.append("")
    errors = {r["replicas"]: r["call_errors"] for r in res if r.get("call_errors")}
    if errors:
        out += ["Calls and streams that failed, by status (each failed session reconnected): "
                + "; ".join(f"{n:,}: " + ", ".join(f"{k} {v}" for k, v in e.items()) for n, e in errors.items())
                + ".", ""]
    out += _torchft_lighthouse_rows(lh.get("torchft"))
    for line in (notes or {}).get("lighthouse", ()):
        out += [line, ""]
    _plot_lighthouse(res, img / "bench-lighthouse.png")
    out += ["![lighthouse growth](img/bench-lighthouse.png)", ""]
    if sat or (notes and notes.get("saturation")):
        out += ["### Where the lighthouse saturates on 2 cores, and why", ""]
    if sat:
        r0 = sat["results"][0]
        out += [f"Heartbeat intake, `fthsdp.bench.lighthouse.saturation` (data: `docs/bench-data/saturation.json`): "
                f"{r0['replicas']:,} emulated replicas heartbeating faster and faster:", "",
                "| interval (s) | offered / s | accepted / s | accepted / offered | lighthouse CPU % | "
                "emulator CPU % | lighthouse CPU per heartbeat (µs) |",
                "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for r in sat["results"]:
            out.append(f"| {r['heartbeat_interval_s']:g} | {r['offered_per_s']:,.0f} | {r['accepted_per_s']:,.0f} | "
                       f"{r['ratio']:.2f} | {r['lighthouse_cpu_pct']} | {r['emulator_cpu_pct']} | "
                       f"{r['lighthouse_cpu_us_per_heartbeat']:.0f} |")
        out.append("")
    for line in (notes or {}).get("saturation", ()):
        out += [line, ""]
    return out


def _plot_lighthouse(res: list[dict[str, Any]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = [r["replicas"] for r in res]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    a.plot(n, [r["death_to_all_p50_s"] for r in res], "o-", label="death -> all, p50")
    a.plot(n, [r["death_to_all_p99_s"] for r in res], "o--", label="death -> all, p99")
    a.plot(n, [r["push_p99_s"] for r in res], "s-", label="push (epoch formed -> member), p99")
    if all(r.get("rejoin_to_all_p50_s") is not None for r in res):
        a.plot(n, [r["rejoin_to_all_p50_s"] for r in res], "^-", label="rejoin -> all, p50")
        a.plot(n, [r["rejoin_to_all_p99_s"] for r in res], "^--", label="rejoin -> all, p99")
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("replicas")
    a.set_ylabel("seconds (log)")
    a.set_title("epoch-change latency")
    a.legend(fontsize=8)
    b.plot(n, [r["lighthouse_cpu_pct"] for r in res], "o-", label="lighthouse, steady heartbeats")
    b.plot(n, [r.get("lighthouse_cpu_pct_churn", 0) for r in res], "s-", label="lighthouse, deaths + rejoins")
    b.plot(n, [r.get("emulator_cpu_pct", 0) for r in res], "^-", label="emulator (all replicas), steady")
    b.plot(n, [r.get("emulator_cpu_pct_churn", 0) for r in res], "v-", label="emulator, deaths + rejoins")
    b.axhline(100, color="gray", ls=":", lw=1)
    b.set_ylim(0, None)
    b.set_xscale("log")
    b.set_xlabel("replicas")
    b.set_ylabel("CPU % (100 = one core)")
    b.set_title("CPU")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _measured(table: list[dict[str, Any]], system: str, fthsdp_real: bool) -> dict[str, Any] | None:
    for r in table:
        if r["system"] == system and r.get("stall_s") is not None and (system != "fthsdp" or fthsdp_real):
            return r
    return None


def section_sim(rec: dict[str, Any] | None, base: dict[str, Any] | None, img: pathlib.Path) -> list[str]:
    table, _, fthsdp_real = recovery_table(rec, base)
    p = PAPER
    out = ["## At 100K GPUs: `fthsdp sim` with the measured stalls", "",
           f"`fthsdp sim` (`fthsdp/bench/sim.py`) at the FT-HSDP paper's scale point: {p['gpus']:,} GPUs in "
           f"replicas of {p['replica_gpus']:,}, a failure every {p['mtbf_min']:g} min (fixed arrivals; Poisson in the "
           f"last column), a whole-job restart costing {p['sync_recovery_min']:g} min. Our measured survivors' stall "
           "per failure is fed in as the stall: it is what the lighthouse, FTAR and the Gloo data plane cost the "
           "survivors, which does not grow with the replica's size. The rejoin is not: at this scale a failed "
           f"replica needs a replaced host and a {p['replica_gpus']:,}-GPU restart, so the rejoin is taken as the "
           f"paper's {p['rejoin_min']:g} min (our measured rejoin, seconds here, is process start-up on 2 cores); a "
           "replica that is down costs only its own share, so ETT hardly depends on it. The measured stall is a "
           "lower bound for that scale: it does not include rebuilding NCCL communicators across thousands of GPUs "
           "(not measurable on this CPU machine), hence the sensitivity rows.", "",
           "| system | stall per failure (min) | rejoin (min) | ETT (fixed arrivals) | ETT (Poisson) |",
           "| --- | ---: | ---: | ---: | ---: |"]
    rows: list[tuple[str, float, float, bool]] = [("whole-job restart (paper's 10 min)", p["sync_recovery_min"],
                                                    p["sync_recovery_min"], True),
                                                   ("FT-HSDP paper (3 min stall)", p["stall_min"], p["rejoin_min"],
                                                    False)]
    for system in ("fthsdp", "torchft"):
        r = _measured(table, system, fthsdp_real)
        if r is not None:
            rows.append((f"{system}, measured stall {r['stall_s']:.2f} s", r["stall_s"] / 60, p["rejoin_min"], False))
        else:
            rows.append((f"{system} (pending its recovery run)", float("nan"), p["rejoin_min"], False))
    # What we cannot measure here: rebuilding NCCL communicators over 8,192-GPU replicas after a failure.
    for stall_min in (0.5, 1.0):
        rows.append((f"sensitivity: any stall of {stall_min:g} min", stall_min, p["rejoin_min"], False))
    curves = []
    for name, stall, rejoin, sync in rows:
        if stall != stall:  # nan: no measurement yet
            out.append(f"| {name} | *pending* | {rejoin:g} | *pending* | *pending* |")
            continue
        ett = {}
        for arrivals in ("fixed", "poisson"):
            c = SimConfig(gpus=int(p["gpus"]), replica_gpus=int(p["replica_gpus"]), mtbf_min=p["mtbf_min"],
                          sync_recovery_min=p["sync_recovery_min"] if not sync else stall,
                          stall_min=stall, rejoin_min=rejoin, arrivals=arrivals, hours=2000)
            s = simulate(c)
            ett[arrivals] = s.sync.ett if sync else s.fthsdp.ett
        out.append(f"| {name} | {stall:.3f} | {rejoin:g} | {ett['fixed']:.3f} | {ett['poisson']:.3f} |")
        curves.append((name, stall, rejoin, sync))
    out += ["", "The command for one row (fthsdp's measured stall in minutes):", "",
            "```bash", f".venv/bin/fthsdp sim --gpus {p['gpus']} --replica-gpus {p['replica_gpus']} --mtbf-min "
            f"{p['mtbf_min']:g} --sync-recovery-min {p['sync_recovery_min']:g} --stall-min STALL_S/60 "
            f"--rejoin-min {p['rejoin_min']:g} --json", "```", ""]
    _plot_sim(curves, img / "bench-sim.png")
    out += ["Scaling the job (the per-GPU failure rate of the paper's point held: MTBF = 18 min x 98,304 / GPUs):",
            "", "![sim](img/bench-sim.png)", ""]
    return out


def _plot_sim(curves: list[tuple[str, float, float, bool]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = PAPER
    gpus = [int(p["replica_gpus"]) * k for k in range(2, 17)]
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, stall, rejoin, sync in curves:
        ys = []
        for g in gpus:
            c = SimConfig(gpus=g, replica_gpus=int(p["replica_gpus"]), mtbf_min=p["mtbf_min"] * p["gpus"] / g,
                          sync_recovery_min=stall if sync else p["sync_recovery_min"], stall_min=stall,
                          rejoin_min=rejoin, arrivals="fixed", hours=2000)
            s = simulate(c)
            ys.append(s.sync.ett if sync else s.fthsdp.ett)
        ax.plot([g / 1000 for g in gpus], ys, "o-", ms=3, label=name)
    ax.axvline(p["gpus"] / 1000, color="gray", ls=":", lw=1)
    ax.set_xlabel("GPUs (thousands), replicas of 8,192")
    ax.set_ylabel("effective training time")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def section_timeline(doc: dict[str, Any] | None, notes: dict[str, Any] | None) -> list[str]:
    """What keeping every rank's step timeline costs (``fthsdp bench overhead --against timeline-off``)."""
    if not doc:
        return []
    share = doc["span_cost_us"] * doc["spans_per_step"] / 1e6 / doc["fthsdp_step_s"]
    out = ["## The step timeline's cost", "",
           f"`fthsdp bench overhead --against timeline-off --json`: {doc['replicas']} replicas x "
           f"{doc['ranks_per_replica']} ranks, {doc['model']} model, {doc['rounds']} rounds; fthsdp with its step "
           f"timeline off (`FTHSDP_TIMELINE=0`) {doc['baseline_step_s']} s/step, on (the default) "
           f"{doc['fthsdp_step_s']} s/step: ratio **{doc['step_time_ratio']}** (median of the rounds' ratios "
           f"{doc['round_ratios']}). Recording one span costs {doc['span_cost_us']} µs here and a step records "
           f"{doc['spans_per_step']} per rank: {share:.1e} of a step, far below what the end-to-end ratio can "
           "resolve on this machine.", ""]
    out += paragraphs(notes, "timeline")
    return out


def section_layouts(docs: list[dict[str, Any]], notes: dict[str, Any] | None) -> list[str]:
    """The step of replicas laid out as tensor or pipeline parallel groups, over plain HSDP of the same layout
    (``fthsdp bench overhead --layout``)."""
    if not docs:
        return []
    out = ["## Layouts inside a replica", "",
           "`fthsdp bench overhead --layout L --json`: each replica built as layout L (`fthsdp/examples/layouts.py`; "
           "docs/design.md §3b), the baseline plain FSDP2-HSDP of the same layout (a `replicate` dimension added to "
           "its mesh), alternating in one invocation; the ratio is the median of the rounds' ratios.", "",
           "| layout | replicas x ranks | model | plain HSDP s/step | fthsdp s/step | ratio | per round |",
           "|---|---|---|---|---|---|---|"]
    for d in docs:
        out.append(f"| {d['layout']} | {d['replicas']} x {d['ranks_per_replica']} | {d['model']} | "
                   f"{d['baseline_step_s']} | {d['fthsdp_step_s']} | **{d['step_time_ratio']}** | "
                   f"{d['round_ratios']} |")
    out.append("")
    out += paragraphs(notes, "layouts")
    return out


def section_other(overhead: dict[str, Any] | None, ftar: dict[str, Any] | None) -> list[str]:
    out: list[str] = []
    if overhead:
        out += ["## Steady-state overhead", "",
                f"`fthsdp bench overhead --json`: {overhead['replicas']} replicas x {overhead['ranks_per_replica']} "
                f"ranks, plain FSDP2-HSDP {overhead['baseline_step_s']} s/step, fthsdp {overhead['fthsdp_step_s']} "
                f"s/step (medians over rounds): ratio **{overhead['step_time_ratio']}**"
                + (f" (median of the rounds' ratios {overhead['round_ratios']}, each fthsdp run over the baseline "
                   f"run beside it; lighthouse heartbeats every {overhead['heartbeat_interval_s']} s)"
                   if "round_ratios" in overhead else "") + ".", ""]
    if ftar:
        out += ["## FTAR", "", f"`fthsdp bench ftar --json`: {ftar.get('members')} members, {ftar.get('mb')} MB: "
                f"throughput ratio to `torch.distributed.all_reduce` {ftar.get('throughput_ratio')}, rebuild for a "
                f"new epoch {ftar.get('rebuild_s')} s, stall on a SIGKILL mid-exchange {ftar.get('kill_stall_s')} s.",
                ""]
    return out


def section_recovery_hsdp(doc: dict[str, Any] | None) -> list[str]:
    """fthsdp's own recovery figures on the HSDP demo shape (``fthsdp bench recovery --json``, 3 x 2 ranks)."""
    f = (doc or {}).get("fthsdp")
    if not isinstance(f, dict):
        return []
    c = f.get("catchup", {})
    rows = [("survivors' stall per failure (s)", f.get("survivor_stall_s"),
             "longest gap from the kill on (the death, and the rejoin), less the median step"),
            ("survivors' step while the joiner catches up / while it was down", f.get("catchup_step_ratio"),
             "target <= 1.1"),
            ("joiner: process start -> active (s)", f.get("join_s"),
             f"{fmt(f.get('join_from_registration_s'), '.1f')} s of it from its registration (Python, torch and "
             "the model up)"),
            ("catch-up transfer / plain socket copy", f.get("transfer_ratio"),
             f"{fmt(f.get('transfer_mbps'), '.0f')} vs {fmt(f.get('socket_copy_mbps'), '.0f')} MB/s, the copy "
             "measured while the job trains; target >= 0.5"),
            ("effective training time", f.get("effective_training_time"), ""),
            ("final states equal", f.get("final_equal"), "")]
    out = ["## Recovery on the HSDP demo shape: 3 replica groups x 2 ranks", "",
           f"`fthsdp bench recovery --json` (data: `docs/bench-data/recovery-hsdp.json`): the reference model, "
           f"{f.get('replicas')} groups x {f.get('ranks_per_replica')} ranks (FSDP2 inside), SIGKILL {f.get('kill')}"
           ", restart 2 s later.", "", "| figure | value | note |", "| --- | ---: | --- |"]
    out += [f"| {a} | {fmt(b, '.3f') if isinstance(b, float) else fmt(b)} | {n} |" for a, b, n in rows]
    out += ["", f"The joiner's rank 0 fetched {c.get('bytes', 0) / 1e6:.1f} MB (its shard of parameters and AdamW "
            f"state) in {fmt(c.get('transfer_s'), '.3f')} s from {', '.join(sorted(c.get('sources', {})))} at once, "
            f"for the snapshot of step {c.get('snapshot_step')}, and replayed {c.get('replayed')} kept step(s).", ""]
    return out


def section_recovery_double(doc: dict[str, Any] | None) -> list[str]:
    """Two groups killed at the same step (``fthsdp bench recovery --kill 1@20 --kill 2@20 --json``)."""
    f = (doc or {}).get("fthsdp")
    if not isinstance(f, dict):
        return []
    return ["## Two replica groups killed at the same step", "",
            f"`fthsdp bench recovery --kill 1@20 --kill 2@20 --json` (data: `docs/bench-data/recovery-double.json`): "
            f"the reference model, {f.get('replicas')} groups x {f.get('ranks_per_replica')} ranks, SIGKILL "
            f"{f.get('kill')}, restarts 2 s later. The last survivor's stall beyond a median step: "
            f"**{fmt(f.get('survivor_stall_s'))} s** (both deaths are confirmed by their own closed connections, "
            f"the second one's report counting against the epoch the first one's replaced: one report round, not a "
            f"heartbeat timeout, docs/design.md §4); first "
            f"restarted group's first joined step {fmt(f.get('rejoin_s'), '.1f')} s after the kill; effective "
            f"training time {fmt(f.get('effective_training_time'))}; final states equal: {fmt(f.get('final_equal'))}.",
            ""]


def section_warm_restarts(cold: dict[str, Any] | None, warm: dict[str, Any] | None,
                          notes: dict[str, Any] | None, spares: dict[str, Any] | None = None,
                          spares_warm: dict[str, Any] | None = None) -> list[str]:
    """A cold restart against a warm standby's release and a hot spare, invocations minutes apart
    (``--warm-restarts``, ``--spares 1``, both)."""
    runs: list[tuple[str, dict[str, Any]]] = []
    for name, doc in (("cold start", cold), ("warm standby", warm), ("hot spare (+1 group), cold restart", spares),
                      ("hot spare (+1 group), warm standby", spares_warm)):
        if isinstance(f := (doc or {}).get("fthsdp"), dict):
            runs.append((name, f))
    if not runs:
        return []
    out = ["## Warm restarts and spares", "",
           "`fthsdp bench recovery --json`, `fthsdp bench recovery --warm-restarts --json`, `fthsdp bench "
           "recovery --spares 1 --json` and `fthsdp bench recovery --spares 1 --warm-restarts --json` (data: "
           "`docs/bench-data/recovery-cold.json`, `recovery-warm.json`, `recovery-spares.json`, "
           "`recovery-spares-warm.json`): the reference model, 3 groups x 2 ranks (and one spare group of 2 ranks "
           "in the last two rows), SIGKILL of group 1 at step 20, restarted 2 s later, from a cold torchrun or by "
           "releasing its warm standby (docs/design.md §7, \"Warm restarts\" and \"Spares\"). With a spare, "
           "\"all replicas contributing\" is every data slot again: the spare trains the killed group's.", "",
           "| restart | kill -> restarted replica's first joined step (s) | kill -> all replicas contributing (s) | "
           "start (release) -> active (s) | registration -> active (s) | survivors' stall (s) | steady step (s) | "
           "effective training time | on plain's step | final states equal |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for name, f in runs:
        out.append(f"| {name} | {fmt(f.get('rejoin_s'), '.2f')} | {fmt(f.get('back_to_full_s'), '.2f')} | "
                   f"{fmt(f.get('join_s'), '.2f')} | {fmt(f.get('join_from_registration_s'), '.2f')} | "
                   f"{fmt(f.get('survivor_stall_s'), '.2f')} | {fmt(f.get('step_s'), '.3f')} | "
                   f"{fmt(f.get('effective_training_time'))} | {fmt(f.get('ett_common_step'))} | "
                   f"{fmt(f.get('final_equal'))} |")
    out.append("")
    out += paragraphs(notes, "warm", "spares")
    return out


def section_catchup(doc: dict[str, Any] | None, notes: dict[str, Any] | None) -> list[str]:
    """The catch-up on a state large enough to time (``fthsdp bench catchup --mb 512 --json``)."""
    if not doc:
        return []
    out = ["## Catch-up at scale", "",
           f"`fthsdp bench catchup --mb {doc['mb']:.0f} --json` (data: `docs/bench-data/catchup.json`): one source "
           f"process trains the {doc['model']} model (one thread) and serves a synthetic {doc['bytes'] / 1e6:.0f} MB "
           f"state; the joiner fetches it {doc['repeats']} times, against as many plain loopback socket copies of the "
           "same bytes between two processes in the same run (`fthsdp.bench.catchup`). "
           + ("The source's training thread has a core of its own; its catch-up threads, the joiner and the socket "
              "copies share the other (a real host's other cores and the joiner's machine). " if doc.get("pinned")
              else "Unpinned. ")
           + f"Measured at {doc['measured_at']}, 1-minute load {doc['loadavg_1min']} before.", "",
           "| figure | value | note |", "| --- | ---: | --- |",
           f"| transfer / plain socket copy | {fmt(doc['transfer_ratio'])} | {fmt(doc['transfer_mbps'], '.0f')} vs "
           f"{fmt(doc['socket_copy_mbps'], '.0f')} MB/s, best of {doc['repeats']} each (fetches "
           f"{', '.join(fmt(x, '.0f') for x in doc['fetch_mbps_all'])}; copies "
           f"{', '.join(fmt(x, '.0f') for x in doc['socket_copy_mbps_all'])}); target >= 0.6 |",
           f"| source's step while serving / steady | {fmt(doc['serve_step_ratio'])} | {fmt(doc['serving_step_s'])} "
           f"vs {fmt(doc['steady_step_s'])} s ({doc['serving_steps']} vs {doc['steady_steps']} steps); while copying "
           f"{fmt(doc.get('copying_step_s'))} s, while sending {fmt(doc.get('sending_step_s'))} s; target <= 1.05 |",
           f"| request -> manifest (the snapshot's copy and digest) | "
           f"{', '.join(fmt(x, '.2f') for x in doc['snapshot_wait_s'])} s | per fetch |", ""]
    out += paragraphs(notes, "catchup")
    return out


def section_straggler(doc: dict[str, Any] | None, notes: dict[str, Any] | None) -> list[str]:
    """One replica made slow (``fthsdp bench straggler --json``)."""
    if not doc:
        return []
    out = ["## A slow replica (fail-slow)", "",
           f"`fthsdp bench straggler --json` (data: `docs/bench-data/straggler.json`): the {doc['model']} model, "
           f"{doc['replicas']} replica groups x 1 rank, {doc['steps']} steps; replica 2 computes {doc['factor']}x as "
           f"long from step {doc['slow_from']}. Throughput in samples per second, from a survivor's rows.", "",
           "| figure | value | note |", "| --- | ---: | --- |",
           f"| steps from the slowdown until the status names it | {fmt(doc['detect_steps'])} | target <= 10 |",
           f"| flags raised on the same job with no straggler | {len(doc['false_flags'])} | target 0 |",
           f"| doing nothing: throughput / healthy 3-replica job | {fmt(doc['throughput_do_nothing_ratio'])} | "
           f"{fmt(doc['throughput_do_nothing'])} vs {fmt(doc['throughput_healthy'])} |",
           f"| ejected: throughput / healthy 2-replica job | {fmt(doc['throughput_after_ratio'])} | "
           f"{fmt(doc['throughput_after_eject'])} vs {fmt(doc['throughput_healthy_2'])}, from "
           f"{fmt(doc.get('settle_s'), '.0f')} s after its next incarnation registered; target >= 0.9 |",
           f"| ejected, its restart on these 2 cores included | {fmt(doc.get('throughput_after_incl_restart_ratio'))} "
           "| from the third step without it |", ""]
    out += paragraphs(notes, "straggler")
    return out


def section_checkpoint(doc: dict[str, Any] | None, notes: dict[str, Any] | None) -> list[str]:
    """Periodic checkpoints on the training thread and behind the steps (``fthsdp bench checkpoint --json``)."""
    if not doc:
        return []
    out = ["## Checkpoints off the step", "",
           f"`fthsdp bench checkpoint --json` (data: `docs/bench-data/checkpoint.json`): the {doc['model']} model, "
           f"{doc['replicas']} replica groups x {doc['ranks_per_replica']} ranks, {doc['steps']} steps, a checkpoint "
           f"every {doc['every']} steps; the steps a checkpoint touches (the one it is taken at and the "
           f"{doc['window']} after it) against the same run's other steps.", "",
           "| mode | step during a checkpoint | steady step | ratio | checkpoints |",
           "| --- | ---: | ---: | ---: | ---: |"]
    out += [f"| {x['mode']} | {fmt(x['during_s'], '.3f')} s | {fmt(x['steady_s'], '.3f')} s | {fmt(x['ratio'])} | "
            f"{x['checkpoints']} |" for x in doc["runs"]]
    out.append("")
    out += paragraphs(notes, "checkpoint")
    return out


def section_lanes(docs: list[dict[str, Any]], notes: dict[str, Any] | None) -> list[str]:
    """The lanes' rebuild after a death (``fthsdp bench lighthouse --ranks-per-group R``: ``lanes``)."""
    rows = [lane for doc in docs for lane in doc.get("lanes") or []]
    if not rows:
        return []
    out = ["## Lanes after a death: on their members' stores, or on the lighthouse", "",
           "`fthsdp bench lighthouse --replicas N --ranks-per-group R [--lane-backend nccl] --json` (data: "
           f"`docs/bench-data/{{{','.join(LANES)}}}`, their `lanes`; `fthsdp/bench/lane_rebuild.py`): a real "
           "lighthouse process with a job token, N emulated replica groups, and a sample of the job's R lanes "
           "emulated whole (`fthsdp/bench/lanes.py`: every member of each runs the runtime's own rendezvous code "
           "against the real stores with their real authentication, and the store calls of the backend's own "
           "connect, no tensors), over two worker processes, each with a process of its own for its replicas' "
           "lane stores (`fthsdp/bench/lane_stores.py`). Each death SIGKILLs the replica hosting lane 0 (with "
           "member hosting its lanes move); *rebuild* = kill -> the sampled lane's last survivor done, over every "
           "sampled lane and death; *lighthouse calls* = rendezvous calls the lighthouse served per death, for the "
           "sample and projected to every lane; *at least* = those calls at the lighthouse's measured CPU per call, "
           "one at a time. Both ways of meeting run in the same invocation, members first.", "",
           "| N x R | backend | lanes emulated | members: rebuild p50 / p99 (s) | members: lighthouse calls | "
           "lighthouse: rebuild p99 of the sample (s) | lighthouse: calls (sample / every lane) | lighthouse: at "
           "least (s) | errors | load (1 min) |",
           "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for lane in rows:
        mine, base = lane["members"], lane["lighthouse"]
        out.append(f"| {lane['replicas']:,} x {lane['ranks_per_group']:,} | {mine['backend']} | "
                   f"{mine['lanes_sampled']} of {mine['lanes_total']:,} | {fmt(mine['lane_rebuild_p50_s'], '.2f')} / "
                   f"{fmt(mine['lane_rebuild_p99_s'], '.2f')} | {fmt(mine['lighthouse_calls_per_change'], '.0f')} | "
                   f"{fmt(base['lane_rebuild_p99_s'], '.2f')} | {fmt(base['lighthouse_calls_per_change'], '.0f')} / "
                   f"{fmt(base['lighthouse_calls_per_change_projected'], ',.0f')} | "
                   f"{fmt(base['lighthouse_rebuild_projected_s'], '.0f')} | "
                   f"{len(mine['errors']) + len(base['errors'])} | {lane.get('loadavg_1min', '–')} |")
    out.append("")
    out += paragraphs(notes, "lanes")
    return out


def section_failover(doc: dict[str, Any] | None, notes: dict[str, Any] | None) -> list[str]:
    """The leader lighthouse SIGKILLed (``fthsdp bench failover --json``)."""
    if not doc:
        return []
    out = ["## Lighthouse failover", "",
           "`fthsdp bench failover --json` (data: `docs/bench-data/failover.json`; `fthsdp/bench/failover.py`): two "
           f"lighthouse processes on one loopback etcd, {doc['members']} replica clients (the runtime's "
           "`LighthouseClient`, given both addresses) active in one epoch; the leader is SIGKILLed and at that "
           "instant one more replica starts joining. Times from the kill, median of "
           f"{doc['rounds']} failovers of each arm (alternating which goes first), election TTL "
           f"{doc['election_ttl_s']} s, heartbeat timeout {doc['heartbeat_timeout_s']:g} s, 1-minute load "
           f"{doc['loadavg_before']} before the run. *knock*: the default, a follower knocking on the leader's port "
           f"every {doc['election_probe_s']:g} s takes over when it refuses twice; *lease*: `--election-probe 0`, "
           "the leader's lease has to expire.", "",
           "| arm | follower leads | every member heartbeats to it | the next epoch at every member |",
           "| --- | ---: | ---: | ---: |"]
    for arm, m in doc["medians"].items():
        out.append(f"| {arm} | {fmt(m['lead_s'], '.2f')} s | {fmt(m['reconnect_s'], '.2f')} s | "
                   f"{fmt(m['epoch_s'], '.2f')} s |")
    out += ["", f"`failover_median_s` (the next epoch at every member, knock): **{fmt(doc['failover_median_s'], '.2f')}"
            f" s** (target <= 2 s); knock over lease: {fmt(doc['ratio_epoch_s'])}.", ""]
    out += paragraphs(notes, "failover")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--import", dest="import_dir", default="", help="copy known JSONs from here first")
    ap.add_argument("--data", default=str(ROOT / "docs" / "bench-data"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks.md"))
    a = ap.parse_args(argv)
    data = pathlib.Path(a.data)
    data.mkdir(parents=True, exist_ok=True)
    if a.import_dir:
        src = pathlib.Path(a.import_dir)
        for name in KNOWN:
            if (src / name).exists():
                if _read(src / name) is None:
                    print(f"skipped {src / name}: empty or not JSON")
                    continue
                shutil.copyfile(src / name, data / name)
                print(f"imported {src / name}")
    out = pathlib.Path(a.out)
    img = out.parent / "img"
    img.mkdir(parents=True, exist_ok=True)
    rec, base = load(data, "recovery.json"), load(data, "baselines.json")
    notes = load(data, "notes.json")
    lines = ["# Benchmarks", "",
             "<!-- Generated by python -m fthsdp.bench.docs (make benchmarks-doc) from docs/bench-data/*.json; "
             "do not edit by hand. -->", "",
             "Measured on the development machine: 2 CPU cores shared by every process (the replicas, the "
             "lighthouse, the emulator, and whatever else runs), Gloo over loopback. Absolute times drift 10-15% "
             "between identical runs here (more when the machine is busy), so every comparison is a ratio or a "
             "side-by-side taken in the same invocation.", ""]
    if notes and notes.get("conditions"):
        for para in notes["conditions"]:
            lines += [para, ""]
    lines += section_recovery(rec, base, img)
    lines += section_recovery_vs_hsdp(load(data, "recovery-vs-hsdp.json"), notes)
    lines += section_recovery_hsdp(load(data, "recovery-hsdp.json"))
    lines += section_recovery_double(load(data, "recovery-double.json"))
    lines += section_warm_restarts(load(data, "recovery-cold.json"), load(data, "recovery-warm.json"), notes,
                                   load(data, "recovery-spares.json"), load(data, "recovery-spares-warm.json"))
    lines += section_catchup(load(data, "catchup.json"), notes)
    lines += section_lighthouse(load(data, "lighthouse.json"), load(data, "saturation.json"), notes, img)
    lines += section_lanes([d for d in (load(data, name) for name in LANES) if d], notes)
    lines += section_failover(load(data, "failover.json"), notes)
    lines += section_sim(rec, base, img)
    lines += section_other(load(data, "overhead.json"), load(data, "ftar.json"))
    lines += section_timeline(load(data, "overhead-timeline.json"), notes)
    lines += section_layouts([d for d in (load(data, f"overhead-{x}.json") for x in ("tp2", "pp2")) if d], notes)
    lines += section_straggler(load(data, "straggler.json"), notes)
    lines += section_checkpoint(load(data, "checkpoint.json"), notes)
    lines += ["## Regenerating", "", "```bash",
              "mkdir -p out/bench",
              ".venv/bin/fthsdp bench recovery --vs torchft --json > out/bench/recovery.json   # < 15 min",
              ".venv/bin/fthsdp bench recovery --vs torchft --ranks 2 --json > out/bench/recovery-vs-hsdp.json",
              ".venv/bin/fthsdp bench recovery --json > out/bench/recovery-hsdp.json",
              ".venv/bin/fthsdp bench recovery --json > out/bench/recovery-cold.json",
              ".venv/bin/fthsdp bench recovery --warm-restarts --json > out/bench/recovery-warm.json",
              ".venv/bin/fthsdp bench recovery --spares 1 --json > out/bench/recovery-spares.json",
              ".venv/bin/fthsdp bench recovery --spares 1 --warm-restarts --json "
              "> out/bench/recovery-spares-warm.json",
              ".venv/bin/fthsdp bench lighthouse --replicas 1000 5000 10000 --vs torchft --json "
              "> out/bench/lighthouse.json",
              ".venv/bin/fthsdp bench lighthouse --replicas 12 --ranks-per-group 8192 --deaths 1 --json "
              "> out/bench/lanes-12x8192.json",
              ".venv/bin/fthsdp bench lighthouse --replicas 12 --ranks-per-group 8192 --deaths 1 --lanes 4 --json "
              "> out/bench/lanes-12x8192-4lanes.json",
              ".venv/bin/fthsdp bench lighthouse --replicas 12 --ranks-per-group 8192 --deaths 1 --lane-backend nccl "
              "--json > out/bench/lanes-12x8192-nccl.json",
              ".venv/bin/fthsdp bench lighthouse --replicas 1000 --ranks-per-group 8 --deaths 1 "
              "--lane-backend nccl --json > out/bench/lanes-1000x8-nccl.json",
              ".venv/bin/fthsdp bench failover --json > out/bench/failover.json",
              ".venv/bin/fthsdp bench straggler --json > out/bench/straggler.json",
              ".venv/bin/fthsdp bench overhead --against timeline-off --rounds 5 --json "
              "> out/bench/overhead-timeline.json",
              ".venv/bin/fthsdp bench overhead --layout tp2 --replicas 2 --ranks 4 --json "
              "> out/bench/overhead-tp2.json",
              ".venv/bin/fthsdp bench overhead --layout pp2 --json > out/bench/overhead-pp2.json",
              ".venv/bin/fthsdp bench catchup --mb 512 --json > out/bench/catchup.json",
              ".venv/bin/fthsdp bench checkpoint --rounds 2 --json > out/bench/checkpoint.json",
              "make benchmarks-doc    # copies out/bench/*.json to docs/bench-data/, rewrites this page and its plots",
              "```", ""]
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
