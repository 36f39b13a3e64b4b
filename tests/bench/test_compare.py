"""`trident bench compare`'s bookkeeping: which systems it knows, the planner's pick as a deployment,
the headline ratio against the peer, and the table."""

from __future__ import annotations

import pytest

from common.stats import SLO
from trident.bench.compare import PLANNER, Comparison, System, picked_system, table
from trident.bench.metrics import RequestResult, summarise
from trident.bench.sweep import SweepResult

SLO_ = SLO(2.0, 0.2)


def sweep(name: str, points: list[tuple[float, float]]) -> SweepResult:
    """A sweep whose rate `r` had a share `a` of ten requests meet the SLO."""
    result = SweepResult(name, "http://x", "m", SLO_, {})
    for rate, share in points:
        met = round(10 * share)
        rs = [
            RequestResult(i, float(i), float(i), ok=True, ttft=0.1 if i < met else 5.0, e2e=1.0, tbts=[0.01])
            for i in range(10)
        ]
        result.summaries.append(summarise(rate, rs, SLO_))
        result.requests[rate] = rs
    return result


def test_systems_by_name():
    assert System.parse("ep+d") == System("ep+d", method="ep+d")
    assert System.parse("transformers-serve").peer
    assert System.parse("transformers-serve-cb").continuous_batching
    assert System.parse(PLANNER).method == ""
    off = System.parse("ep+d-nocache")
    assert (off.method, off.env) == ("ep+d", {"TRIDENT_PREFIX_CACHING": "false"})
    with pytest.raises(ValueError, match="unknown system 'vllm'"):
        System.parse("vllm")
    routed_off = System.parse("e+p+d-norouting:prefill=2")
    assert (routed_off.method, routed_off.env) == ("e+p+d", {"TRIDENT_KV_ROUTING": "false"})
    assert routed_off.scale == {"prefill": 2} and System.parse("e+p+d:prefill=2:decode=3").env == {}
    assert System.parse("e+p+d:prefill=2:decode=3").scale == {"prefill": 2, "decode": 3}
    turns = System.parse("ep+d-turns")
    assert (turns.method, turns.env) == ("ep+d", {"TRIDENT_DECODE_PREFILL_TOKENS": "256"})
    for bad in ("e+p+d:prefill", "e+p+d:prefill=0", "llama.cpp:prefill=2", "e+p+d-nocache-norouting"):
        with pytest.raises(ValueError):
            System.parse(bad)


def test_the_planners_pick_becomes_a_deployment():
    plan = {"method": "ep+d", "replicas": {"ep": 1, "d": 2}, "label": "EP+D 1+2", "goodput": 3.0}
    assert picked_system(plan) == System(PLANNER, method="ep+d", scale={"ep": 1, "decode": 2})
    plan = {"method": "e+p+d", "replicas": {"e": 1, "p": 2, "d": 1}}
    assert picked_system(plan).scale == {"encode": 1, "prefill": 2, "decode": 1}


def test_the_headline_is_our_best_goodput_over_the_peers():
    c = Comparison(SLO_, {})
    c.results = [
        sweep("e+p+d", [(1, 1.0), (2, 1.0), (3, 0.9), (4, 0.5)]),
        sweep("epd", [(1, 1.0), (2, 0.8), (3, 1.0), (4, 0.2)]),
        sweep("transformers-serve", [(1, 1.0), (2, 0.4), (3, 0.1), (4, 0.0)]),
    ]
    assert c.goodputs() == {"e+p+d": 3.0, "epd": 1.0, "transformers-serve": 1.0}
    head = c.headline()
    assert (head["best"], head["peer"], head["ratio"]) == ("e+p+d", "transformers-serve", 3.0)
    text = table(c)
    assert "| e+p+d | 3 | 1 | 100 % |" in text
    assert "| transformers-serve | 1 | 1 | 100 % |" in text
    c.results[-1] = sweep("transformers-serve", [(1, 0.5)])
    assert c.headline()["ratio"] == float("inf")  # the peer meets the target at no rate measured


def test_the_cache_effect_pairs_each_method_with_its_cache_off_run():
    c = Comparison(SLO_, {})
    c.results = [
        sweep("ep+d", [(1, 1.0), (2, 1.0), (3, 0.9)]),
        sweep("ep+d-nocache", [(1, 1.0), (2, 0.5)]),
        sweep("epd", [(1, 1.0)]),  # no cache-off run: no entry
    ]
    c.results[1].summaries[0].ttft_p50 *= 4
    effect = c.headline()["prefix_cache"]
    assert list(effect) == ["ep+d"]
    assert effect["ep+d"]["goodput_ratio"] == 3.0 and effect["ep+d"]["ttft_p50_ratio"] == 4.0
    assert effect["ep+d"]["later_turns_ttft_p50_ratio"] is None  # not a multi-turn load


def test_the_routing_effect_pairs_a_scaled_method_with_its_routing_off_run():
    c = Comparison(SLO_, {})
    c.results = [
        sweep("e+p+d:prefill=2", [(1, 1.0), (2, 1.0)]),
        sweep("e+p+d-norouting:prefill=2", [(1, 1.0), (2, 0.5)]),
        sweep("e+p+d-nocache:prefill=2", [(1, 1.0)]),
    ]
    c.results[1].summaries[0].ttft_p50 *= 2
    on, off = c.results[0].summaries[0], c.results[1].summaries[0]
    on.prompt_tokens, on.cached_tokens, off.prompt_tokens, off.cached_tokens = 1000, 800, 1000, 400
    headline = c.headline()
    assert list(headline["kv_routing"]) == ["e+p+d:prefill=2"]
    effect = headline["kv_routing"]["e+p+d:prefill=2"]
    assert effect["goodput_ratio"] == 2.0 and effect["ttft_p50_ratio"] == 2.0
    assert effect["cached_share"] == [0.8, 0.4]
    assert list(headline["prefix_cache"]) == ["e+p+d:prefill=2"]  # its cache-off run pairs the same way


def test_the_turns_effect_is_the_turns_run_over_the_method_as_it_is():
    c = Comparison(SLO_, {})
    c.results = [sweep("ep+d", [(1, 1.0), (2, 0.5)]), sweep("ep+d-turns", [(1, 1.0), (2, 1.0)])]
    c.results[0].summaries[0].ttft_p50 *= 3  # the method as it is: slower first tokens
    effect = c.headline()["decoder_turns"]
    assert list(effect) == ["ep+d-turns"]
    assert effect["ep+d-turns"]["goodput_ratio"] == 2.0 and effect["ep+d-turns"]["ttft_p50_ratio"] == 3.0
