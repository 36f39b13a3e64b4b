"""The bench's arithmetic on hand-made results: the SLO verdict, attainment, summaries, goodput."""

from __future__ import annotations

import math

import pytest

from common.stats import SLO
from trident.bench.metrics import RequestResult, attainment, goodput, summarise
from trident.bench.sweep import parse_rates

SLO_ = SLO(ttft=1.0, tbt=0.1)


def result(i: int, ttft: float, tbts: list[float], ok: bool = True, out: int = 0) -> RequestResult:
    return RequestResult(
        index=i, scheduled=float(i), sent=float(i), ok=ok, ttft=ttft,
        e2e=ttft + sum(tbts), tbts=tbts, output_tokens=out or len(tbts) + 1,
        error="" if ok else "http 503: no decode instance",
    )  # fmt: skip


def test_a_request_meets_its_slo_only_with_ttft_and_90_percent_of_its_tbts_within():
    within = [0.05] * 9 + [0.5]  # the one slow gap is the 10 %: p90 of ten gaps interpolates
    assert result(0, 0.9, [0.05] * 10).meets(SLO_)
    assert not result(0, 1.1, [0.05] * 10).meets(SLO_)  # TTFT over
    assert not result(0, 0.5, [0.05] * 8 + [0.5, 0.5]).meets(SLO_)  # 20 % of gaps over
    assert result(0, 0.5, [0.05] * 19 + [0.5]).meets(SLO_)  # 5 % over
    assert not result(0, 0.5, within, ok=False).meets(SLO_)  # failed requests never meet it
    assert result(0, 0.5, []).meets(SLO_)  # one token: no gap to judge


def test_attainment_counts_failures_as_misses():
    rs = [
        result(0, 0.2, [0.01]),
        result(1, 2.0, [0.01]),
        result(2, 0.2, [0.01], ok=False),
        result(3, 0.3, []),
    ]
    assert attainment(rs, SLO_) == 0.5
    assert attainment([], SLO_) == 0.0


def test_goodput_is_the_highest_rate_with_every_lower_rate_meeting_the_target():
    assert goodput([(1, 1.0), (2, 0.95), (3, 0.9), (4, 0.5)]) == 3
    assert goodput([(4, 0.5), (1, 1.0), (3, 0.92), (2, 0.95)]) == 3  # order does not matter
    assert goodput([(1, 1.0), (2, 0.8), (3, 0.95)]) == 1  # a lucky rate above a failing one does not count
    assert goodput([(1, 0.89), (2, 0.5)]) == 0.0
    assert goodput([(1, 1.0), (2, 0.85)], target=0.8) == 2


def test_summary_of_a_hand_made_run():
    rs = [result(i, ttft=0.2 * (i + 1), tbts=[0.01, 0.03]) for i in range(10)]  # 0.2 .. 2.0 s
    rs.append(result(10, ttft=math.nan, tbts=[], ok=False))
    s = summarise(2.0, rs, SLO_)
    assert (s.sent, s.completed, s.failed) == (11, 10, 1)
    assert s.attainment == pytest.approx(5 / 11)  # TTFT 0.2 .. 1.0 s meet it (1.0 included)
    assert s.ttft_p50 == pytest.approx(1.1)
    assert s.ttft_p90 == pytest.approx(1.82)
    assert s.tbt_p50 == pytest.approx(0.02)
    assert s.errors == {"http 503": 1}
    # The first send is at 0; the last answer at 9 + 2.0 + 0.04.
    assert s.duration == pytest.approx(11.04)
    assert s.throughput == pytest.approx(10 / 11.04, rel=1e-3)
    assert s.output_tokens_per_s == pytest.approx(30 / 11.04, rel=1e-3)


def test_results_survive_a_round_trip_through_json():
    r = result(3, math.nan, [], ok=False)
    assert RequestResult.from_dict(r.to_dict()).error == r.error
    assert r.to_dict()["ttft"] is None


def test_rates_from_rate_or_sweep():
    assert parse_rates(2.0, None) == (2.0,)
    assert parse_rates(None, "1:3:0.5") == (1.0, 1.5, 2.0, 2.5, 3.0)
    assert parse_rates(None, "0.1:0.3:0.1") == (0.1, 0.2, 0.3)
    for bad in ((None, None), (1.0, "1:2:1"), (None, "3:1:1"), (None, "1:2"), (None, "a:b:c"), (0.0, None)):
        with pytest.raises(ValueError):
            parse_rates(*bad)
