"""Every request an engine holds, and the one place each of its moves happens: admitted, computed,
given a token, handed off to another instance's stage, finished.

A request is held from admission until it finishes or is aborted: scheduled (waiting, running) or
handed off, its features or KV blocks kept until the next stage pulled them.
"""

from __future__ import annotations

import json
from pathlib import Path

from common.engine.admission import AdmissionError, check_fits
from common.engine.batch import Batch
from common.engine.config import EngineConfig
from common.engine.detokenizer import IncrementalDetokenizer
from common.engine.logits import RequestSampler
from common.engine.outputs import RequestOutput
from common.engine.request import Request, Status
from common.engine.scheduler import Scheduler
from common.protocol import SamplingParams, TokenLogprob
from common.roles import Role


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


class Lifecycle:
    """The requests held (`requests`), the outputs due at the next step (`pending`), and each move."""

    def __init__(
        self, config: EngineConfig, scheduler: Scheduler, tokenizer, eos: set[int], max_model_len: int
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.blocks = scheduler.blocks
        self.tokenizer = tokenizer
        self.eos_ids = eos
        self.max_model_len = max_model_len
        self.requests: dict[str, Request] = {}
        self.pending: list[RequestOutput] = []

    @property
    def kv_tokens(self) -> int:
        """Tokens the whole KV cache holds."""
        return self.blocks.num_blocks * self.config.block_size

    def admit(self, req: Request) -> None:
        """Check that `req` can ever run here (AdmissionError if not), and give it its detokenizer."""
        if req.request_id in self.requests:
            raise AdmissionError(f"request id {req.request_id} is already in use")
        has_lm = bool(self.config.roles & {Role.PREFILL, Role.DECODE})
        check_fits(
            len(req.prompt_token_ids),
            req.params.max_tokens,
            max_model_len=self.max_model_len,
            kv_tokens=self.kv_tokens if has_lm else None,
        )
        req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.params.stop)
        req.sampler = self.sampler_for(req.params)

    def sampler_for(self, params: SamplingParams) -> RequestSampler:
        """The logits processors a request with `params` samples through (logits.py)."""
        return RequestSampler.build(params, frozenset(self.eos_ids))

    def enter(self, req: Request) -> None:
        """An admitted request joins the waiting queue, or leaves at once when its next stage is
        not this instance's (e.g. an encoder with every feature cached)."""
        self.requests[req.request_id] = req
        self.scheduler.add(req)
        if left := self.leave_if_elsewhere(req):
            self.pending.append(left)

    def finished_already(self, req: Request) -> bool:
        """A resumed request whose tokens so far already end it: it finishes now, computing nothing."""
        req.detokenizer.add(req.output_token_ids)  # streamed before: only the stop check needs it
        reason = self.stop_reason(req)
        if reason is None:
            return False
        out = RequestOutput(req.request_id, num_prompt_tokens=len(req.prompt_token_ids))
        out.num_output_tokens = len(req.output_token_ids)
        req.status, req.finish_reason = Status.FINISHED, reason
        out.finished, out.finish_reason = True, reason
        self.pending.append(out)
        return True

    def advance(self, batch: Batch) -> None:
        """What the batch computed: its tokens count as computed, and full blocks become findable."""
        remember = self.scheduler.prefixes.remember
        for req, n in batch.prefills:
            req.num_computed_tokens += n
            remember(req)
        for req in batch.decodes:
            req.num_computed_tokens += 1
            if req.num_computed_tokens % self.config.block_size == 0:  # a block just filled
                remember(req)

    def append_token(self, req: Request, token: int, logprob: TokenLogprob | None = None) -> RequestOutput:
        """A sampled token: the request's output, and its end if the token ends it."""
        req.output_token_ids.append(token)
        text = req.detokenizer.add([token]) if self.config.detokenize or req.params.stop else ""
        reason = self.stop_reason(req)
        out = RequestOutput(req.request_id, [token], text, num_prompt_tokens=len(req.prompt_token_ids))
        if logprob is not None:
            out.logprobs.append(logprob)
        out.num_output_tokens = len(req.output_token_ids)
        out.num_cached_tokens = req.num_cached_tokens
        if reason:
            if self.config.detokenize or req.params.stop:
                out.text += req.detokenizer.flush()
            self.finish(req, reason, out)
        return out

    def stop_reason(self, req: Request) -> str | None:
        """Why the request ends with its last output token, if it does."""
        token, p = req.output_token_ids[-1], req.params
        eos = token in self.eos_ids and not p.ignore_eos
        if eos or token in p.stop_token_ids or req.detokenizer.stopped:
            return "stop"
        if len(req.output_token_ids) >= p.max_tokens:
            return "length"
        return None

    def hand_offs(self, batch: Batch, forked: list[Request] = ()) -> list[RequestOutput]:
        """The requests this batch readied for a stage another instance runs (`forked`: the copies
        its prefills forked into, forks.py)."""
        touched = [r for r, _ in batch.encodes] + [r for r, _ in batch.prefills] + list(forked)
        return [left for r in touched if (left := self.leave_if_elsewhere(r))]

    def leave_if_elsewhere(self, req: Request) -> RequestOutput | None:
        """The one place a request's next stage is decided: when this instance does not run it, the
        request leaves (its blocks stay, for the next stage to pull) and the output names the stage."""
        stage = req.next_stage
        if stage is None or stage in self.config.roles or req.status == Status.HANDED_OFF:
            return None
        self.scheduler.remove(req)
        req.status = Status.HANDED_OFF
        return RequestOutput(req.request_id, next_stage=stage, num_prompt_tokens=len(req.prompt_token_ids))

    def finish(self, req: Request, reason: str, out: RequestOutput) -> None:
        self.scheduler.remove(req)
        self.blocks.free(req.request_id)
        req.status, req.finish_reason = Status.FINISHED, reason
        out.finished, out.finish_reason = True, reason
        self.requests.pop(req.request_id, None)
