"""What a run reused, against what it could have: the figures behind issue 26's goals for workloads
that repeat (trident/bench/repeat.py).

- Encoder runs against new images. Every image sent for the first time in the sweep needs one run
  of the vision tower; an image sent again should need none (the feature store and the engines'
  feature caches keep it). The runs are the deployment's own count of the tower's runs
  (`images_encoded` in the workers' heartbeats, via /v1/cluster), read before and after each rate.
- Prompt tokens computed against the ideal. Computed: what the server reported as not cached
  (prompt tokens less `cached_tokens`). Ideal: what an unbounded prefix cache of the engine's block
  size would still compute — each prompt run through the checkpoint's own chat template and
  processor and keyed as the engine keys it (common/engine/prefix.py), finding the longest run of
  full blocks that any earlier prompt of the sweep computed, never its last token. Earlier means
  sent earlier: two requests in flight together with the same new prefix both compute it in a real
  cache but once here, and a real cache evicts, so a fresh deployment computes at least the ideal;
  how far above it is what the goal (within 5 %) judges.

The ideal covers prompts only: a conversation's answers were computed by a decoder, which is not a
prefix cache here (see `-turns` in docs/architecture.md for one that is).
"""

from __future__ import annotations

import base64
import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from common.engine.prefix import block_hashes
from common.engine.processor import RequestProcessor, load_image
from common.engine.request import Request
from common.protocol import SamplingParams
from common.video import Clip, VideoLimits, decode_video
from services.gateway.api_models import ChatCompletionRequest
from services.settings import GatewaySettings
from trident.bench.metrics import RequestResult


@dataclass
class Reuse:
    """One rate's reuse figures (None where the server does not tell)."""

    images_sent: int = 0
    new_images: int = 0  # images never sent before in the sweep
    encoder_runs: int | None = None  # vision-tower runs the deployment counted during the rate
    prompt_tokens: int = 0  # over the completed requests
    computed_tokens: int = 0  # of them, what the server computed (not found cached)
    ideal_computed_tokens: int | None = None  # what an unbounded prefix cache would compute
    prefix_evictions: int | None = None  # cached blocks the deployment gave up to allocations

    def to_dict(self) -> dict:
        return asdict(self)


def total(reuses: Iterable[Mapping]) -> dict:
    """A sweep's figures (`Reuse.to_dict()` per rate) summed over its rates, and computed / ideal
    (the goal: within 5 %). A figure missing at any rate is None."""
    reuses = list(reuses)
    out: dict = {}
    for name in Reuse.__dataclass_fields__:
        values = [r.get(name) for r in reuses]
        out[name] = None if not values or any(v is None for v in values) else sum(values)
    ideal = out["ideal_computed_tokens"]
    out["computed_over_ideal"] = round(out["computed_tokens"] / ideal, 4) if ideal else None
    return out


