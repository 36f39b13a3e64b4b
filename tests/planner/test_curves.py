"""A profile's latency curves: the shapes the simulator replays from measured points."""

from __future__ import annotations

import pytest

from common.planner.profiles import StageCurves

PREFILL = ((16, 0.01), (1024, 0.5))


def curves(decode) -> StageCurves:
    return StageCurves(encode=(), prefill=PREFILL, decode=tuple(decode), num_kv_blocks=64)


def test_a_decode_step_costs_what_its_batch_size_measured_though_a_line_would_not_fit():
    """A CPU's kernels change path with the batch (2 sequences dearer than 4): each measured size
    is taken as measured, its context part apart, and sizes between are interpolated."""
    per_context = 1e-6
    base = {1: 0.030, 2: 0.052, 3: 0.066, 4: 0.047, 8: 0.056}
    measured = [(b, c, s + per_context * b * c) for b, s in base.items() for c in (64, 1024)]
    c = curves(measured)
    for batch, seconds in base.items():
        for context in (64, 500, 1024):
            assert c.decode_time(batch, context) == pytest.approx(
                seconds + per_context * batch * context, rel=0.02
            )
    assert c.decode_time(6, 64) == pytest.approx((0.047 + 0.056) / 2 + 6 * 64 * per_context, rel=0.02)
    assert c.decode_time(0, 64) == 0.0


def test_past_the_largest_batch_measured_a_decode_step_grows_by_the_fitted_slope():
    line = [(b, 64, 0.02 + 0.001 * b) for b in (1, 2, 4, 8)]
    c = curves(line)
    assert c.decode_time(16, 64) == pytest.approx(0.02 + 0.016, rel=0.01)
    assert c.decode_time(8, 64) == pytest.approx(0.028, rel=0.01)
