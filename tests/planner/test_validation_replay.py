"""The calibrated simulator against fixed recorded runs: small-llava measured on this machine by
`python bench/planner_validation.py` (three methods, six rates, each sweep three times over, each
run with images of its own), kept with what their calibration was found from. Here each is
calibrated again by the code as it is (`recalibrate`) and replayed by the simulator as it is, so a
change to either that makes the model worse on real measurements fails, with no deployment to run.

tests/data/planner_validation/run8, run9 and run10: three runs of the same command (run 10 with
three times the calibration load), the workers' threads as `trident up` gives them (a share of the
cores each, and the core board), every step recording its threads and the other steps beside it;
runs 9 and 10 also keep each request's stage marks. Each is held to the issue's CI bound, 35 % of
the measured medians, on goodput, the pick, and TTFT p90 and TBT p90 at the rates each deployment
runs at.

tests/data/planner_validation/run12: tiny-llava (EP+D, text only and half one image), where what a
request costs outside the engines decides capacity; held to the issue's 20 % on goodput, and the
text run shown to miss by more without that cost.

docs/planner.md, "Validation", has the runs, and where the figures still miss the 20 % goal."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from common.stats import SLO
from trident.bench.validation import goodput, replay_folder, summary

pytestmark = pytest.mark.slow  # every recorded validation run replayed: `make test`, not the fast tier

DATA = Path(__file__).resolve().parents[1] / "data"
BOUND = 0.35
RUNS = ("planner_validation/run8", "planner_validation/run9", "planner_validation/run10")


@pytest.fixture(scope="module", params=RUNS)
def recorded(request) -> dict:
    root = DATA / request.param
    folders = sorted(p.parent for p in root.glob("*/calibration.json"))
    assert len(folders) == 3, f"the recorded run is missing under {root}"
    runs = [replay_folder(folder, recalibrated=True) for folder in folders]  # at their SLOs
    slo = json.loads((folders[0] / "calibration.json").read_text())["slo"]
    return summary(runs, SLO(**slo))


def test_goodput_predictions_hold_to_35_percent_and_the_pick_is_within_a_step(recorded) -> None:
    report = recorded
    for name, g in report["goodput"].items():
        assert abs(g["error"]) <= BOUND, f"{name}: {g}"
    assert abs(report["pick"]["error"]) <= BOUND, report["pick"]
    assert all(report["pick"]["within_one_step"]), report["pick"]


def test_latency_predictions_hold_at_the_rates_a_deployment_runs_at(recorded) -> None:
    report = recorded
    in_range = [r for r in report["runs"] if r["in_range"]]
    assert len(in_range) >= 12
    for run in in_range:
        where = f"{run['method']} at {run['rate']} req/s"
        assert abs(run["errors"]["tbt_p90"]) <= BOUND, f"{where}: TBT p90 {run['errors']['tbt_p90']:+.0%}"
        assert abs(run["errors"]["ttft_p90"]) <= BOUND, f"{where}: TTFT p90 {run['errors']['ttft_p90']:+.0%}"


def test_goodput_is_read_between_the_swept_rates() -> None:
    rates = [1.0, 2.0, 3.0, 4.0]
    assert goodput(rates, [1.0, 1.0, 1.0, 1.0], 0.9) == 4.0  # every rate meets it: the top one
    assert goodput(rates, [0.5, 0.4, 0.3, 0.2], 0.9) == 0.0  # none does
    assert goodput(rates, [1.0, 0.95, 0.85, 0.2], 0.9) == 2.5  # halfway from 0.95 down to 0.85
    assert goodput(rates, [1.0, 0.9, 1.0, 1.0], 0.9) == 4.0  # exactly the target counts as met
    assert goodput(rates, [1.0, 0.8, 1.0, 1.0], 0.9) == 1.5  # the first miss ends it


def test_slower_steps_lengthen_every_prediction() -> None:
    """`replay_folder(slower=K)`, behind `bench/planner_validation.py --sensitivity K`: the same
    requests on steps K times as long are predicted no faster at any rate, and the unloaded TTFT,
    mostly compute, grows with them."""
    folder = DATA / "planner_validation/run9/small-llava-ep-d"
    base, slower = (replay_folder(folder, slower=k)[3] for k in (1.0, 1.2))
    for b, s in zip(base, slower, strict=True):
        for name in ("ttft_p50", "ttft_p90", "tbt_p90"):
            assert s.predicted[name] >= b.predicted[name], (b.rate, name, b.predicted, s.predicted)
    assert slower[0].predicted["ttft_p50"] >= 1.08 * base[0].predicted["ttft_p50"]


# tiny-llava, EP+D, one repeat each of text only and of half one image (docs/planner.md, run 12):
# there the CPU a request costs outside the engines is most of its cost.
TINY = ("planner_validation/run12/tiny-llava-ep-d-text", "planner_validation/run12/tiny-llava-ep-d-mix")


def _tiny_goodput(folder: Path) -> dict:
    run = replay_folder(folder, recalibrated=True)
    slo = json.loads((folder / "calibration.json").read_text())["slo"]
    (found,) = summary([run], SLO(**slo))["goodput"].values()
    return found


@pytest.mark.parametrize("name", TINY)
def test_tiny_llava_capacity_holds_with_the_cost_outside_the_engines(name: str) -> None:
    """The issue's goal, 20 %, on the predicted capacity of a model whose steps take a millisecond."""
    found = _tiny_goodput(DATA / name)
    assert abs(found["error"]) <= 0.20, found


def test_without_that_cost_tiny_llava_capacity_is_overpredicted(tmp_path: Path) -> None:
    """The same text run with the cost left out, as the model was before: +55 %."""
    folder = tmp_path / "text"
    shutil.copytree(DATA / TINY[0], folder)
    calibration = json.loads((folder / "calibration.json").read_text())
    calibration["host_cpu"] = None
    (folder / "calibration.json").write_text(json.dumps(calibration))
    found = _tiny_goodput(folder)
    assert found["error"] > 0.35, found
