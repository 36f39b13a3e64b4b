"""The engine's disaggregation API, what the stage services call (`Engine.handoff`): requests that
left for another instance's stage (their features, their KV exported or streamed) and requests
that arrive from one with their KV. The offline API (add_request, step, generate) is the Engine's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from common.engine.admission import AdmissionError
from common.engine.batch import Batch
from common.engine.block_manager import blocks_needed
from common.engine.kv_cache import KVCache, layer_groups
from common.engine.kv_landing import KvLanding
from common.engine.kv_stream import KvSink, KvStreamer
from common.engine.lifecycle import Lifecycle
from common.engine.processor import ProcessedPrompt
from common.engine.request import CONSUMED, ImageInput, Request, Status
from common.engine.sampling import SamplingParams
from common.roles import Role


class Handoff:
    """Hand-offs in and out of one engine; every call runs between its steps."""

    def __init__(self, lifecycle: Lifecycle, cache: KVCache | None, layers: nn.ModuleList | None) -> None:
        self.lifecycle = lifecycle
        self.config = lifecycle.config
        self.blocks = lifecycle.blocks
        self.cache = cache
        self.layers = layers  # the language model's, which a KV stream hooks
        self.streamer: KvStreamer | None = None  # KV exported during the last prefill step (stream_kv)
        self.landings: dict[str, KvLanding] = {}  # requests whose KV is arriving (land, then commit)

    @property
    def kv_tokens(self) -> int:
        """Tokens the whole KV cache holds."""
        return self.lifecycle.kv_tokens

    def can_admit(self, num_tokens: int) -> bool:
        """Whether KV blocks for `num_tokens` are free now (pull-based migration asks this)."""
        return blocks_needed(num_tokens, self.config.block_size) <= self.blocks.num_free

    def handed_off(self, request_id: str) -> Request | None:
        """A request that left for its next stage (its features or KV are read from it); None if
        it is not held here as handed off (aborted meanwhile)."""
        req = self.lifecycle.requests.get(request_id)
        return req if req is not None and req.status == Status.HANDED_OFF else None

    def cached_images(self, prompt: ProcessedPrompt, output_token_ids: Sequence[int] = ()) -> list[int]:
        """Which of a prompt's images lie wholly inside the prefix cached here now: a prefill
        handler need not pull their features (it admits them IN_PREFIX), as their KV is here.
        Admission attaches the prefix, or says it is gone by then (PrefixLost)."""
        if Role.PREFILL not in self.config.roles:
            return []
        req = Request(
            "",
            list(prompt.token_ids),
            SamplingParams(),
            prompt.images,
            output_token_ids=list(output_token_ids),
            image_positions=prompt.image_positions,
        )
        return self.lifecycle.scheduler.prefixes.covered(req)

    def claim(self, request_id: str) -> None:
        """The service has recorded a choice a step forked (forks.py) as a request of its own: from
        now on its bookkeeping and the engine's agree about it (until then it is the engine's alone)."""
        req = self.lifecycle.requests.get(request_id)
        if req is not None:
            req.unclaimed = False

    def export_kv(self, request_id: str, group_size: int) -> list[torch.Tensor]:
        """A (handed-off or running) request's KV as one contiguous buffer per group of layers."""
        table = self.blocks.table(request_id)
        if not table:
            raise KeyError(f"request {request_id} holds no KV blocks here")
        num_layers = self.cache.spec.num_layers
        return [self.cache.export_blocks(table, g) for g in layer_groups(num_layers, group_size)]

    def add_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        kv: list[torch.Tensor],
        rope_delta: int = 0,
        cached_tokens: int = 0,
        images: Sequence[ImageInput] | None = None,
        image_positions: torch.Tensor | None = None,
    ) -> Request:
        """Admit a request prefilled elsewhere with its KV at hand (one buffer per layer group, in
        layer order): `land`, each buffer written, `commit`."""
        landing = self.land(request_id, max((buf.shape[2] for buf in kv), default=0))
        try:
            start = 0
            for buf in kv:
                landing.write(start, buf)
                start += buf.shape[0]
        except BaseException:
            self.drop(request_id)
            raise
        return self.commit(
            request_id, prompt_token_ids, output_token_ids, params, rope_delta, cached_tokens, images,
            image_positions,
        )  # fmt: skip

    def land(self, request_id: str, num_blocks: int) -> KvLanding:
        """Reserve `num_blocks` blocks for the KV of a request prefilled elsewhere, to be written
        (from any thread: kv_landing.py) before `commit` admits it; `drop` gives them back.
        AdmissionError when the id is in use or the blocks are not free."""
        if request_id in self.lifecycle.requests or request_id in self.landings:
            raise AdmissionError(f"request id {request_id} is already in use")
        table = self._allocate(request_id, num_blocks * self.config.block_size)
        landing = self.landings[request_id] = KvLanding(request_id, self.cache, table)
        return landing

    def commit(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        rope_delta: int = 0,
        cached_tokens: int = 0,
        images: Sequence[ImageInput] | None = None,
        image_positions: torch.Tensor | None = None,
    ) -> Request:
        """Admit a request whose KV was written into its landing, and decode. `rope_delta` is the
        prefill's (`Request.rope_delta`): an M-RoPE model needs it to go on; `cached_tokens`, what
        the prefill found in its prefix cache (for usage). With `images` (its images' identities,
        none for a text prompt) and their `image_positions`, its blocks are keyed as the prefill
        instance keyed them and stay cached here after it ends: a later turn of the conversation
        finds its history (prompt and answer) on this instance. AdmissionError (the landing is
        dropped) when it cannot run here."""
        landing = self.landings.pop(request_id)
        landing.close()
        known = images is not None
        consumed = [dataclasses.replace(img, pixel_values=None, features=CONSUMED) for img in images or ()]
        req = Request(
            request_id,
            list(prompt_token_ids),
            params,
            images=consumed,
            output_token_ids=list(output_token_ids),
            image_positions=image_positions if consumed else None,
            rope_delta=rope_delta,
            cacheable=known,
            num_cached_tokens=cached_tokens,
        )
        try:
            self.lifecycle.admit(req)
            req.num_computed_tokens = req.num_tokens - 1
            self._reserve(req)
        except BaseException:
            self.blocks.free(request_id)
            raise
        req.detokenizer.add(req.output_token_ids)  # their text was streamed by the prefill instance
        self.lifecycle.scheduler.prefixes.remember(req)  # its imported full blocks, findable by their keys
        self.lifecycle.requests[request_id] = req
        self.lifecycle.scheduler.add_running(req)
        return req

    def drop(self, request_id: str) -> bool:
        """Give back a landing's blocks (its KV could not be had, or the request ended meanwhile),
        once a write under way has ended; False if there is none."""
        landing = self.landings.pop(request_id, None)
        if landing is None:
            return False
        landing.close()
        self.blocks.free(request_id)
        return True

    def _reserve(self, req: Request) -> None:
        """Blocks for an imported request's KV. One that could not be computed again here (no
        prefill role, or images encoded elsewhere) is never preempted: it reserves the blocks of its
        whole length now."""
        reserve = req.num_computed_tokens
        if Role.PREFILL not in self.config.roles or not req.recomputable:
            reserve = max(reserve, len(req.prompt_token_ids) + req.params.max_tokens)
        self._allocate(req.request_id, reserve)  # grows the landing's table

    def _allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """The request's table grown to `num_tokens`; AdmissionError when the blocks are not free."""
        table = self.blocks.allocate(request_id, num_tokens)
        if table is None:
            raise AdmissionError(f"no free KV blocks for {request_id}; pull it only when can_admit() says so")
        return table

    def stream_kv(self, sink: KvSink | None, group_size: int) -> None:
        """Export the KV of each request that leaves for decode elsewhere while its last prefill
        step runs, a group of `group_size` layers at a time, into `sink` (kv_stream.py); None: stop."""
        if self.streamer is not None:
            self.streamer.remove()
            self.streamer = None
        if sink is not None and self.cache is not None:
            self.streamer = KvStreamer(self.layers, self.cache, self.blocks.table, group_size, sink)

    @contextmanager
    def streaming(self, batch: Batch) -> Iterator[None]:
        """Around a step's forward: the KV of the prefills it finishes streams as it is computed."""
        if self.streamer is None:
            yield
            return
        self.streamer.prepare(self._prefills_leaving(batch))
        try:
            yield
        finally:
            self.streamer.end()

    def _prefills_leaving(self, batch: Batch) -> list[Request]:
        """The requests whose prompt this step finishes and whose decode runs elsewhere — except
        those whose decode task must carry what the step makes, which a task sent as the step
        begins cannot: the choices a request asking for n forks into, and its first token's
        log-probabilities (they go out with the KV after the step)."""
        if Role.DECODE in self.config.roles:
            return []
        return [
            r
            for r, n in batch.prefills
            if r.num_computed_tokens + n == r.num_tokens and r.params.n == 1 and r.params.logprobs is None
        ]
