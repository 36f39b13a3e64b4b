"""Decode steps captured once and replayed: CUDA graphs, one per (batch, context) bucket.

On a GPU a decode step of a large model is bound by launching its kernels from Python, some
thirty a layer, not by the GPU: llava-1.5-7b's step took 19.7 ms at batch 1 on an H200 and 21.8 ms at
batch 32, where reading its 13.2 GB of weights once takes 3.2 ms (bench/gpu_check.py). A CUDA
graph records the step's kernels once, with every input in a buffer of fixed address and shape,
and replays them with one launch.

A graph's shapes are fixed, so a step is padded to a bucket:

- the batch to the next of `BATCH_BUCKETS`. A padding row decodes token 0 at position 0 into the
  cache's scratch block (`KVCache.scratch_block`, which no request owns), attending to that block
  alone; its logits are dropped.
- the context to the next of `context_buckets` (in blocks, at most a quarter more than the
  longest context). Each row's block table is padded with
  the scratch block, and a mask hides every key past the row's context — or, where the model
  runs a paged decode kernel (decoder_ops.py), the kernel reads each row's table and length from
  the step's buffers and stops at its context.

Graphs are captured on the first step of their bucket and share one memory pool: they never run
at once. A step that holds prefill work, or is longer or wider than the largest bucket, runs
eagerly as before. A capture that fails (an op this device, driver or torch cannot capture) is
logged once and counted; from then on new buckets run uncaptured, so the request goes on.

`DecodeGraphs(capture=False)` runs the same padded step without capturing it, on any device.
That is how the CPU tests check its semantics — every family's greedy output token-identical to
the eager path, padding rows harmless — where no GPU is; on a GPU it tells a capture fault from a
padding fault.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.engine.attention import AttentionMetadata
from common.engine.kv_cache import KVCache

if TYPE_CHECKING:
    from common.engine.models import VisionLanguageModel

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)


def context_buckets(max_blocks: int) -> list[int]:
    """Context widths in blocks: 1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, ... (each power of two
    and 1¼, 1½, 1¾ times it, so padding reads at most a quarter more than the context), ending at
    `max_blocks`. Graphs are captured only for the widths that steps use."""
    out, power = set(), 1
    while power < max_blocks:
        out |= {power * k // 4 for k in (4, 5, 6, 7)}
        power *= 2
    return sorted({b for b in out if b < max_blocks} | {max_blocks})


def bucket(value: int, buckets: list[int] | tuple[int, ...]) -> int | None:
    """The least bucket that holds `value`, or None when none does."""
    return next((b for b in buckets if b >= value), None)


@dataclass
class _Step:
    """One bucket's fixed buffers: the inputs written before each run, the logits it leaves."""

    ids: torch.Tensor  # [batch] the token each row feeds
    positions: torch.Tensor  # [batch], or [3, batch] with M-RoPE
    slots: torch.Tensor  # [batch] where each row's new K/V goes
    blocks: torch.Tensor  # [batch, width] int32 block tables, padded with the scratch block
    context: torch.Tensor  # [batch] int32 tokens each row attends to (its own new one included)
    logits: torch.Tensor | None = None  # [batch, vocab] float32, the captured step's output
    graph: torch.cuda.CUDAGraph | None = None


