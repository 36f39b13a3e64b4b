"""A request's plain state; the scheduler, runner and engine operate on it.

One rule covers every stage (vLLM v1's): the tokens still to compute are
`len(all_token_ids) - num_computed_tokens`. A fresh prompt has all of them left (prefill); after
the first token is sampled one is left each step (decode); a preempted request restarts at 0 and
recomputes its prompt and the tokens it already produced, as one prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import torch

from common.engine.detokenizer import IncrementalDetokenizer
from common.engine.grammar import GrammarState
from common.engine.logits import RequestSampler
from common.protocol import SamplingParams
from common.roles import Role

# The features of an image used where the request was prefilled (its KV was imported): only the
# image's identity is kept here, for the request's prefix keys. Not encoded again, and never read.
CONSUMED = torch.empty(0)
# The features of an image whose KV lies in the request's cached prefix, attached when it was
# admitted (PrefixReuse.pin): neither encoded nor pulled, and never read, since every chunk the
# request computes starts past it. Its pixels, if it came with any, stay for a recompute.
IN_PREFIX = torch.empty(0)


class Status(StrEnum):
    WAITING = "waiting"  # admitted, nothing scheduled yet (or preempted)
    RUNNING = "running"
    HANDED_OFF = "handed_off"  # its next stage belongs to another instance
    FINISHED = "finished"


@dataclass
class ImageInput:
    """One image of a request: pixels to encode, or features already encoded (cache or transfer)."""

    content_hash: str
    num_tokens: int
    pixel_values: torch.Tensor | None = None  # [3, H, W]; Qwen2-VL: [patches, 3·t·p·p]
    # [num_tokens, text_hidden]; Qwen3-VL: [num_tokens, text_hidden · (1 + DeepStack layers)]
    features: torch.Tensor | None = None
    # Qwen-VL: the image's patch grid (t, h, w); its token count and positions follow from it.
    grid_thw: tuple[int, int, int] | None = None
    # LLaVA-NeXT: the picture's (height, width) before tiling, which its tiles are stitched back to.
    image_size: tuple[int, int] | None = None
    # Qwen-VL video: the clip's sampled frames, two to a temporal patch (grid_thw's t counts them);
    # its placeholders are the video pad token, and seconds of video each temporal patch spans
    # place its tokens in time (Qwen2.5-VL's M-RoPE).
    video: bool = False
    seconds_per_patch: float | None = None


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    images: list[ImageInput] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    detokenizer: IncrementalDetokenizer | None = None
    # Structured output (grammar.py): its place in `params.grammar`, rebuilt from the output tokens
    # wherever the request is admitted; None without a grammar, or where nothing is sampled.
    grammar: GrammarState | None = None
    # Positions of image placeholder tokens in the prompt, in order: image features fill them.
    image_positions: torch.Tensor | None = None
    # M-RoPE (Qwen2-VL): the prompt's [3, prompt_len] positions, and the offset of every later
    # token's position from its index (the same in all three streams). None/0: position = index.
    mrope_positions: torch.Tensor | None = None
    rope_delta: int = 0
    # Prefix caching (prefix.py): the keys of its full blocks as far as computed, how many of its
    # blocks are findable by them, and whether they may be (not when what its image placeholders
    # stand for is unknown here: a request whose KV was imported without its images).
    block_hashes: list[bytes] = field(default_factory=list)
    num_remembered: int = 0
    cacheable: bool = True
    # Its logits processors (logits.py), made when it is admitted; their state follows its tokens.
    sampler: RequestSampler | None = None
    # A choice forked from another request (forks.py) that the service driving the engine has not
    # yet recorded as its own (Handoff.claim): it came into being inside a step.
    unclaimed: bool = False

    @property
    def recomputable(self) -> bool:
        """Whether its KV can be computed again here after a preemption: not when an image's
        features were consumed elsewhere (its KV was imported), nor when an image's KV is in its
        attached prefix and it came without pixels to encode again."""
        return not self.bound_to_prefix() and all(img.features is not CONSUMED for img in self.images)

    def bound_to_prefix(self) -> list[int]:
        """The images IN_PREFIX that came without pixels: their KV is nowhere but in its prefix."""
        images = enumerate(self.images)
        return [i for i, img in images if img.features is IN_PREFIX and img.pixel_values is None]

    @property
    def pins_prefix(self) -> bool:
        """Whether its attached prefix stands in for images' features: kept while it waits."""
        return any(img.features is IN_PREFIX for img in self.images)

    def lose_prefix(self) -> None:
        """Its KV is gone (a preemption): images that relied on the prefix are encoded again from
        their pixels. Only a recomputable request is ever preempted."""
        for img in self.images:
            if img.features is IN_PREFIX:
                assert img.pixel_values is not None, f"{self.request_id} lost KV it cannot compute again"
                img.features = None

    # Prompt tokens found in the prefix cache when it was (last) admitted: usage reports them as
    # cached. A request prefilled elsewhere carries the prefill instance's count.
    num_cached_tokens: int = 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def needs_encode(self) -> bool:
        return any(img.features is None for img in self.images)

    @property
    def is_decoding(self) -> bool:
        return bool(self.output_token_ids) and self.num_uncomputed == 1

    @property
    def next_stage(self) -> Role | None:
        """The stage this request needs next (whichever instance runs it); None once it finished."""
        if self.status == Status.FINISHED:
            return None
        if self.needs_encode:
            return Role.ENCODE
        return Role.DECODE if self.is_decoding else Role.PREFILL

    @property
    def is_prefilling(self) -> bool:
        return not self.needs_encode and not self.is_decoding and self.num_uncomputed > 0

    def positions(self, start: int, stop: int, mrope: bool) -> torch.Tensor:
        """Positions of tokens [start, stop): [n], or [3, n] for an M-RoPE model."""
        index = torch.arange(start, stop)
        if not mrope:
            return index
        out = (index + self.rope_delta).expand(3, -1).clone()
        if self.mrope_positions is not None:
            prompt = min(stop, self.mrope_positions.shape[1])
            if start < prompt:
                out[:, : prompt - start] = self.mrope_positions[:, start:prompt]
        return out

    def images_to_encode(self) -> list[int]:
        return [i for i, img in enumerate(self.images) if img.features is None]

    def image_spans(self) -> list[tuple[int, int]]:
        """Each image's placeholders in the prompt: (first position, last position + 1)."""
        spans, row = [], 0
        positions = self.image_positions
        for img in self.images:
            spans.append((int(positions[row]), int(positions[row + img.num_tokens - 1]) + 1))
            row += img.num_tokens
        return spans

    def image_feature_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows [start, stop) of all images' features concatenated in prompt order, taken from
        the images that hold them (a prefill chunk touches one or two, not all; never one whose KV
        was in its prefix)."""
        pieces, base = [], 0
        for img in self.images:
            n = img.num_tokens
            lo, hi = max(start, base), min(stop, base + n)
            if lo < hi:
                pieces.append(img.features[lo - base : hi - base])
            base += n
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
