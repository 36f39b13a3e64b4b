"""Runs one iteration's Batch: vision encodes, then one packed LLM forward over chunks and decodes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.engine.attention import AttentionMetadata, PrefillSeq, decode_context, varlen_kernel
from common.engine.decode_graphs import DecodeGraphs
from common.engine.feature_cache import FeatureCache
from common.engine.kv_cache import KVCache
from common.engine.request import Request

if TYPE_CHECKING:
    from common.engine.models import VisionLanguageModel
    from common.engine.scheduler import Batch


@dataclass
class ForwardResult:
    sampled: list[Request]  # requests whose last computed position produced a next token
    logits: torch.Tensor | None  # [len(sampled), vocab], float32


def slots_for(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat KV slot of each position: block table[pos // bs] * bs + pos % bs."""
    return table[positions // block_size] * block_size + positions % block_size


class ModelRunner:
    def __init__(
        self,
        model: VisionLanguageModel,
        cache: KVCache | None,
        block_tables,
        features: FeatureCache,
        device: torch.device,
        graphs: DecodeGraphs | None = None,
    ) -> None:
        self.model = model
        self.graphs = graphs  # decode-only steps padded to buckets (and captured, on CUDA)
        self.cache = cache
        self.block_tables = block_tables  # request id → list of block ids (the BlockManager's view)
        self.features = features
        self.device = device
        self.block_size = cache.spec.block_size if cache is not None else 0
        self.vision_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.images_encoded = 0  # images the vision tower ran on, since start

    @torch.inference_mode()
    def run(self, batch: Batch) -> ForwardResult:
        # Dual-stream (000 §4.2): when no request in this batch is both encoded and prefilled, the
        # vision work is independent of the LLM work and overlaps it on a second CUDA stream.
        inline = any(r is e for e, _ in batch.encodes for r, _ in batch.prefills)
        if self.vision_stream is not None and not inline and batch.encodes:
            self.vision_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.vision_stream):
                self.encode(batch.encodes)
            result = self.forward(batch.prefills, batch.decodes)
            torch.cuda.current_stream(self.device).wait_stream(self.vision_stream)
            return result
        self.encode(batch.encodes)
        return self.forward(batch.prefills, batch.decodes)

    def encode(self, encodes: list[tuple[Request, list[int]]]) -> None:
        """Encode all scheduled images in one vision batch; keep features on the request and in the cache."""
        if not encodes:
            return
        todo = [req.images[i] for req, idx in encodes for i in idx]
        out = self.model.encode(todo, self.device, self._vision_dtype())  # [image_tokens, hidden] each
        self.images_encoded += len(todo)
        for img, feats in zip(todo, out, strict=True):
            if feats.shape[0] != img.num_tokens:
                raise ValueError(
                    f"image yields {feats.shape[0]} features but the prompt has {img.num_tokens}"
                )
            img.features = feats
            img.pixel_values = None  # no longer needed; frees the request's pixel memory
            self.features.put(img.content_hash, feats)

    def forward(self, prefills: list[tuple[Request, int]], decodes: list[Request]) -> ForwardResult:
        if not prefills and not decodes:
            return ForwardResult([], None)
        if not prefills and self.graphs is not None:
            logits = self._decode_in_bucket(decodes)
            if logits is not None:
                return ForwardResult(list(decodes), logits)
        lm = self.model.language_model
        ids, positions, slots, splices, sample_rows, sampled = [], [], [], [], [], []
        seqs: list[PrefillSeq] = []
        offset = 0
        mrope = self.model.mrope
        for req, n in prefills:
            start = req.num_computed_tokens
            pos = torch.arange(start, start + n)
            table = torch.as_tensor(self.block_tables(req.request_id))
            ids.append(torch.as_tensor(req.all_token_ids[start : start + n]))
            positions.append(req.positions(start, start + n, mrope))
            slots.append(slots_for(table, pos, self.block_size))
            seqs.append(PrefillSeq(offset, n, slots_for(table, torch.arange(start + n), self.block_size)))
            splices.extend(self._image_splice(req, start, n, offset))
            if start + n == req.num_tokens:
                sample_rows.append(offset + n - 1)
                sampled.append(req)
            offset += n
        num_prefill = offset
        decode_ctx = [req.num_tokens for req in decodes]
        for req in decodes:
            pos = torch.tensor([req.num_tokens - 1])
            ids.append(torch.tensor([req.output_token_ids[-1]]))  # a decoding request has outputs
            positions.append(req.positions(req.num_tokens - 1, req.num_tokens, mrope))
            slots.append(slots_for(torch.as_tensor(self.block_tables(req.request_id)), pos, self.block_size))
            sample_rows.append(offset)
            sampled.append(req)
            offset += 1
        dev = self.device
        pos_t = torch.cat(positions, dim=-1).to(dev)
        meta = self._metadata(torch.cat(slots).to(dev), seqs, num_prefill, decodes, decode_ctx)
        embeds = lm.embed_tokens(torch.cat(ids).to(dev))
        width, deep_rows, deep_feats = embeds.shape[1], [], []
        for rows, feats in splices:
            embeds[rows.to(dev)] = feats[:, :width].to(embeds.dtype)
            if feats.shape[1] > width:  # DeepStack's features ride beside the embedding (Qwen3-VL)
                deep_rows.append(rows)
                deep_feats.append(feats[:, width:].unflatten(1, (-1, width)))
        deepstack = (torch.cat(deep_rows).to(dev), torch.cat(deep_feats).to(dev)) if deep_rows else None
        hidden = lm(embeds, pos_t, self.cache, meta, deepstack)
        logits = lm.logits(hidden[torch.as_tensor(sample_rows, device=dev)]) if sampled else None
        return ForwardResult(sampled, logits)

    def _decode_in_bucket(self, decodes: list[Request]) -> torch.Tensor | None:
        """A decode-only step through `graphs`; None when it fits no bucket (it then runs eagerly)."""
        tables = [self.block_tables(req.request_id) for req in decodes]
        if not self.graphs.fits(len(decodes), max(len(t) for t in tables)):
            return None
        bs = self.block_size
        last = [req.num_tokens - 1 for req in decodes]  # the position each row computes
        if self.model.mrope:
            rows = [r.positions(p, p + 1, True) for r, p in zip(decodes, last, strict=True)]
            positions = torch.cat(rows, dim=-1)
        else:
            positions = torch.as_tensor(last)
        return self.graphs.run(
            ids=[req.output_token_ids[-1] for req in decodes],
            positions=positions,
            slots=[t[p // bs] * bs + p % bs for t, p in zip(tables, last, strict=True)],
            tables=tables,
            context=[req.num_tokens for req in decodes],
        )

    def _image_splice(self, req: Request, start: int, n: int, offset: int):
        """Rows of this chunk that are image placeholders, and the feature rows that fill them.

        A chunk may begin or end inside an image: placeholder k of the prompt always takes row k of
        the request's concatenated image features, whatever chunk it falls in.
        """
        if req.image_positions is None or not len(req.image_positions):
            return []
        pos = req.image_positions
        inside = (pos >= start) & (pos < start + n)
        if not inside.any():
            return []
        rows = inside.nonzero().squeeze(1)  # placeholders are in prompt order: one contiguous run
        first, last = int(rows[0]), int(rows[-1])
        return [(offset + pos[inside] - start, req.image_feature_rows(first, last + 1))]

    def _metadata(self, slot_mapping, seqs, num_prefill, decodes, decode_ctx) -> AttentionMetadata:
        dev = self.device
        for s in seqs:
            s.context_slots = s.context_slots.to(dev)
        meta = AttentionMetadata(slot_mapping, seqs, num_prefill, None, None, block_size=self.block_size)
        kernel = varlen_kernel(dev, self.cache.spec.dtype)
        ops = self.model.language_model.ops
        meta.paged_decode = ops.paged_decode if ops is not None else None
        if decodes and dev.type == "cpu" and kernel is None and meta.paged_decode is None:
            meta.decode_contexts = [
                decode_context(self.block_tables(req.request_id), ctx, self.block_size)
                for req, ctx in zip(decodes, decode_ctx, strict=True)
            ]
        elif decodes:
            tables = [self.block_tables(req.request_id) for req in decodes]
            width = max(len(t) for t in tables)
            grid = torch.zeros(len(decodes), width, dtype=torch.int32)
            for i, table in enumerate(tables):
                grid[i, : len(table)] = torch.as_tensor(table)
            meta.decode_blocks = grid.to(dev)
            if meta.paged_decode is not None:  # read in place: each decode's table and length
                meta.decode_lens = torch.tensor(decode_ctx, dtype=torch.int32).to(dev)
            else:
                valid = torch.arange(max(decode_ctx))[None, :] < torch.as_tensor(decode_ctx)[:, None]
                dtype = self.model.language_model.embed_tokens.weight.dtype  # the queries', not the cache's
                bias = torch.zeros(valid.shape, dtype=dtype).masked_fill_(~valid, float("-inf"))
                meta.decode_bias = bias[:, None, None, :].to(dev)
        if kernel is not None and (seqs or meta.paged_decode is None):
            # With a paged decode kernel the varlen call covers the prefill chunks alone.
            self._flash_metadata(meta, seqs, decode_ctx if meta.paged_decode is None else [], kernel)
        return meta

    def _flash_metadata(self, meta, seqs, decode_ctx, kernel) -> None:
        """One varlen call: sequence b's queries are its packed rows (a chunk, or a decode's one
        token) and its keys its whole context, gathered in position order, so the kernel's
        bottom-right causal alignment puts the queries at the context's end."""
        q_lens = [s.q_len for s in seqs] + [1] * len(decode_ctx)
        k_slots = [s.context_slots for s in seqs]
        if decode_ctx:  # the slots of each decode's context, from its block table row
            bs = self.block_size
            grid = meta.decode_blocks[:, :, None] * bs + torch.arange(bs, device=self.device)
            k_slots += [row[:c] for row, c in zip(grid.flatten(1), decode_ctx, strict=True)]
        k_lens = [len(k) for k in k_slots]
        meta.varlen_kernel = kernel
        meta.cu_seqlens_q = _cumsum(q_lens, self.device)
        meta.cu_seqlens_k = _cumsum(k_lens, self.device)
        meta.flash_slots = torch.cat(k_slots)
        meta.max_q, meta.max_k = max(q_lens), max(k_lens)

    def _vision_dtype(self) -> torch.dtype:
        return next(self.model.vision.parameters()).dtype


def _cumsum(lengths: list[int], device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.as_tensor(lengths), 0)
    return out.to(device)
