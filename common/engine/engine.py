"""The Engine: add requests, step, abort. `step()` reads as the whole algorithm:
schedule a batch, run it, then turn sampled tokens into outputs and stage hand-offs."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from PIL import Image

from common.engine.admission import AdmissionError, check_fits
from common.engine.block_manager import BlockManager, blocks_needed
from common.engine.config import DTYPES, EngineConfig
from common.engine.decode_graphs import DecodeGraphs
from common.engine.detokenizer import IncrementalDetokenizer
from common.engine.feature_cache import FeatureCache
from common.engine.governor import BudgetGovernor, budget_share
from common.engine.kv_cache import KVCache, KVSpec, gpu_kv_bytes, layer_groups, num_blocks_for
from common.engine.kv_stream import KvSink, KvStreamer
from common.engine.loader import load_model
from common.engine.malloc import keep_freed_memory
from common.engine.model_runner import ModelRunner
from common.engine.op_checks import select_ops, shapes_of
from common.engine.outputs import Completion, RequestOutput
from common.engine.packed import pack_projections, packing_available
from common.engine.prefix import block_hashes
from common.engine.processor import ProcessedPrompt, RequestProcessor, load_image, reference_image
from common.engine.profiler import budget_target
from common.engine.request import CONSUMED, ImageInput, Request, Status
from common.engine.sampling import SamplingParams, make_generator, sample
from common.engine.scheduler import Batch, Scheduler
from common.roles import Role

log = logging.getLogger(__name__)
_DTYPES = {name: getattr(torch, name) for name in DTYPES}


def eos_ids(model_dir: Path, config_eos, tokenizer_eos) -> set[int]:
    """Every id that ends generation: the model config's (or the tokenizer's) and, as HF's
    `generate` also stops on them, generation_config.json's (Qwen's releases list two there)."""
    found: set[int] = set()
    for eos in (config_eos if config_eos is not None else tokenizer_eos, _generation_eos(model_dir)):
        found |= set(eos) if isinstance(eos, list) else {eos} if eos is not None else set()
    return found


def _generation_eos(model_dir: Path):
    try:
        return json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return None


class Engine:
    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.device = torch.device(config.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if self.device.type == "cpu":
            keep_freed_memory()
        dtype = _DTYPES[config.dtype or ("bfloat16" if self.device.type == "cuda" else "float32")]
        self.has_lm = bool(config.roles & {Role.PREFILL, Role.DECODE})
        self.model = load_model(model_dir, Role.ENCODE in config.roles, self.device, dtype, self.has_lm)
        self.packed_bytes = self._pack_weights(dtype)
        self.processor = RequestProcessor(model_dir)
        self.tokenizer = self.processor.tokenizer
        text = self.model.config.text_config
        self.max_model_len = text.max_position_embeddings
        self.kv_spec = KVSpec(
            text.num_hidden_layers, text.num_key_value_heads or text.num_attention_heads,
            getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
            config.block_size, self._kv_dtype(dtype),
        )  # fmt: skip
        num_blocks = self._num_blocks() if self.has_lm else 0
        self.cache = KVCache(self.kv_spec, num_blocks, self.device) if self.has_lm else None
        if self.has_lm:  # fused ops and decode attention in place on CUDA; on a CPU, the eager ops
            shapes = shapes_of(text, config.block_size)
            self.model.language_model.set_ops(select_ops(config.kernels, self.device, dtype, shapes))
        self.blocks = BlockManager(num_blocks, config.block_size, caching=config.prefix_caching)
        self.features = FeatureCache(config.feature_cache_bytes)
        self.scheduler = Scheduler(config, self.blocks)
        ref = reference_image(self.processor) if Role.ENCODE in config.roles else None
        if ref is not None and (ref.grid_thw or ref.image_size):  # Qwen-VL, LLaVA-NeXT
            self.scheduler.image_unit = ref.num_tokens  # τe counts what an image costs: its tokens
        self.governor: BudgetGovernor | None = None  # set when a profile is applied
        self.on_step: Callable[[Batch, float], None] | None = None  # each step's batch and seconds
        self.streamer: KvStreamer | None = None  # KV exported during the last prefill step (stream_kv)
        self.runner = ModelRunner(
            self.model, self.cache, self.blocks.table, self.features, self.device, self._decode_graphs()
        )
        # Every request this engine holds: scheduled (waiting, running) or handed off, its KV kept
        # until the next stage pulled it.
        self.requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []
        self._ids = itertools.count()
        self.eos_ids = eos_ids(Path(model_dir), text.eos_token_id, self.tokenizer.eos_token_id)

    # -- admission ---------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | ProcessedPrompt,
        images: list[Image.Image | bytes | str | Path] = (),
        params: SamplingParams | None = None,
        request_id: str | None = None,
        output_token_ids: list[int] | tuple[int, ...] = (),
    ) -> Request:
        """Admit a request from a raw prompt (with one image token per image) or a processed one.

        `output_token_ids` resume a request whose earlier instance died: the tokens it had
        generated (and the client has seen) are computed as context with the prompt, and
        generation continues after them. If they already end the request, it ends at once."""
        if isinstance(prompt, str):
            prompt = self.processor.process(prompt, [load_image(i) for i in images])
        params = params or SamplingParams()
        rid = request_id or f"req-{next(self._ids)}"
        req = Request(
            rid, prompt.token_ids, params, prompt.images, image_positions=prompt.image_positions,
            output_token_ids=list(output_token_ids),
        )  # fmt: skip
        self._admit(req)
        if self.model.mrope:
            req.mrope_positions, req.rope_delta = self._mrope_positions(req)
        if req.output_token_ids:
            req.detokenizer.add(req.output_token_ids)  # streamed before: only the stop check needs it
            if reason := self._stop_reason(req):
                out = RequestOutput(rid, num_prompt_tokens=len(req.prompt_token_ids))
                out.num_output_tokens = len(req.output_token_ids)
                req.status, req.finish_reason = Status.FINISHED, reason
                out.finished, out.finish_reason = True, reason
                self._pending.append(out)
                return req
        for img in req.images:
            cached = self.features.get(img.content_hash) if img.features is None else None
            if cached is not None:
                img.features, img.pixel_values = cached, None
        if req.needs_encode and Role.ENCODE not in self.config.roles:
            raise AdmissionError(f"request {rid} has images to encode but this instance has no encode role")
        self.requests[rid] = req
        self.scheduler.add(req)
        if left := self._leave_if_elsewhere(req):  # e.g. an encoder with every feature cached
            self._pending.append(left)
        return req

    def _mrope_positions(self, req: Request) -> tuple[torch.Tensor, int]:
        try:
            return self.model.positions(req.prompt_token_ids, req.images)
        except ValueError as exc:
            raise AdmissionError(f"request {req.request_id}: {exc}") from exc

    def add_prefilled(
        self, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
        params: SamplingParams, kv: list[torch.Tensor], rope_delta: int = 0, cached_tokens: int = 0,
        images: Sequence[ImageInput] | None = None, image_positions: torch.Tensor | None = None,
    ) -> Request:  # fmt: skip
        """Admit a request prefilled elsewhere: import its KV (one buffer per layer group) and decode.
        `rope_delta` is the prefill's (`Request.rope_delta`): an M-RoPE model needs it to go on;
        `cached_tokens`, what the prefill found in its prefix cache (for usage). With `images` (its
        images' identities, none for a text prompt) and their `image_positions`, its blocks are
        keyed as the prefill instance keyed them and stay cached here after it ends: a later turn
        of the conversation finds its history (prompt and answer) on this instance."""
        known = images is not None
        consumed = [dataclasses.replace(img, pixel_values=None, features=CONSUMED) for img in images or ()]
        req = Request(
            request_id, list(prompt_token_ids), params, images=consumed,
            output_token_ids=list(output_token_ids), image_positions=image_positions if consumed else None,
            rope_delta=rope_delta,
            cacheable=known, num_cached_tokens=cached_tokens,
        )  # fmt: skip
        self._admit(req)
        req.num_computed_tokens = req.num_tokens - 1
        # A request that could not be computed again here (no prefill role, or images encoded
        # elsewhere) is never preempted: it reserves the blocks of its whole length now.
        reserve = req.num_computed_tokens
        if Role.PREFILL not in self.config.roles or not req.recomputable:
            reserve = max(reserve, len(req.prompt_token_ids) + params.max_tokens)
        if self.blocks.allocate(request_id, reserve) is None:
            raise AdmissionError(f"no free KV blocks for {request_id}; pull it only when can_admit() says so")
        table = self.blocks.table(request_id)
        start = 0
        for buf in kv:
            layers = range(start, start + buf.shape[0])
            self.cache.import_blocks(table[: buf.shape[2]], layers, buf)
            start = layers.stop
        req.detokenizer.add(req.output_token_ids)  # their text was streamed by the prefill instance
        self._remember(req)  # its imported full blocks, findable by their keys (when known)
        self.requests[request_id] = req
        self.scheduler.add_running(req)
        return req

    @property
    def kv_tokens(self) -> int:
        """Tokens the whole KV cache holds."""
        return self.blocks.num_blocks * self.config.block_size

    def can_admit(self, num_tokens: int) -> bool:
        """Whether KV blocks for `num_tokens` are free now (pull-based migration asks this)."""
        return blocks_needed(num_tokens, self.config.block_size) <= self.blocks.num_free

    def _admit(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise AdmissionError(f"request id {req.request_id} is already in use")
        check_fits(
            len(req.prompt_token_ids), req.params.max_tokens, max_model_len=self.max_model_len,
            kv_tokens=self.kv_tokens if self.has_lm else None,
        )  # fmt: skip
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.params.stop)

    # -- the loop ----------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run, sample, and report what changed."""
        outputs, self._pending = self._pending, []
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch.empty:
            return outputs
        if self.streamer is not None:
            self.streamer.prepare(self._prefills_leaving(batch))
        try:
            result = self.runner.run(batch)
        finally:
            if self.streamer is not None:
                self.streamer.end()
        self._advance(batch)
        if result.sampled:
            params = [r.params for r in result.sampled]
            draws = [make_generator(r.params.seed, len(r.output_token_ids)) for r in result.sampled]
            tokens = sample(result.logits, params, draws)
            outputs += [self._append_token(r, t) for r, t in zip(result.sampled, tokens, strict=True)]
        outputs += self._hand_offs(batch)
        seconds = time.perf_counter() - started
        if self.governor is not None:
            self._govern(batch, seconds)
        self.scheduler.observe(batch, seconds)
        if self.on_step is not None:
            self.on_step(batch, seconds)
        return outputs

    def stream_kv(self, sink: KvSink | None, group_size: int) -> None:
        """Export the KV of each request that leaves for decode elsewhere while its last prefill
        step runs, a group of `group_size` layers at a time, into `sink` (kv_stream.py); None: stop."""
        if self.streamer is not None:
            self.streamer.remove()
            self.streamer = None
        if sink is not None and self.cache is not None:
            layers = self.model.language_model.layers
            self.streamer = KvStreamer(layers, self.cache, self.blocks.table, group_size, sink)

    def _prefills_leaving(self, batch: Batch) -> list[Request]:
        """The requests whose prompt this step finishes and whose decode runs elsewhere."""
        if Role.DECODE in self.config.roles:
            return []
        return [r for r, n in batch.prefills if r.num_computed_tokens + n == r.num_tokens]

    def _govern(self, batch: Batch, seconds: float) -> None:
        """Tell the governor how long this step took for the share of the budgets it used."""
        s = self.scheduler
        share = budget_share(batch, s.image_budget, s.token_budget, s.image_unit)
        if self.governor.observe(share, seconds):
            s.image_budget, s.token_budget = self.governor.budgets
            log.info(
                "budgets now %d images, %d tokens (%.0f %% of profiled): full steps ran %.2fx the target",
                s.image_budget, s.token_budget, 100 * self.governor.scale, self.governor.last_ratio,
            )  # fmt: skip

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self._pending)

    def _advance(self, batch: Batch) -> None:
        for req, n in batch.prefills:
            req.num_computed_tokens += n
            self._remember(req)
        for req in batch.decodes:
            req.num_computed_tokens += 1
            if req.num_computed_tokens % self.config.block_size == 0:  # a block just filled
                self._remember(req)

    def _remember(self, req: Request) -> None:
        """Make the request's newly computed full blocks findable by their keys (prefix caching)."""
        full = req.num_computed_tokens // self.config.block_size
        if self.blocks.caching and req.cacheable and full > req.num_remembered:
            hashes = block_hashes(req, full, self.config.block_size)
            self.blocks.remember(req.request_id, hashes, start=req.num_remembered)
            req.num_remembered = full

    def _append_token(self, req: Request, token: int) -> RequestOutput:
        req.output_token_ids.append(token)
        text = req.detokenizer.add([token]) if self.config.detokenize or req.params.stop else ""
        reason = self._stop_reason(req)
        out = RequestOutput(req.request_id, [token], text, num_prompt_tokens=len(req.prompt_token_ids))
        out.num_output_tokens = len(req.output_token_ids)
        out.num_cached_tokens = req.num_cached_tokens
        if reason:
            if self.config.detokenize or req.params.stop:
                out.text += req.detokenizer.flush()
            self._finish(req, reason, out)
        return out

    def _stop_reason(self, req: Request) -> str | None:
        """Why the request ends with its last output token, if it does."""
        token, p = req.output_token_ids[-1], req.params
        if (
            (token in self.eos_ids and not p.ignore_eos)
            or token in p.stop_token_ids
            or req.detokenizer.stopped
        ):
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens:
            return "length"
        return None

    def _hand_offs(self, batch: Batch) -> list[RequestOutput]:
        touched = [r for r, _ in batch.encodes] + [r for r, _ in batch.prefills]
        return [left for r in touched if (left := self._leave_if_elsewhere(r))]

    def _leave_if_elsewhere(self, req: Request) -> RequestOutput | None:
        """The one place a request's next stage is decided: when this instance does not run it, the
        request leaves (its blocks stay, for the next stage to pull) and the output names the stage."""
        stage = req.next_stage
        if stage is None or stage in self.config.roles or req.status == Status.HANDED_OFF:
            return None
        self.scheduler.remove(req)
        req.status = Status.HANDED_OFF
        return RequestOutput(req.request_id, next_stage=stage, num_prompt_tokens=len(req.prompt_token_ids))

    def _finish(self, req: Request, reason: str, out: RequestOutput) -> None:
        self.scheduler.remove(req)
        self.blocks.free(req.request_id)
        req.status, req.finish_reason = Status.FINISHED, reason
        out.finished, out.finish_reason = True, reason
        self.requests.pop(req.request_id, None)

    # -- control -----------------------------------------------------------------------------------

    def abort(self, request_id: str) -> RequestOutput | None:
        """Forget a request wherever it is — scheduled, or handed off with its KV kept for the next
        stage — and free its blocks; None if it is unknown or already done."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        out = RequestOutput(request_id, num_prompt_tokens=len(req.prompt_token_ids))
        self._finish(req, "abort", out)
        return out

    def handed_off(self, request_id: str) -> Request | None:
        """A request that left for its next stage (its features or KV are read from it); None if
        it is not held here as handed off (aborted meanwhile)."""
        req = self.requests.get(request_id)
        return req if req is not None and req.status == Status.HANDED_OFF else None

    def export_kv(self, request_id: str, group_size: int) -> list[torch.Tensor]:
        """A (handed-off or running) request's KV as one contiguous buffer per group of layers."""
        table = self.blocks.table(request_id)
        if not table:
            raise KeyError(f"request {request_id} holds no KV blocks here")
        return [self.cache.export_blocks(table, g) for g in layer_groups(self.kv_spec.num_layers, group_size)]

    def apply_profile(self, profile) -> None:
        """Adopt the budgets a BudgetProfiler found (τe, τt) for every later iteration; with
        `adapt_budgets`, a governor scales them while steps run slower than profiled."""
        if profile.image_budget:
            self.scheduler.image_budget = profile.image_budget
        if profile.token_budget:
            self.scheduler.token_budget = profile.token_budget
        if self.config.adapt_budgets and profile.latency_limit > 0:
            target = budget_target(profile.latency_limit)
            self.governor = BudgetGovernor(self.scheduler.image_budget, self.scheduler.token_budget, target)

    def check_integrity(self) -> None:
        """Blocks and feature cache are consistent; every request held is scheduled or handed off,
        and only requests held own blocks; every running request's blocks cover its tokens."""
        self.blocks.check_integrity()
        self.features.check_integrity()
        queued = [*self.scheduler.waiting, *self.scheduler.running]
        scheduled = {r.request_id for r in queued}
        handed_off = {rid for rid, r in self.requests.items() if r.status == Status.HANDED_OFF}
        assert scheduled | handed_off == set(self.requests), "a request is held but not scheduled"
        assert not scheduled & handed_off, "a handed-off request is still scheduled"
        assert self.blocks.owners() <= set(self.requests), "blocks are owned by a request no longer held"
        for req in self.scheduler.running:
            have = len(self.blocks.table(req.request_id)) * self.config.block_size
            assert have >= req.num_computed_tokens, f"{req.request_id}: KV blocks do not cover its tokens"

    # -- convenience -------------------------------------------------------------------------------

    def generate(
        self, prompts: list[str], images: list[list] | None = None, params: SamplingParams | None = None
    ) -> list[Completion]:
        """Run prompts to completion together (batched) and return them in order."""
        images = images or [[] for _ in prompts]
        reqs = [self.add_request(p, imgs, params) for p, imgs in zip(prompts, images, strict=True)]
        texts = {r.request_id: "" for r in reqs}
        while self.has_unfinished():
            for out in self.step():
                texts[out.request_id] += out.text
        return [
            Completion(
                r.request_id,
                texts[r.request_id],
                r.output_token_ids,
                r.finish_reason,
                len(r.prompt_token_ids),
            )
            for r in reqs
        ]

    def chat_prompt(self, text: str, num_images: int = 0) -> str:
        """A single-turn user prompt with `num_images` images before the text, in the model's template."""
        content = [{"type": "image"}] * num_images + [{"type": "text", "text": text}]
        return self.processor.chat_prompt([{"role": "user", "content": content}])

    def _pack_weights(self, dtype: torch.dtype) -> int:
        """Pack the decoder's projections for decode-sized products where that pays (packed.py);
        the bytes the packed copies take."""
        wanted = (
            self.config.packed_weights == "auto" and Role.DECODE in self.config.roles
            and self.device.type == "cpu" and dtype == torch.float32
        )  # fmt: skip
        if not wanted or not packing_available():
            return 0
        added = pack_projections(self.model.language_model)
        log.info("decoder weights packed for decode batches: %.0f MB more memory", added / 1e6)
        return added

    def _kv_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype: the model's, or `kv_cache_dtype` where it may differ (on a CPU)."""
        name = self.config.kv_cache_dtype
        if name is None or _DTYPES[name] == dtype:
            return dtype
        if self.device.type != "cpu":
            raise ValueError(
                f"kv_cache_dtype {name} differs from the model's dtype "
                f"({str(dtype).removeprefix('torch.')}): supported on a CPU only; leave it unset on a GPU"
            )
        return _DTYPES[name]

    def _decode_graphs(self) -> DecodeGraphs | None:
        mode = self.config.decode_graphs
        if self.cache is None or mode == "off" or (mode == "auto" and self.device.type != "cuda"):
            return None
        return DecodeGraphs(self.model, self.cache, self.max_model_len, capture=mode == "auto")

    def _num_blocks(self) -> int:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            held = torch.cuda.memory_reserved(self.device)
            c = self.config
            room = gpu_kv_bytes(free, total, held, c.gpu_memory_fraction, c.gpu_memory_share)
            return room // self.kv_spec.bytes_per_block
        return num_blocks_for(self.kv_spec, self.config.kv_cache_bytes)
