"""The calibrated simulator against a fixed recorded run: small-llava measured on this machine by
`python bench/planner_validation.py` (three methods, six rates, each sweep three times over) and
kept under tests/data/planner_validation/ with the calibration that run found. Replayed here by the
simulator as it is now, the predictions must stay within 35 % of the measured medians (the issue's
CI bound; the benchmark holds the 20 % goal): a change to the simulator or to the calibration
that makes the model worse on real measurements fails this, without a deployment to run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.stats import SLO
from tests.planner.validation import replay_folder, summary

RECORDED = Path(__file__).resolve().parents[1] / "data" / "planner_validation"
BOUND = 0.35


@pytest.fixture(scope="module")
def report() -> dict:
    folders = sorted(p.parent for p in RECORDED.glob("*/calibration.json"))
    assert len(folders) >= 2, f"no recorded runs under {RECORDED}"
    runs = [replay_folder(folder) for folder in folders]  # each at the SLOs it was measured with
    slo = json.loads((folders[0] / "calibration.json").read_text())["slo"]
    return summary(runs, SLO(**slo))


def test_latency_predictions_hold_to_35_percent_of_the_measured_medians(report: dict) -> None:
    for run in (r for r in report["runs"] if r["in_range"]):  # the rates a deployment runs at
        for metric in ("ttft_p90", "tbt_p90"):
            error = run["errors"][metric]
            assert abs(error) <= BOUND, (
                f"{run['method']} at {run['rate']} req/s: {metric} {error:+.0%} ({run})"
            )


def test_goodput_predictions_hold_to_35_percent_and_the_pick_is_within_a_step(report: dict) -> None:
    for name, g in report["goodput"].items():
        assert abs(g["error"]) <= BOUND, f"{name}: {g}"
    assert all(report["pick"]["within_one_step"]), report["pick"]


def test_goodput_is_read_between_the_swept_rates() -> None:
    from tests.planner.validation import goodput

    rates = [1.0, 2.0, 3.0, 4.0]
    assert goodput(rates, [1.0, 1.0, 1.0, 1.0], 0.9) == 4.0  # every rate meets it: the top one
    assert goodput(rates, [0.5, 0.4, 0.3, 0.2], 0.9) == 0.0  # none does
    assert goodput(rates, [1.0, 0.95, 0.85, 0.2], 0.9) == 2.5  # halfway from 0.95 down to 0.85
    assert goodput(rates, [1.0, 0.9, 1.0, 1.0], 0.9) == 4.0  # exactly the target counts as met
    assert goodput(rates, [1.0, 0.8, 1.0, 1.0], 0.9) == 1.5  # the first miss ends it