class IdealCache:
    """An unbounded prefix cache over prompts, keyed as a Trident engine of `block_size` keys them."""

    def __init__(self, model_dir: Path, block_size: int) -> None:
        self.processor = RequestProcessor(model_dir)
        self.block_size = block_size
        self.seen: set[bytes] = set()

    def computed(self, body: Mapping) -> int:
        """The prompt tokens of chat request `body` that this cache does not hold; then it holds
        the prompt's full blocks."""
        request = ChatCompletionRequest.model_validate(body)
        messages, urls = request.template_messages()
        prompt = self.processor.chat_prompt(messages)
        images = [load_image(base64.b64decode(url.partition(",")[2])) for url in urls]
        clips = [self._clip(url) for url in request.video_urls()]
        processed = self.processor.process(prompt, images, clips)
        req = Request(
            "ideal",
            processed.token_ids,
            SamplingParams(),
            processed.images,
            image_positions=processed.image_positions,
        )
        n, size = len(processed.token_ids), self.block_size
        keys = block_hashes(req, n // size, size)
        found = 0
        for key in keys[: (n - 1) // size]:  # as the engine looks up: never the last token's block
            if key not in self.seen:
                break
            found += 1
        self.seen.update(keys)
        return n - found * size

    def _clip(self, url: str) -> Clip:
        """A clip sampled as the gateway samples it by default (the bench asks for no other rate)."""
        data = base64.b64decode(url.partition(",")[2])
        defaults = GatewaySettings.model_fields
        fps, frames = defaults["video_fps"].default, defaults["video_frames"].default
        return decode_video(data, VideoLimits(), fps, frames, rule=self.processor.videos.rule)


@dataclass(frozen=True)
class Counts:
    images_encoded: int = 0
    prefix_evictions: int = 0


def cluster_counts(
    base_url: str, api_key: str = "", timeout: float = 10.0
) -> tuple[dict[str, Counts], float]:
    """Each worker's running counts, from the gateway's /v1/cluster (its heartbeats), and when the
    oldest of those heartbeats was sent (wall clock; inf for no worker)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(base_url.rstrip("/") + "/v1/cluster", headers=headers, timeout=timeout)
    response.raise_for_status()
    workers = [hb for hb in response.json()["instances"] if hb.get("kind", "worker") == "worker"]
    counts = {
        hb["instance_id"]: Counts(hb.get("images_encoded", 0), hb.get("prefix_evictions", 0))
        for hb in workers
    }
    return counts, min((hb["time"] for hb in workers), default=math.inf)


def counted_since(before: Mapping[str, Counts], after: Mapping[str, Counts]) -> Counts:
    """What the workers counted between two readings; one that started between them counts from 0."""
    zero = Counts()
    return Counts(
        sum(c.images_encoded - before.get(i, zero).images_encoded for i, c in after.items()),
        sum(c.prefix_evictions - before.get(i, zero).prefix_evictions for i, c in after.items()),
    )


class ReuseMeter:
    """Measures each rate of a sweep against one deployment (`measure`), in order: the new images,
    the deployment's encoder runs and evictions (None for a server that is not Trident: pass no
    `base_url`), and, with an `ideal`, the ideal prompt tokens computed. The results of a rate
    must have been sent with `RequestOptions.keep_bodies`; their bodies are dropped once read."""

    def __init__(
        self, base_url: str | None = None, api_key: str = "", ideal: IdealCache | None = None
    ) -> None:
        self.base_url, self.api_key, self.ideal = base_url, api_key, ideal
        self.images: set[str] = set()
        self._before: dict[str, Counts] | None = None

    def start(self) -> None:
        """Before a rate: the deployment's counts so far."""
        self._before = self._counts(since=None)

    def measure(self, results: list[RequestResult]) -> Reuse:
        """After a rate: its figures. Heartbeats carry the counts, so the reading waits (bounded) for
        every worker's first heartbeat sent after the rate's last answer."""
        sent = sorted((r for r in results if not math.isnan(r.sent)), key=lambda r: r.sent)
        reuse = Reuse(images_sent=sum(len(r.images) for r in sent))
        for r in sent:
            reuse.new_images += len(set(r.images) - self.images)
            self.images.update(r.images)
        done = [r for r in sent if r.ok]
        reuse.prompt_tokens = sum(r.prompt_tokens for r in done)
        reuse.computed_tokens = sum(r.prompt_tokens - r.cached_tokens for r in done)
        if self.ideal is not None and all(r.body is not None for r in done):
            reuse.ideal_computed_tokens = sum(self.ideal.computed(r.body) for r in done)
        for r in results:
            r.body = None
        after = self._counts(since=time.time()) if self._before is not None else None
        if after is not None:
            counted = counted_since(self._before, after)
            reuse.encoder_runs, reuse.prefix_evictions = counted.images_encoded, counted.prefix_evictions
        return reuse

    def _counts(self, since: float | None, bound: float = 15.0) -> dict[str, Counts] | None:
        """The workers' counts, once each has sent a heartbeat after wall time `since` (or the
        bound passed); None without a deployment to ask, or when it does not answer."""
        if self.base_url is None:
            return None
        deadline = time.monotonic() + bound
        while True:
            try:
                counts, oldest = cluster_counts(self.base_url, self.api_key)
            except (httpx.HTTPError, ValueError, KeyError):
                return None  # the rate's figures go without the deployment's counts
            if since is None or oldest >= since or time.monotonic() > deadline:
                return counts
            time.sleep(0.2)
