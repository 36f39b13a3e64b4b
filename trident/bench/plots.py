"""The benchmark's pictures: SLO attainment against request rate (seed 000 Figure 9), and latency
CDFs (TTFT, TBT, end-to-end), one line per run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from common.stats import SLO
from trident.bench.metrics import RequestResult


def attainment_plot(series: Mapping[str, Sequence[tuple[float, float]]], slo: SLO, path: Path) -> None:
    """One line per system of (rate, attainment) points, with the target attainment marked."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, points in series.items():
        rates, reached = zip(*sorted(points), strict=True) if points else ((), ())
        ax.plot(rates, [100 * a for a in reached], marker="o", label=name)
    ax.axhline(100 * slo.attainment, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax.set_title(f"TTFT ≤ {slo.ttft:g} s, p90 TBT ≤ {slo.tbt:g} s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def cdf_plot(runs: Mapping[str, Sequence[RequestResult]], slo: SLO, path: Path) -> None:
    """TTFT, TBT (every gap) and end-to-end latency CDFs of each run's completed requests."""
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = (
        ("TTFT (s)", lambda rs: [r.ttft for r in rs], slo.ttft),
        ("TBT (s)", lambda rs: [g for r in rs for g in r.tbts], slo.tbt),
        ("end-to-end (s)", lambda rs: [r.e2e for r in rs], None),
    )
    for ax, (label, values, limit) in zip(axes, panels, strict=True):
        for name, results in runs.items():
            xs = np.sort(values([r for r in results if r.ok]))
            if len(xs):
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name)
        if limit is not None:
            ax.axvline(limit, color="grey", linestyle="--", linewidth=1)
        ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests" if label.startswith("TTFT") else "")
        ax.grid(alpha=0.3)
    axes[-1].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
