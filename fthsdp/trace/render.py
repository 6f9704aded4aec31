"""A job's trace (``fthsdp.trace.chrome``) drawn as a PNG: one row per rank track, grouped by replica; compute spans
on the upper half of a row, the exchange's (buckets, the wait for the slowest peer) on the lower half; epochs and
kills as vertical lines."""

from __future__ import annotations

import pathlib
from typing import Any

from fthsdp.trace import chrome

COLOURS = {"compute": "#2e7d32", "exchange": "#1565c0", "wait": "#f9a825", "vote": "#6a1b9a",
           "optimizer": "#616161", "checkpoint": "#8d6e63"}
"""Per event category."""
LOWER = ("exchange", "wait")


def draw(doc: dict[str, Any], path: pathlib.Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = doc["traceEvents"]
    procs, threads = chrome.names(doc)
    rows = sorted(threads)
    row_of = {k: n for n, k in enumerate(rows)}
    spans: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for e in events:
        if e["ph"] == "X" and (e["pid"], e["tid"]) in row_of:
            spans.setdefault((row_of[(e["pid"], e["tid"])], e["cat"]), []).append((e["ts"] / 1e6, e["dur"] / 1e6))
    fig, ax = plt.subplots(figsize=(14, 2.5 + 0.45 * max(1, len(rows))))
    for (row, cat), xs in spans.items():
        y = row + (0.0 if cat in LOWER else -0.4)
        ax.broken_barh(xs, (y, 0.38), facecolors=COLOURS.get(cat, "#9e9e9e"), linewidth=0)
    for e in events:
        if e["ph"] == "i" and e.get("s") == "g":
            kill = e["cat"] == "launcher"
            ax.axvline(e["ts"] / 1e6, color="#c62828" if kill else "#455a64", lw=1.4 if kill else 0.8,
                       ls="-" if kill else ":")
            ax.text(e["ts"] / 1e6, -0.75, e["name"][:40], rotation=90, fontsize=6, va="bottom", ha="right",
                    color="#c62828" if kill else "#455a64")
    ax.set_yticks(range(len(rows)), [f"{procs.get(p, p)} {threads[(p, t)]}" for p, t in rows], fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -2.5)
    ax.set_xlabel("time (s)")
    ax.set_title(title or "fthsdp trace: every rank's steps (upper: compute, vote, optimizer; lower: exchange)")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items()], loc="upper center",
              bbox_to_anchor=(0.5, -0.5 / max(1, len(rows)) - 0.08), ncol=len(COLOURS), frameon=False)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