class DecodeGraphs:
    """Decode-only steps of `model` over `cache`, padded to buckets and (with `capture`) replayed
    from CUDA graphs."""

    def __init__(self, model: VisionLanguageModel, cache: KVCache, max_model_len: int, capture: bool) -> None:
        self.model = model
        self.cache = cache
        self.block_size = cache.spec.block_size
        self.capture = capture
        self.device = cache.kv.device
        self.batches = list(BATCH_BUCKETS)
        self.widths = context_buckets(-(-max_model_len // self.block_size))
        self.steps: dict[tuple[int, int], _Step] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.runs = 0  # steps run through a bucket, since start
        self.ops = model.language_model.ops  # what the steps were captured with (decoder_ops.py)
        self.capture_failures = 0

    def fits(self, batch: int, max_blocks: int) -> bool:
        return bucket(batch, self.batches) is not None and bucket(max_blocks, self.widths) is not None

    def run(
        self, ids: list[int], positions: torch.Tensor, slots: list[int], tables: list[list[int]],
        context: list[int],
    ) -> torch.Tensor:  # fmt: skip
        """Logits [len(ids), vocab] of one decode step: row i feeds `ids[i]` at `positions[..., i]`,
        writes its K/V at flat slot `slots[i]` and attends to the first `context[i]` tokens of the
        blocks `tables[i]`. Call `fits` first."""
        n = len(ids)
        if self.model.language_model.ops is not self.ops:  # the model's ops changed: capture anew
            self.steps.clear()
            self.ops = self.model.language_model.ops
        size = (bucket(n, self.batches), bucket(max(len(t) for t in tables), self.widths))
        step = self.steps.get(size) or self._new_step(*size)
        scratch = self.cache.scratch_block
        blocks = torch.full(step.blocks.shape, scratch, dtype=torch.int32)
        for i, table in enumerate(tables):
            blocks[i, : len(table)] = torch.as_tensor(table)
        step.ids.copy_(_padded(torch.as_tensor(ids), size[0], 0))
        step.positions.copy_(_padded(positions, size[0], 0))
        step.slots.copy_(_padded(torch.as_tensor(slots), size[0], scratch * self.block_size))
        step.blocks.copy_(blocks)
        step.context.copy_(_padded(torch.as_tensor(context), size[0], 1))
        self.runs += 1
        if step.graph is None:
            return self._forward(step)[:n]
        step.graph.replay()
        return step.logits[:n].clone()  # the buffer is the next replay's output

    def _new_step(self, batch: int, width: int) -> _Step:
        dev, scratch = self.device, self.cache.scratch_block
        rows = (3, batch) if self.model.mrope else (batch,)
        step = _Step(
            ids=torch.zeros(batch, dtype=torch.long, device=dev),
            positions=torch.zeros(rows, dtype=torch.long, device=dev),
            slots=torch.full((batch,), scratch * self.block_size, dtype=torch.long, device=dev),
            blocks=torch.full((batch, width), scratch, dtype=torch.int32, device=dev),
            context=torch.ones(batch, dtype=torch.int32, device=dev),
        )
        if self.capture:
            try:
                self._capture(step)
            except RuntimeError as exc:
                log.warning(
                    "capturing the decode step of bucket %s failed; new buckets run uncaptured: %s",
                    (batch, width), exc,
                )  # fmt: skip
                self.capture, self.capture_failures, step.graph = False, self.capture_failures + 1, None
        self.steps[batch, width] = step
        return step

    def _capture(self, step: _Step) -> None:
        # The buffers hold padding rows only (scratch slots), so the warm-up writes nothing that a
        # request owns. Warm-up on a side stream, as capture wants: it settles lazy initialisation
        # (cuBLAS handles, workspaces) outside the graph.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._forward(step)
        torch.cuda.current_stream(self.device).wait_stream(side)
        step.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(step.graph, pool=self.pool):
            step.logits = self._forward(step)

    def _forward(self, step: _Step) -> torch.Tensor:
        lm = self.model.language_model
        meta = AttentionMetadata(step.slots, [], 0, step.blocks, None, block_size=self.block_size)
        if lm.ops is not None and lm.ops.paged_decode is not None:
            # Read in place: the kernel takes the buffers themselves, so a replay reads what
            # `run` wrote into them, and masks past each row's context by its length.
            meta.paged_decode, meta.decode_lens = lm.ops.paged_decode, step.context
        else:
            width = step.blocks.shape[1] * self.block_size
            hidden_mask = torch.arange(width, device=self.device)[None, :] >= step.context[:, None]
            # In the queries' dtype, which a half-precision cache under a float32 model is not.
            bias = torch.zeros(hidden_mask.shape, dtype=lm.embed_tokens.weight.dtype, device=self.device)
            meta.decode_bias = bias.masked_fill_(hidden_mask, float("-inf"))[:, None, None, :]
        hidden = lm(lm.embed_tokens(step.ids), step.positions, self.cache, meta)
        return lm.logits(hidden)


def _padded(values: torch.Tensor, size: int, fill: int) -> torch.Tensor:
    """`values` along its last dimension, filled out to `size` with `fill`."""
    out = torch.full((*values.shape[:-1], size), fill, dtype=torch.long)
    out[..., : values.shape[-1]] = values
    return out
