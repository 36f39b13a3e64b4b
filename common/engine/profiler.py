"""Budget profiler (000 Algorithm 1, line 5): find the image budget τe and token budget τt by binary
search on measured iteration latency, and record latency curves the planner consumes.

An iteration must stay under α·TTFT_SLO on instances without decode (E, EP, P: a request needs at
least an encode iteration and a prefill iteration before its first token, hence α = 0.5), and
under TBT_SLO on instances that decode (every decode waits for the whole iteration).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from common.engine.config import Role
from common.engine.request import Request
from common.engine.sampling import SamplingParams

ALPHA = 0.5


def latency_limit(roles: frozenset[Role], ttft_slo: float, tbt_slo: float, alpha: float = ALPHA) -> float:
    """The per-iteration latency cap for an instance with these roles."""
    return tbt_slo if Role.DECODE in roles else alpha * ttft_slo


def search_budget(measure: Callable[[int], float], limit: float, hi: int) -> int:
    """Largest n in [1, hi] with measure(n) <= limit, assuming latency grows with n.

    Returns 1 when even one unit is over the limit: an instance that could do nothing would hang
    its requests, so it runs minimal batches and the SLO miss shows in the measurements instead.
    """
    lo, best = 1, 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if measure(mid) <= limit:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


@dataclass
class StageProfile:
    """What an instance measured about itself: budgets and latency curves (seconds)."""

    roles: list[str]
    latency_limit: float
    image_budget: int
    token_budget: int
    encode: list[tuple[int, float]] = field(default_factory=list)  # (images, s)
    prefill: list[tuple[int, float]] = field(default_factory=list)  # (tokens, s)
    decode: list[tuple[int, int, float]] = field(default_factory=list)  # (batch, context, s)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> StageProfile:
        raw = json.loads(text)
        raw["encode"] = [tuple(x) for x in raw["encode"]]
        raw["prefill"] = [tuple(x) for x in raw["prefill"]]
        raw["decode"] = [tuple(x) for x in raw["decode"]]
        return cls(**raw)


class BudgetProfiler:
    """Measures an engine's own iterations on synthetic inputs (random tokens and pixels)."""

    def __init__(self, engine, repeats: int = 3) -> None:
        self.engine = engine
        self.repeats = repeats
        self.curves: dict[str, list] = {"encode": [], "prefill": [], "decode": []}

    def profile(
        self, ttft_slo: float, tbt_slo: float, max_images: int = 32, max_tokens: int = 8192
    ) -> StageProfile:
        roles = self.engine.config.roles
        limit = latency_limit(roles, ttft_slo, tbt_slo)
        image_budget = token_budget = 0
        if Role.ENCODE in roles:
            image_budget = search_budget(self.encode_latency, limit, max_images)
        if roles & {Role.PREFILL, Role.DECODE}:
            cap = min(max_tokens, self.engine.blocks.num_blocks * self.engine.config.block_size)
            token_budget = search_budget(self.prefill_latency, limit, cap)
            for batch in (1, 8, 32):
                self.decode_latency(batch, 256)
        return StageProfile(
            sorted(r.value for r in roles), limit, image_budget, token_budget,
            sorted(self.curves["encode"]), sorted(self.curves["prefill"]), sorted(self.curves["decode"]),
        )  # fmt: skip

    def encode_latency(self, images: int) -> float:
        vision = self.engine.model.vision
        size = self.engine.model.config.vision_config.image_size
        dtype = next(vision.parameters()).dtype
        pixels = torch.randn(images, 3, size, size, device=self.engine.device, dtype=dtype)
        seconds = self._time(lambda: vision(pixels))
        self.curves["encode"].append((images, seconds))
        return seconds

    def prefill_latency(self, tokens: int) -> float:
        req = self._fake_request("profile-prefill", tokens, 0)
        seconds = self._with_blocks([req], tokens, lambda: self.engine.runner.forward([(req, tokens)], []))
        self.curves["prefill"].append((tokens, seconds))
        return seconds

    def decode_latency(self, batch: int, context: int) -> float:
        reqs = [self._fake_request(f"profile-decode-{i}", context, 1) for i in range(batch)]
        fits = self.engine.can_admit(batch * (context + 1))
        if not fits:
            return float("nan")
        seconds = self._with_blocks(reqs, context + 1, lambda: self.engine.runner.forward([], reqs))
        self.curves["decode"].append((batch, context, seconds))
        return seconds

    def _fake_request(self, rid: str, prompt_len: int, outputs: int) -> Request:
        vocab = self.engine.model.config.text_config.vocab_size
        ids = torch.randint(0, vocab, (prompt_len + outputs,)).tolist()
        req = Request(rid, ids[:prompt_len], SamplingParams())
        req.output_token_ids = ids[prompt_len:]
        req.num_computed_tokens = prompt_len + outputs - 1 if outputs else 0
        return req

    def _with_blocks(self, reqs: list[Request], tokens: int, fn: Callable[[], object]) -> float:
        try:
            for r in reqs:
                if self.engine.blocks.allocate(r.request_id, tokens) is None:
                    return float("inf")
            return self._time(fn)
        finally:
            for r in reqs:
                self.engine.blocks.free(r.request_id)

    def _time(self, fn: Callable[[], object]) -> float:
        with torch.inference_mode():
            fn()  # warm-up: first calls pay for allocation and kernel selection
            samples = []
            for _ in range(self.repeats):
                _sync(self.engine.device)
                t = time.perf_counter()
                fn()
                _sync(self.engine.device)
                samples.append(time.perf_counter() - t)
        return statistics.median(samples)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
