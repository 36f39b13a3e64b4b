"""The ablations' switches (bench/ablations.py) keep E+P+D's answers right: the two other batching
policies, no feature prefetch, the KV cache sent as one transfer, and every KV group streamed during
the prefill step."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from services.settings import WorkerSettings
from tests.deploy import running_cluster
from tests.services.conftest import client_for
from tests.services.test_e2e import QUESTION, reference, user_message

VARIANTS = {
    "prefill-first": {"TRIDENT_POLICY": "prefill-first"},
    "decode-first": {"TRIDENT_POLICY": "decode-first"},
    # A token budget below one image's prompt keeps requests waiting at prefill for several steps,
    # so prefill tasks wait for their turn before they pull their features.
    "no-prefetch": {"TRIDENT_PREFETCH": "0", "TRIDENT_TOKEN_BUDGET": "32"},
    # More layers than any model has: the whole KV cache in one transfer.
    "one-kv-transfer": {"TRIDENT_KV_LAYER_GROUP": "1000000"},
    # Nothing rides inline, so even the tiny model's KV streams while its prefill step runs (one
    # layer a group: a transfer per layer). Exported after the step instead: tests/stages.
    "kv-streamed": {
        "TRIDENT_KV_STREAM": "1",
        "TRIDENT_TRANSFER_INLINE_MAX_BYTES": "0",
        "TRIDENT_KV_LAYER_GROUP": "1",
    },
}
IMAGES = [1, 2, 0, 1, 2, 1]  # images per request of a burst


@pytest.fixture(scope="module", params=list(VARIANTS))
def ablated(request, tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp(request.param)
    with running_cluster(tiny_model_dir, workdir, "e+p+d", env=VARIANTS[request.param]) as c:
        yield c


def test_prefetch_is_on_unless_switched_off(monkeypatch):
    assert WorkerSettings().prefetch
    monkeypatch.setenv("TRIDENT_PREFETCH", "0")
    assert not WorkerSettings().prefetch


def test_answers_match_hf_one_at_a_time_and_in_a_burst(ablated, hf_tiny, image_urls):
    client = client_for(ablated)
    want = {n: reference(hf_tiny, n, 16) for n in set(IMAGES)}

    def ask(num_images: int):
        return client.chat.completions.create(
            model="tiny-llava", messages=user_message(image_urls[:num_images], QUESTION), max_tokens=16,
            temperature=0,
        )  # fmt: skip

    for n in (1, 2):
        answer = ask(n)
        assert (answer.choices[0].message.content, answer.usage.completion_tokens) == want[n]
    with ThreadPoolExecutor(len(IMAGES)) as pool:
        answers = list(pool.map(ask, IMAGES))
    for n, answer in zip(IMAGES, answers, strict=True):
        assert (answer.choices[0].message.content, answer.usage.completion_tokens) == want[n]
