"""Each stage's Prometheus histograms count what really passed through it: one queue wait and one
run per request at each stage's instance, one E→P and one P→D pull per request with its bytes, every
gap between tokens at the gateway, and the engines' steps by kind. The deployment is shared with
other modules (tests/helpers/deployments.py): the counts are what the module's requests added."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.chat import client_for, user_message
from tests.helpers.images import data_url, make_image
from tests.helpers.probes import added, instances, scrape

REQUESTS = 4


@pytest.fixture(scope="module")
def served(e_p_d):
    """An E+P+D deployment's answers to REQUESTS requests with images none sent before (so each is
    encoded), and what each service's samples grew by meanwhile."""
    cluster = e_p_d
    addresses = {
        role: instances(cluster, role)[0]["http_address"] for role in ("encode", "prefill", "decode")
    }
    before = {role: scrape(address) for role, address in addresses.items()}
    gateway_before = scrape(cluster.url)
    # Two images of its own per request, never shared: a request whose images another one had just
    # encoded would find them in the feature index and skip the encoder.
    urls = [[data_url(make_image(100 + 2 * i + k)) for k in range(2)] for i in range(REQUESTS)]
    client = client_for(cluster)

    def ask(i: int):
        messages = user_message(urls[i][: 1 + i % 2], f"question {i}")
        return client.chat.completions.create(
            model="tiny-llava", messages=messages, max_tokens=6, temperature=0
        )

    with ThreadPoolExecutor(REQUESTS) as pool:
        answers = list(pool.map(ask, range(REQUESTS)))
    by_role = {role: added(before[role], scrape(address)) for role, address in addresses.items()}
    return answers, by_role, added(gateway_before, scrape(cluster.url))


def test_each_stage_times_each_request_once(served):
    _, m, _ = served
    for role in ("encode", "prefill", "decode"):
        assert m[role][f"trident_{role}_queue_seconds_count"] == REQUESTS, role
        assert m[role][f"trident_{role}_seconds_count"] == REQUESTS, role
        assert m[role][f"trident_{role}_seconds_sum"] > 0, role
        others = {"encode", "prefill", "decode"} - {role}
        assert all(m[role][f"trident_{o}_seconds_count"] == 0 for o in others), "only the stages it ran"
    assert m["encode"]["trident_engine_step_seconds_count{encode}"] > 0
    assert m["prefill"]["trident_engine_step_seconds_count{prefill}"] > 0
    assert m["decode"]["trident_engine_step_seconds_count{decode}"] > 0


def test_transfers_count_each_pull_and_its_bytes(served):
    _, m, _ = served
    for hop, role in (("ep", "prefill"), ("pd", "decode")):
        assert m[role][f"trident_{hop}_transfer_seconds_count"] == REQUESTS, hop
        assert m[role][f"trident_{hop}_transfer_bytes_count"] == REQUESTS, hop
        assert m[role][f"trident_{hop}_transfer_bytes_sum"] > 0, hop


def test_each_pull_is_counted_under_the_path_it_took(e_p_d, served):
    """The `path` label says how each request's tensors came (host-local, stream, inline, mixed)."""
    for hop, role in (("ep", "prefill"), ("pd", "decode")):
        text = httpx.get(instances(e_p_d, role)[0]["http_address"] + "/metrics", timeout=5).text
        by_path: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == f"trident_{hop}_transfer_bytes_count":
                    by_path[s.labels["path"]] = by_path.get(s.labels["path"], 0.0) + s.value
        assert by_path and set(by_path) <= {"host_local", "stream", "inline", "mixed"}, by_path
        assert sum(by_path.values()) >= REQUESTS, by_path


def test_gateway_counts_every_gap_between_tokens(served):
    answers, _, gateway = served
    assert gateway["trident_gateway_tbt_seconds_count"] == sum(a.usage.completion_tokens - 1 for a in answers)


def test_instances_expose_budgets_scale_and_feature_cache(e_p_d, served):
    m = {role: scrape(instances(e_p_d, role)[0]["http_address"]) for role in ("encode", "prefill", "decode")}
    assert m["encode"]["trident_feature_cache_bytes"] > 0  # the images' features stay cached
    for role in ("encode", "prefill", "decode"):
        assert m[role]["trident_budget_scale"] > 0
        assert m[role]["trident_feature_cache_capacity_bytes"] >= 0


def test_each_worker_serves_the_model_server_protocols_metrics_under_vllms_names(e_p_d, served):
    """What a Gateway API Inference Extension endpoint picker scrapes by default (its flags' default
    names): one gauge each, labelled with the served model, on every worker's /metrics."""
    for role in ("encode", "prefill", "decode"):
        text = httpx.get(instances(e_p_d, role)[0]["http_address"] + "/metrics", timeout=5).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
            (sample,) = families[name].samples
            assert families[name].type == "gauge" and sample.labels == {"model_name": "tiny-llava"}, role
            assert sample.value >= 0
        assert 0 <= families["vllm:kv_cache_usage_perc"].samples[0].value <= 1
        (info,) = families["vllm:cache_config_info"].samples
        assert int(info.labels["block_size"]) > 0 and (
            role == "encode" or int(info.labels["num_gpu_blocks"]) > 0
        )
