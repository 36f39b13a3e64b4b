"""A PNG bar chart of a plan: goodput per candidate deployment, the chosen one highlighted."""

from __future__ import annotations

import io

from common.planner.types import PlanResult

CHOSEN, OTHER = "#d62728", "#7f9fbf"


def goodput_chart(result: PlanResult, title: str = "") -> bytes:
    """Candidates in the plan's order (best first). matplotlib is imported here, with the Agg backend,
    so importing this module costs nothing and no display is ever needed."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    labels = [c.deployment.label for c in result.candidates]
    # A pruned candidate shows its throughput bound, hatched: its goodput is at most that.
    values = [c.bound if c.pruned else c.goodput for c in result.candidates]
    colors = [CHOSEN if c.deployment == result.deployment else OTHER for c in result.candidates]
    fig = Figure(figsize=(max(4.0, 0.5 * len(labels) + 1.5), 3.6), dpi=100)
    ax = fig.add_subplot()
    bars = ax.bar(range(len(labels)), values, color=colors)
    for bar, c in zip(bars, result.candidates, strict=True):
        if c.pruned:
            bar.set_fill(False)
            bar.set_hatch("//")
    ax.set_xticks(range(len(labels)), labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("goodput (requests/s)")
    slo = result.inputs.get("slo", {})
    subtitle = f"TTFT ≤ {slo['ttft']:g} s, TBT ≤ {slo['tbt']:g} s" if {"ttft", "tbt"} <= slo.keys() else ""
    chosen = f"chosen: {result.deployment.label} ({result.deployment.method}), {result.goodput:.3g} req/s"
    ax.set_title("\n".join(t for t in (title, chosen, subtitle) if t), fontsize=9)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
