"""The Engine: add requests, step, abort. `step()` reads as the whole algorithm: schedule a batch,
run it, then turn sampled tokens into outputs and stage hand-offs.

It composes named parts: the scheduler (scheduler.py, its policies in policies.py), the model
runner, the request lifecycle (lifecycle.py), the disaggregation API the stage services call
(`handoff`, handoff.py), and what the config and device decide as it is built (build.py).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from PIL import Image

from common.engine import build
from common.engine.admission import AdmissionError
from common.engine.batch import Batch
from common.engine.block_manager import BlockManager
from common.engine.budgets import budget_target
from common.engine.config import EngineConfig
from common.engine.feature_cache import FeatureCache
from common.engine.forks import fork, forks_due
from common.engine.governor import BudgetGovernor, budget_share
from common.engine.grammar import Grammars
from common.engine.handoff import Handoff
from common.engine.integrity import check_integrity
from common.engine.kv_cache import KVCache
from common.engine.lifecycle import Lifecycle, eos_ids
from common.engine.loader import load_model
from common.engine.malloc import keep_freed_memory
from common.engine.model_runner import ForwardResult, ModelRunner
from common.engine.op_checks import select_ops, shapes_of
from common.engine.outputs import Completion, RequestOutput
from common.engine.prefix import PrefixLost
from common.engine.processor import ProcessedPrompt, RequestProcessor, load_image, reference_image
from common.engine.request import IN_PREFIX, Request
from common.engine.sampling import SamplingParams, draw
from common.engine.scheduler import Scheduler
from common.protocol.sampling import choice_id
from common.roles import Role

log = logging.getLogger(__name__)


class Engine:
    """One instance's engine: the offline API here, the disaggregation API in `handoff`."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.device = torch.device(config.device)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if self.device.type == "cpu":
            keep_freed_memory()
        dtype = build.compute_dtype(config, self.device)
        self.has_lm = bool(config.roles & {Role.PREFILL, Role.DECODE})
        self.model = load_model(model_dir, Role.ENCODE in config.roles, self.device, dtype, self.has_lm)
        self.packed_bytes = build.pack_weights(self.model, config, self.device, dtype)
        self.processor = RequestProcessor(model_dir)
        self.tokenizer = self.processor.tokenizer
        text = self.model.config.text_config
        self.max_model_len = text.max_position_embeddings
        self.kv_spec = build.kv_spec(text, config, build.kv_dtype(config, dtype, self.device))
        num_blocks = build.num_kv_blocks(config, self.kv_spec, self.device) if self.has_lm else 0
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
        graphs = build.decode_graphs(config, self.model, self.cache, self.max_model_len)
        self.runner = ModelRunner(
            self.model, self.cache, self.blocks.table, self.features, self.device, graphs
        )
        self.eos_ids = eos_ids(Path(model_dir), text.eos_token_id, self.tokenizer.eos_token_id)
        self.grammars = Grammars(self.tokenizer, text.vocab_size, self.eos_ids)
        self.lifecycle = Lifecycle(
            config, self.scheduler, self.tokenizer, self.eos_ids, self.max_model_len, self.grammars
        )
        self.requests = self.lifecycle.requests  # every request held: the lifecycle's table, not a copy
        layers = self.model.language_model.layers if self.has_lm else None
        self.handoff = Handoff(self.lifecycle, self.cache, layers)
        self._ids = itertools.count()

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
        rid = request_id or f"req-{next(self._ids)}"
        req = Request(
            rid,
            prompt.token_ids,
            params or SamplingParams(),
            prompt.images,
            image_positions=prompt.image_positions,
            output_token_ids=list(output_token_ids),
        )
        self.lifecycle.admit(req)
        if self.model.mrope:
            req.mrope_positions, req.rope_delta = self._mrope_positions(req)
        if req.output_token_ids and self.lifecycle.finished_already(req):
            return req
        for img in req.images:  # an image it has no features of, or expects in its prefix
            lacking = img.features is None or img.features is IN_PREFIX
            cached = self.features.get(img.content_hash) if lacking else None
            if cached is not None:
                img.features, img.pixel_values = cached, None
        if Role.PREFILL in self.config.roles:
            self._reuse_prefix(req)
        if req.needs_encode and Role.ENCODE not in self.config.roles:
            self.scheduler.prefixes.unpin(req)  # whatever it attached goes with it
            raise AdmissionError(f"request {rid} has images to encode but this instance has no encode role")
        self.lifecycle.enter(req)
        return req

    def _reuse_prefix(self, req: Request) -> None:
        """Images wholly inside the cached prefix are neither encoded nor pulled (PrefixReuse.pin).
        A request whose prefix stands in for images takes every block its prefill needs now, so it
        never waits for blocks holding a prefix others could use; one that could not be computed
        again after a preemption (an image without pixels, on an instance that also decodes)
        takes its whole length, as an imported one does. Raises PrefixLost naming the images whose
        features must come from elsewhere."""
        prefixes = self.scheduler.prefixes
        missing = prefixes.pin(req)
        if req.pins_prefix:
            whole = Role.DECODE in self.config.roles and not req.recomputable
            need = len(req.prompt_token_ids) + req.params.max_tokens if whole else req.num_tokens
            if self.blocks.allocate(req.request_id, need) is None:
                missing = req.bound_to_prefix()
                prefixes.unpin(req)
        if missing:
            raise PrefixLost(req.request_id, missing)

    def _mrope_positions(self, req: Request) -> tuple[torch.Tensor, int]:
        try:
            return self.model.positions(req.prompt_token_ids, req.images)
        except ValueError as exc:
            raise AdmissionError(f"request {req.request_id}: {exc}") from exc

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run, sample, and report what changed."""
        held = self.lifecycle
        outputs, held.pending = held.pending, []
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        if batch.empty:
            return outputs
        with self.handoff.streaming(batch):
            result = self.runner.run(batch)
        held.advance(batch)
        forked: list[Request] = []
        outputs += self._sampled(result, forked)
        outputs += held.hand_offs(batch, forked)
        seconds = time.perf_counter() - started
        if self.governor is not None:
            self._govern(batch, seconds)
        self.scheduler.observe(batch, seconds)
        if self.on_step is not None:
            self.on_step(batch, seconds)
        return outputs

    def _sampled(self, result: ForwardResult, forked: list[Request]) -> list[RequestOutput]:
        """A token for each request the forward sampled, and the outputs they make. A request that
        asks for n choices forks at its first token (forks.py): the copies that sample now share
        its logits row, and join `forked`."""
        if not result.sampled:
            return []
        reqs, rows, outputs = list(result.sampled), list(range(len(result.sampled))), []
        origin: dict[str, tuple[str, int]] = {}  # a copy's id -> (the request forked, its choice)
        for row, req in enumerate(result.sampled):
            if not forks_due(req):
                continue
            for index, copy, now in fork(self.lifecycle, self.cache, req):
                origin[copy.request_id] = (req.request_id, index)
                if now:
                    reqs.append(copy)
                    rows.append(row)
                    forked.append(copy)
                else:  # it prefills on its own: the worker learns of it now, its token comes later
                    prompt = len(copy.prompt_token_ids)
                    outputs.append(RequestOutput(copy.request_id, num_prompt_tokens=prompt,
                                                 forked_from=req.request_id, choice=index))  # fmt: skip
        logits = result.logits if len(rows) == len(result.sampled) else result.logits[rows]
        samplers = [r.sampler or self.lifecycle.sampler_for(r.params) for r in reqs]
        grammars = [r.grammar for r in reqs]
        for req, drawn in zip(reqs, draw(logits, samplers, reqs, grammars), strict=True):
            out = self.lifecycle.append_token(req, drawn.token, drawn.logprob)
            out.forked_from, out.choice = origin.get(req.request_id, (None, 0))
            outputs.append(out)
        return outputs

    def _govern(self, batch: Batch, seconds: float) -> None:
        """Tell the governor how long this step took for the share of the budgets it used."""
        s = self.scheduler
        share = budget_share(batch, s.image_budget, s.token_budget, s.image_unit)
        if self.governor.observe(share, seconds):
            s.image_budget, s.token_budget = self.governor.budgets
            log.info(
                "budgets now %d images, %d tokens (%.0f %% of profiled): full steps ran %.2fx the target",
                s.image_budget,
                s.token_budget,
                100 * self.governor.scale,
                self.governor.last_ratio,
            )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self.lifecycle.pending)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Forget a request wherever it is — scheduled, handed off with its KV kept for the next
        stage, or its KV landing here — and free its blocks; None if it is unknown or already done."""
        req = self.requests.get(request_id)
        if req is None:
            self.handoff.drop(request_id)
            return None
        out = RequestOutput(request_id, num_prompt_tokens=len(req.prompt_token_ids))
        self.lifecycle.finish(req, "abort", out)
        return out

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
        """The engine's bookkeeping is whole (integrity.py); AssertionError says what is not."""
        check_integrity(self.lifecycle, self.features, self.handoff.landings)

    def generate(
        self, prompts: list[str], images: list[list] | None = None, params: SamplingParams | None = None
    ) -> list[Completion]:
        """Run prompts to completion together (batched) and return them in order: with `params.n`
        choices, n completions a prompt, in choice order."""
        images = images or [[] for _ in prompts]
        reqs = [self.add_request(p, imgs, params) for p, imgs in zip(prompts, images, strict=True)]
        done: dict[str, Completion] = {}
        while self.has_unfinished():
            for out in self.step():
                c = done.setdefault(out.request_id, Completion(out.request_id, "", [], None, 0))
                c.text += out.text
                c.token_ids += out.new_token_ids
                c.logprobs += out.logprobs
                c.finish_reason = out.finish_reason or c.finish_reason
                c.num_prompt_tokens = out.num_prompt_tokens or c.num_prompt_tokens
        n = params.n if params is not None else 1
        return [done[choice_id(r.request_id, i)] for r in reqs for i in range(n)]

    def chat_prompt(self, text: str, num_images: int = 0) -> str:
        """A single-turn user prompt with `num_images` images before the text, in the model's template."""
        content = [{"type": "image"}] * num_images + [{"type": "text", "text": text}]
        return self.processor.chat_prompt([{"role": "user", "content": content}])
