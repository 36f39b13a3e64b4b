"""What a run reused against what it could have (trident/bench/reuse.py): the unbounded cache that
sets the ideal, and the sums a comparison reports."""

from __future__ import annotations

import base64
import math
from pathlib import Path

import pytest

from common.checkpoints import write_checkpoint
from common.engine.processor import RequestProcessor, load_image
from trident.bench.client import image_data_url, image_urls
from trident.bench.metrics import RequestResult
from trident.bench.reuse import Counts, IdealCache, ReuseMeter, counted_since, total

SYSTEM = " ".join(["you are a kind aide who looks at each image"] * 8)
BLOCK = 16


def body(text: str, image: int | None = None, system: str = SYSTEM) -> dict:
    content: list[dict] = []
    if image is not None:
        content.append({"type": "image_url", "image_url": {"url": image_data_url(image, (64, 48))}})
    content.append({"type": "text", "text": text})
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": content}],
    }


@pytest.fixture(scope="module", params=["tiny-llava", "tiny-qwen2-vl"])
def model_dir(request, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("reuse") / request.param, request.param, seed=0)


def prompt_ids(processor: RequestProcessor, b: dict) -> list[int]:
    """The prompt as the gateway makes it, with each image's placeholders marked by its seed."""
    from services.gateway.api_models import ChatCompletionRequest

    messages, urls = ChatCompletionRequest.model_validate(b).template_messages()
    images = [load_image(base64.b64decode(u.partition(",")[2])) for u in urls]
    processed = processor.process(processor.chat_prompt(messages), images)
    ids = list(processed.token_ids)
    for pos in processed.image_positions.tolist():
        ids[pos] = ("image", urls[0])  # what an image token stands for is its image
    return ids


def shared_blocks(a: list, b: list) -> int:
    """Full blocks of `b` (never its last token) that equal `a`'s: what a cache holding `a` gives."""
    n = 0
    while n < min(len(a), len(b) - 1) and a[n] == b[n]:
        n += 1
    return min(n, len(b) - 1) // BLOCK


def test_the_ideal_finds_the_shared_blocks_and_no_more(model_dir: Path) -> None:
    ideal = IdealCache(model_dir, BLOCK)
    processor = RequestProcessor(model_dir)
    first = body("what is in the picture", image=1)
    assert ideal.computed(first) == len(prompt_ids(processor, first))  # nothing cached yet
    for later in (
        body("and where is the red cat now", image=1),  # same system prompt and image: both reused
        body("what is in the picture", image=2),  # another image: the system prompt only
        body("what is in the picture"),  # no image
        body("what is in the picture", image=1, system="be brief"),  # another system prompt
    ):
        ids = prompt_ids(processor, later)
        found = shared_blocks(prompt_ids(processor, first), ids)
        fresh = IdealCache(model_dir, BLOCK)
        fresh.computed(first)
        assert fresh.computed(later) == len(ids) - found * BLOCK
    again = IdealCache(model_dir, BLOCK)
    n = len(prompt_ids(processor, first))
    again.computed(first)
    assert again.computed(first) == n - (n - 1) // BLOCK * BLOCK  # at least its last token
    assert shared_blocks(prompt_ids(processor, first), prompt_ids(processor, body("x", image=2))) > 0


def test_totals_sum_the_rates_and_say_none_where_a_rate_could_not_tell() -> None:
    rates = [
        {"images_sent": 4, "new_images": 3, "encoder_runs": 3, "prompt_tokens": 900, "computed_tokens": 420,
         "ideal_computed_tokens": 400, "prefix_evictions": 0},
        {"images_sent": 5, "new_images": 1, "encoder_runs": 1, "prompt_tokens": 1000, "computed_tokens": 300,
         "ideal_computed_tokens": 300, "prefix_evictions": 2},
    ]  # fmt: skip
    out = total(rates)
    assert out["new_images"] == 4 and out["encoder_runs"] == 4 and out["prefix_evictions"] == 2
    assert out["computed_over_ideal"] == pytest.approx(720 / 700, abs=1e-4)
    rates[1]["encoder_runs"] = None
    assert total(rates)["encoder_runs"] is None


def test_counts_since_a_reading_include_workers_that_started_in_between() -> None:
    before = {"a": Counts(5, 1)}
    after = {"a": Counts(7, 1), "b": Counts(2, 3)}
    assert counted_since(before, after) == Counts(4, 3)


def test_a_meter_counts_new_images_across_rates_and_drops_the_bodies(tiny_model_dir: Path) -> None:
    meter = ReuseMeter(ideal=IdealCache(tiny_model_dir, BLOCK))

    def sent(b: dict, at: float, prompt: int, cached: int, ok: bool = True) -> RequestResult:
        r = RequestResult(index=0, scheduled=at, sent=at, ok=ok, prompt_tokens=prompt, cached_tokens=cached)
        r.images, r.body = [u[-12:] for u in image_urls(b)], b
        return r

    first = meter.measure([sent(body("a", 1), 0.1, 100, 0), sent(body("b", 1), 0.2, 100, 64)])
    assert (first.images_sent, first.new_images) == (2, 1)
    assert (first.prompt_tokens, first.computed_tokens) == (200, 136)
    assert first.ideal_computed_tokens is not None and first.encoder_runs is None
    failed = sent(body("c", 2), 0.3, 0, 0, ok=False)
    second = meter.measure([sent(body("d", 1), 0.1, 100, 64), failed])
    assert (second.images_sent, second.new_images, second.prompt_tokens) == (2, 1, 100)
    assert failed.body is None and not math.isnan(failed.sent)


def test_a_deployment_that_does_not_answer_leaves_its_counts_out() -> None:
    meter = ReuseMeter("http://127.0.0.1:9")  # nothing listens there
    meter.start()
    r = RequestResult(index=0, scheduled=0.0, sent=0.0, ok=True, prompt_tokens=10)
    reuse = meter.measure([r])
    assert reuse.encoder_runs is None and reuse.prefix_evictions is None and reuse.computed_tokens == 10


def test_the_ideal_counts_a_clip_as_the_gateway_samples_it(tmp_path: Path) -> None:
    """A body with a `video_url` (a real clip, as the bench sends it): its prompt holds the clip's
    tokens as the gateway makes them (default sampling), and sent again, all but its last block is
    found."""
    from common.video import VideoLimits, decode_video
    from trident.bench.clips import clip_data_url

    model_dir = write_checkpoint(tmp_path / "q", "tiny-qwen2-vl", seed=0)
    url = clip_data_url(2.0, (112, 84), seed=5)
    b = body("what happens", system="be brief")
    b["messages"][1]["content"].insert(0, {"type": "video_url", "video_url": {"url": url}})
    processor = RequestProcessor(model_dir)
    clip = decode_video(base64.b64decode(url.partition(",")[2]), VideoLimits(), 2.0, 32)
    messages = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what happens"}]}]
    want = processor.process(processor.chat_prompt([b["messages"][0], *messages]), [], [clip])
    assert sum(i.num_tokens for i in want.images) > 8  # the clip's tokens are in the prompt
    ideal = IdealCache(model_dir, BLOCK)
    n = len(want.token_ids)
    assert ideal.computed(b) == n
    assert ideal.computed(b) == n - (n - 1) // BLOCK * BLOCK
