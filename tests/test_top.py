"""`trident top`'s arithmetic: quantiles from Prometheus buckets as `histogram_quantile` makes them,
and the window since the previous frame."""

from __future__ import annotations

import math

import pytest

from trident.cli.top_view import Buckets, Frame, prefix_hit, routing_line

INF = math.inf


@pytest.mark.parametrize(
    ("counts", "q", "want"),
    [
        ([10, 20, 30, 30], 0.5, 0.15),  # rank 15: halfway through (0.1, 0.2]
        ([10, 20, 30, 30], 0.9, 0.41),  # rank 27: 70 % through (0.2, 0.5]
        ([10, 20, 30, 30], 0.1, 0.03),  # rank 3: 30 % through (0, 0.1]
        ([10, 10, 10, 20], 0.9, 0.5),  # past the last finite bound: that bound
        ([0, 0, 0, 0], 0.5, None),
    ],
)
def test_quantile_interpolates_inside_the_bucket(counts, q, want):
    got = Buckets([0.1, 0.2, 0.5, INF], counts).quantile(q)
    assert got == pytest.approx(want) if want is not None else got is None


def test_window_is_what_came_after_the_earlier_read():
    earlier = Buckets([0.1, INF], [5, 8])
    later = Buckets([0.1, INF], [6, 12])
    assert later.since(earlier).counts == [1, 4]
    assert later.since(None) is later
    restarted = Buckets([0.1, INF], [1, 1])  # fewer than before: the gateway restarted
    assert restarted.since(earlier) is restarted


def test_prefix_hit_is_the_share_found_cached_since_the_last_refresh():
    earlier = {"prefix_queried_tokens": 1000, "prefix_hit_tokens": 100}
    now = {"prefix_queried_tokens": 1400, "prefix_hit_tokens": 400}
    assert prefix_hit(now, earlier) == "75 %"  # 300 of the 400 looked up since
    assert prefix_hit(now, None) == "29 %"  # no earlier frame: since the instance started
    assert prefix_hit(earlier, now) == "10 %"  # it restarted (its counts went back): since then
    assert prefix_hit(now, now) == "-" and prefix_hit({}, None) == "-"  # nothing looked up


def test_the_routing_line_counts_decisions_since_the_last_refresh():
    def frame(routes: dict[str, float]) -> Frame:
        return Frame(0.0, [], None, {}, Buckets(), Buckets(), 0.0, routes)

    earlier = frame({"prefix": 4, "decoder": 1, "load": 1, "none": 10, "fallback": 0})
    now = frame({"prefix": 9, "decoder": 3, "load": 1, "none": 12, "fallback": 1})
    assert routing_line(now, earlier) == "routed: prefix 5  decoder 2  load 0  none 2  fallback 1"
    assert routing_line(now, None) == "routed: prefix 9  decoder 3  load 1  none 12  fallback 1"
    assert routing_line(frame({}), None) == "routed by prefix: off"  # TRIDENT_KV_ROUTING=false
