"""Budget profiler (000 Algorithm 1, line 5): find the image budget τe and token budget τt by binary
search on measured iteration latency, and record latency curves the planner's simulator replays.

An iteration must stay under α·TTFT_SLO on instances without decode (E, EP, P: a request needs at
least an encode iteration and a prefill iteration before its first token, hence α = 0.5), and
under TBT_SLO on instances that decode (every decode waits for the whole iteration). Budgets are
sized to BUDGET_SHARE of that limit, a margin for the noise a full iteration runs with.

Each curve is measured on a grid first (powers of two), which also brackets the budget; the
binary search then runs inside the bracket, reusing every point already measured:

    grid     16   32   64  128  256  512 1024 2048 (cap)
    latency  ok   ok   ok   ok   ok  over over over
                                 [search 256..511]
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from common.engine.block_manager import blocks_needed
from common.engine.budgets import budget_target, latency_limit, search_budget
from common.engine.processor import reference_image
from common.engine.request import ImageInput, Request
from common.engine.sampling import SamplingParams
from common.protocol import records

PREFILL_GRID_START = 16  # below this a prefill costs about as much as a decode step
DECODE_CONTEXTS = (64, 256, 1024, 4096, 16384)
# Decode is measured at every batch size up to this, powers of two past it, at the first
# DENSE_CONTEXTS contexts (powers of two only at longer ones): a CPU's matrix kernels change path
# with the number of rows (small-llava, one thread: 2 sequences cost more than 4), whatever the
# context, and an instance's decode batches are small whenever it is not saturated.
DECODE_EVERY_BATCH_TO = 8
DENSE_CONTEXTS = 2
# A curve stops growing past this multiple of the latency limit: larger iterations are never run,
# and on slow hardware they would make start-up slow.
CURVE_HEADROOM = 4.0
# The search stops once the budget is known to within 1/SEARCH_STEPS of the grid point below it:
# a few percent of τt is within measurement noise, and each step costs one large iteration.
SEARCH_STEPS = 16
# A first call that takes longer than this is a sample in its own right: the allocation and kernel
# selection it pays for are lost in the noise, and a second run would double start-up.
WARMUP_MATTERS = 0.05


def powers_of_two(start: int, stop: int) -> list[int]:
    """start, 2·start, 4·start, ... up to and including stop (stop itself always ends the list)."""
    points = [2**k for k in range(math.ceil(math.log2(start)), stop.bit_length()) if start <= 2**k < stop]
    return [*points, stop]


@dataclass
class StageProfile:
    """What an instance measured about itself: budgets and latency curves (seconds), and the sizes
    a simulator needs to replay requests on it (KV memory, E→P feature bytes, limits)."""

    roles: list[str]
    latency_limit: float
    image_budget: int
    token_budget: int
    encode: list[tuple[int, float]] = field(default_factory=list)  # (images, s)
    prefill: list[tuple[int, float]] = field(default_factory=list)  # (tokens, s)
    decode: list[tuple[int, int, float]] = field(default_factory=list)  # (batch, context, s)
    num_kv_blocks: int = 0
    block_size: int = 0
    kv_bytes_per_token: int = 0  # all layers, K and V, at the engine's dtype
    feature_bytes_per_image_token: int = 0  # one projected image token as it travels E→P
    max_num_seqs: int = 0
    max_model_len: int = 0
    tokens_per_image: int = 0  # the encode curve's image, where cost follows size (Scheduler.image_unit)
    threads: int = 0  # the torch threads the curves were measured with (0: not recorded)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> StageProfile:
        raw = json.loads(text)
        for curve in ("encode", "prefill", "decode"):
            raw[curve] = [tuple(x) for x in raw.get(curve, [])]
        return cls(**raw)

    def to_record(self, profile_id: str, model: str = "", hardware: str = "") -> records.StageProfile:
        """The Redis record (this profile plus who it describes)."""
        fields = asdict(self)
        fields["roles"] = tuple(fields["roles"])
        for curve in ("encode", "prefill", "decode"):
            fields[curve] = tuple(tuple(x) for x in fields[curve])
        return records.StageProfile(profile_id=profile_id, model=model, hardware=hardware, **fields)

    @classmethod
    def from_record(cls, record: records.StageProfile) -> StageProfile:
        fields = record.model_dump(exclude={"profile_id", "model", "hardware"})
        fields["roles"] = list(fields["roles"])
        for curve in ("encode", "prefill", "decode"):
            fields[curve] = [tuple(x) for x in fields[curve]]
        return cls(**fields)


class BudgetProfiler:
    """Measures an engine's own iterations on synthetic inputs (random tokens and pixels).

    Run it before the engine serves: it borrows KV blocks and frees them after each measurement.
    """

    def __init__(self, engine, repeats: int = 3) -> None:
        self.engine = engine
        self.repeats = repeats
        self.curves: dict[str, dict] = {"encode": {}, "prefill": {}, "decode": {}}
        self._warmed: set[str] = set()
        self._image: ImageInput | None = None

    def profile(
        self,
        ttft_slo: float,
        tbt_slo: float,
        max_images: int = 32,
        max_tokens: int = 8192,
        encode_curve_to: int = 32,
    ) -> StageProfile:
        """Budgets up to `max_images` / `max_tokens` (the configured caps), and the curves: encode
        at 1..τe and powers of two up to `encode_curve_to`, prefill at powers of two up to the token
        cap plus the search points, decode on a batch × context grid that fits the KV cache."""
        e = self.engine
        limit = latency_limit(e.config.roles, ttft_slo, tbt_slo)
        target = budget_target(limit)
        image_budget = token_budget = 0
        if e.model.vision is not None:
            image_budget = self._budget(self.encode_latency, target, powers_of_two(1, max_images))
            more = {*range(1, image_budget + 1), *powers_of_two(1, max(encode_curve_to, max_images))}
            for n in sorted(more):
                if self.encode_latency(n) > CURVE_HEADROOM * limit:
                    break
        cap = min(max_tokens, e.blocks.num_blocks * e.config.block_size)
        if e.has_lm and cap > 0:
            grid = powers_of_two(min(PREFILL_GRID_START, cap), cap)
            token_budget = self._budget(self.prefill_latency, target, grid)
            self.decode_grid(limit, max_batch=token_budget)
            self.decode_again()
        return StageProfile(
            sorted(r.value for r in e.config.roles),
            limit,
            image_budget,
            token_budget,
            self._points("encode"),
            self._points("prefill"),
            self._points("decode"),
            **self.sizes(),
        )

    def sizes(self) -> dict[str, int]:
        """The engine's memory and length limits, as the profile records them."""
        e = self.engine
        dtype_bytes = torch.finfo(e.kv_spec.dtype).bits // 8
        return {
            "num_kv_blocks": e.blocks.num_blocks,
            "block_size": e.config.block_size,
            "kv_bytes_per_token": e.kv_spec.bytes_per_block // e.config.block_size,
            "feature_bytes_per_image_token": e.model.config.text_config.hidden_size * dtype_bytes,
            "max_num_seqs": e.config.max_num_seqs,
            "max_model_len": e.max_model_len,
            "tokens_per_image": e.scheduler.image_unit or 0,
            "threads": torch.get_num_threads(),
        }

    def decode_grid(self, limit: float, max_batch: int) -> None:
        """Decode steps at batch 1, 2, 4, ... × contexts 64, 256, 1024, ..., and every batch up to
        DECODE_EVERY_BATCH_TO at the shortest contexts, as far as KV, max_num_seqs and the token
        budget (one token a decode) allow, and not far past the limit."""
        e = self.engine
        contexts = [c for c in DECODE_CONTEXTS if c < e.max_model_len]
        for k, context in enumerate(contexts):
            per_seq = blocks_needed(context + 1, e.config.block_size)
            most = min(e.config.max_num_seqs, max_batch, e.blocks.num_blocks // per_seq)
            if most == 0:
                break
            dense = range(1, min(most, DECODE_EVERY_BATCH_TO) + 1) if k < DENSE_CONTEXTS else ()
            batches = {*dense, *powers_of_two(1, most)}
            for batch in sorted(batches):
                if self.decode_latency(batch, context) > CURVE_HEADROOM * limit:
                    break

    def decode_again(self) -> None:
        """Time every decode point once more and keep the lesser: the grid's points are timed one
        after another, so a burst of other work (instances profiling beside this one) lengthens
        neighbouring points alike and bends the curve's shape, which a later pass straightens.
        One run a point: the first pass took the least of its repeats already."""
        points = self.curves["decode"]
        for (batch, context), seconds in points.items():
            points[batch, context] = min(seconds, self._time_decode(batch, context, repeats=1))

    def _budget(self, measure: Callable[[int], float], limit: float, grid: list[int]) -> int:
        """Measure the grid (stopping well past the limit), then binary-search the bracket."""
        below = [0]
        for n in grid:
            seconds = measure(n)
            if seconds <= limit:
                below.append(n)
            elif seconds > CURVE_HEADROOM * limit:
                break
        over = [n for n in grid if n > below[-1]]
        if not over:
            return below[-1]
        lo = max(1, below[-1])
        return search_budget(measure, limit, hi=over[0] - 1, lo=lo, resolution=max(1, lo // SEARCH_STEPS))

    def _points(self, curve: str) -> list[tuple]:
        """A curve as sorted (size..., seconds) tuples."""
        items = self.curves[curve].items()
        return sorted((*k, s) if isinstance(k, tuple) else (k, s) for k, s in items)

    def encode_latency(self, images: int) -> float:
        if images in self.curves["encode"]:
            return self.curves["encode"][images]
        model, device = self.engine.model, self.engine.device
        dtype = next(model.vision.parameters()).dtype
        batch = [self._reference_image()] * images
        seconds = self._time("encode", lambda: model.encode(batch, device, dtype))
        self.curves["encode"][images] = seconds
        return seconds

    def _reference_image(self) -> ImageInput:
        """The image the encode curve is measured with (processor.reference_image): a family whose
        image cost follows its size (Qwen-VL) is measured at what its processor makes of a typical
        picture, a fixed-size one (LLaVA) at its size."""
        if self._image is None:
            self._image = reference_image(self.engine.processor)
        return self._image

    def prefill_latency(self, tokens: int, seqs: int = 1) -> float:
        """One iteration prefilling `tokens` prompt tokens: `seqs` sequences, more when one would
        be longer than max_model_len (no real request is). The curve holds one-sequence points."""
        if seqs == 1 and tokens in self.curves["prefill"]:
            return self.curves["prefill"][tokens]
        num_seqs = max(seqs, -(-tokens // self.engine.max_model_len))
        lengths = [tokens // num_seqs + (i < tokens % num_seqs) for i in range(num_seqs)]
        reqs = [synthetic_request(self.engine, f"profile-prefill-{i}", n, 0) for i, n in enumerate(lengths)]
        chunks = list(zip(reqs, lengths, strict=True))
        seconds = self._with_blocks("prefill", chunks, lambda: self.engine.runner.forward(chunks, []))
        if math.isfinite(seconds) and seqs == 1:
            self.curves["prefill"][tokens] = seconds
        return seconds

    def decode_latency(self, batch: int, context: int) -> float:
        """One decode step of `batch` sequences, each `context` tokens long; inf if KV is short."""
        if (batch, context) in self.curves["decode"]:
            return self.curves["decode"][batch, context]
        seconds = self._time_decode(batch, context, self.repeats)
        if math.isfinite(seconds):
            self.curves["decode"][batch, context] = seconds
        return seconds

    def _time_decode(self, batch: int, context: int, repeats: int) -> float:
        reqs = [synthetic_request(self.engine, f"profile-decode-{i}", context, 1) for i in range(batch)]
        held = [(r, context + 1) for r in reqs]
        return self._with_blocks("decode", held, lambda: self.engine.runner.forward([], reqs), repeats)

    def _with_blocks(
        self,
        curve: str,
        reqs: list[tuple[Request, int]],
        fn: Callable[[], object],
        repeats: int | None = None,
    ) -> float:
        """Time `fn` with KV blocks for each (request, tokens) held; inf when they do not fit."""
        blocks = self.engine.blocks
        try:
            for r, tokens in reqs:
                if blocks.allocate(r.request_id, tokens) is None:
                    return float("inf")
            return self._time(curve, fn, repeats)
        finally:
            for r, _ in reqs:
                blocks.free(r.request_id)

    def _time(self, curve: str, fn: Callable[[], object], repeats: int | None = None) -> float:
        """The least seconds of `repeats` (default: the profiler's) runs of `fn`, after a warm-up
        run where that matters: other processes (instances starting beside this one) can only add
        time to a run, never take it."""
        if curve not in self._warmed:  # the first run of a model part pays for lazy initialisation
            self._warmed.add(curve)
            self._once(fn)
        first = self._once(fn)
        samples = [first] if first > WARMUP_MATTERS else []
        while len(samples) < max(1, self.repeats if repeats is None else repeats):
            samples.append(self._once(fn))
        return min(samples)

    def _once(self, fn: Callable[[], object]) -> float:
        with torch.inference_mode():
            _sync(self.engine.device)
            t = time.perf_counter()
            fn()
            _sync(self.engine.device)
            return time.perf_counter() - t


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def synthetic_request(engine, rid: str, prompt_len: int, outputs: int) -> Request:
    """A text request of random tokens, as a step sees it: with `outputs` 0, a prompt of
    `prompt_len` to prefill; else that prompt and `outputs` generated tokens, all computed but the
    last (its next step is a decode at position prompt_len + outputs - 1)."""
    vocab = engine.model.config.text_config.vocab_size
    ids = torch.randint(0, vocab, (prompt_len + outputs,)).tolist()
    req = Request(rid, ids[:prompt_len], SamplingParams())
    req.output_token_ids = ids[prompt_len:]
    req.num_computed_tokens = prompt_len + outputs - 1 if outputs else 0
    return req
