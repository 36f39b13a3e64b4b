"""The simulator against a real deployment on this machine (issue 5): E+P+D on the tiny model at
three rates, calibrated on unloaded requests first (trident/bench/validation.py).

The issue's goal is 20 % on TTFT p50/p90 and TBT p90. On this 2-core machine the gateway, the client
and the workers share the cores, and two runs of the same requests differ by up to 28 %
(`python bench/planner_validation.py`; docs/planner.md, "Validation"). A test at 20 % would fail at
random however good the prediction, so this one holds it to within a factor of three of the
measurement: it catches a simulator or calibration that is broken, not one that is imprecise.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from common.stats import SLO
from tests.deploy import WARM
from trident.bench.validation import METRICS
from trident.bench.validation_run import Validation, validate

FACTOR = 3.0
RATES = (2.0, 4.0)  # light and loaded; bench/planner_validation.py sweeps more
REQUESTS = 16  # per rate
CALIBRATION = 8  # requests one at a time, then as many at the middle rate (ratios stayed within 0.6-1.5)


@pytest.mark.alone  # real latencies against simulated ones: beside a lane, a cold step's outlier was 3.5x
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_simulated_latencies_are_within_a_factor_of_a_real_deployment(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    method = "e+p+d"
    run = Validation(
        method, RATES, REQUESTS, SLO(ttft=5.0, tbt=0.5), calibration=CALIBRATION, calibration_load=CALIBRATION
    )
    calibration, comparisons = validate(tiny_model_dir, tmp_path, run, starter=WARM)
    assert [c.rate for c in comparisons] == list(RATES)
    for c in comparisons:
        # Each request's stage marks kept beside it, from its arrival on.
        assert [len(m) for m in c.marks] == [len(r) for r in c.runs]
        assert all(m["arrival"] == 0 and m["first_token"] > 0 for run in c.marks for m in run)
        for metric in METRICS:
            measured = c.measured[metric]
            ratio = c.predicted[metric] / measured
            error = ratio - 1
            assert 1 / FACTOR <= ratio <= FACTOR, (
                f"{method} at {c.rate} req/s: {metric} measured {c.measured[metric] * 1000:.1f} ms, "
                f"predicted {c.predicted[metric] * 1000:.1f} ms ({error:+.0%}); calibration {calibration}"
            )
