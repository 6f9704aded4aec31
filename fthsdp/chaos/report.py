"""The text of chaos results: one line per run, a summary of a soak; the kind a fault is counted under; and the
command's exit status."""

from __future__ import annotations

from typing import Any


def kind_key(x: dict[str, Any]) -> str:
    """The kind an injected fault is counted under (a kill by its last phase: ``kill@serve``)."""
    if x["kind"] == "kill":
        return f"kill@{x['phases'][-1]}"
    return str(x["kind"])


def fail_slow_violations(named: list[dict[str, Any]]) -> list[str]:
    """A violation per replica the lighthouse named as a straggler during a chaos run (its first flag, with the
    evidence): no chaos fault makes a replica slow, and the trainers' compute is a steady stand-in
    (``ChaosConfig.compute_s``), so any flag is a false one."""
    first: dict[str, dict[str, Any]] = {}
    for x in named:
        first.setdefault(x["replica"], x)
    return [f"fail-slow: {r} named a straggler, no fault made it slow: {x['text']}" for r, x in sorted(first.items())]


def summary_text(s: dict[str, Any]) -> str:
    """A soak's summary (``soak``'s result): runs, faults by kind, violations."""
    seeds = s["seeds"]
    named = "" if not seeds else f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {seeds[0]}..{seeds[-1]}"
    lines = [(f"chaos: {s['runs']} run(s) ({named}), "
              f"{s['faults_injected']} fault(s) injected in {s['wall_s']}s, {s['not_fired']} armed but not fired")]
    for kind, n in sorted(s["by_kind"].items()):
        lines.append(f"  {kind:<16} {n}")
    if s["violations"]:
        lines.append(f"VIOLATIONS in {len(s['violations'])} run(s):")
        for seed, vs in s["violations"].items():
            for v in vs:
                lines.append(f"  seed {seed}: {v}")
    else:
        lines.append("invariants: all held (converged, survivors, exactly-once, no lost step, epochs increasing, "
                     "only the failed replica pays)")
    return "\n".join(lines)


def exit_code(s: dict[str, Any]) -> int:
    """``fthsdp chaos``'s exit status for a soak's summary: 1 when any run broke an invariant (or could not be
    checked: its violations say why), else 0."""
    return 1 if s["violations"] else 0


def result_text(r: dict[str, Any]) -> str:
    """One run's line (``run_chaos``'s result)."""
    inj = "; ".join(x["describe"] for x in r["injected"]) or "none"
    return (f"seed {r['seed']}{' (ha)' if r['ha'] else ''}: {len(r['injected'])} injected [{inj}], "
            f"{len(r['not_fired'])} not fired, {len(r['violations'])} violation(s), {r['wall_s']}s")
