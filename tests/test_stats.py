"""One way to judge latency: the quantile is numpy's, and the SLO verdict treats a missing TBT as met."""

from __future__ import annotations

import numpy as np
import pytest

from common.stats import SLO, attainment, quantile, request_tbt, slo_met


@pytest.mark.parametrize("n", [1, 2, 5, 40])
@pytest.mark.parametrize("q", [0.0, 0.1, 0.5, 0.75, 0.9, 1.0])
def test_quantile_is_numpys_linear_method(n: int, q: float) -> None:
    values = np.random.default_rng(n).exponential(size=n).tolist()
    assert quantile(values, q) == pytest.approx(float(np.percentile(values, 100 * q)), rel=1e-12)


def test_no_values_have_no_quantile() -> None:
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_the_slo_verdict() -> None:
    slo = SLO(ttft=1.0, tbt=0.1)
    assert request_tbt([]) is None
    assert request_tbt([0.05] * 9 + [1.0]) == pytest.approx(0.1450)  # the 90th percentile, interpolated
    assert slo_met(0.5, None, slo)  # one token: no gap to judge
    assert slo_met(1.0, 0.1, slo)  # on the objective counts as met
    assert not slo_met(None, None, slo)  # never got a first token
    assert not slo_met(1.01, 0.05, slo)
    assert not slo_met(0.5, 0.11, slo)
    assert attainment([True, False, True, True]) == 0.75
    assert attainment([]) == 0.0
