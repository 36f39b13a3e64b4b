"""Decode attention on a CPU, each way a context can be read, on one model's attention shapes.

    python bench/decode_attention.py [--preset small-llava | --model DIR] [--batches 1,8,32]
                                     [--contexts 128,512,2048] [--rounds 5] [--threads 1]

For B decodes of one context length each, one layer's `paged_attention` (the KV write included)
over a cache of the model's KV heads and head size, four ways:

* in place: each decode's blocks are one run, attended to where they lie (what the block manager
  arranges, `decode_context`);
* two runs: a 2-block cached prefix elsewhere, then the request's own run, merged by log-sum-exp
  (what the engine does from `MERGE_FROM_TOKENS` on; below it, such a context is gathered);
* gathered: each decode's blocks scattered, copied by block, then one call each;
* batched: all decodes gathered to the longest and masked, one call (the path before the block
  manager kept runs, and still the path off a CPU).

Each figure is the least of 20 calls, times the model's layers (a decode step's attention);
rounds alternate the order of the four. A table of medians [min-max] and each way over "batched"
round by round, the matmul rate beside it; one JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass

import torch

from common.engine.attention import AttentionMetadata, DecodeContext, decode_context, paged_attention
from common.models import resolve_model
from trident.bench.machine import least_seconds, single_thread_gflops

BLOCK = 16
WAYS = ("in place", "two runs", "gathered", "batched")


def tables(way: str, batch: int, context: int, blocks_each: int) -> list[list[int]]:
    """Block tables: consecutive per decode, or prefix + run, or every other block (scattered)."""
    if way == "two runs":
        return [[0, 1, *range(3 + i * blocks_each, 1 + (i + 1) * blocks_each)] for i in range(batch)]
    if way == "in place":
        return [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(batch)]
    return [list(range(i, 2 * batch * blocks_each, 2 * batch))[:blocks_each] for i in range(batch)]


def metadata(way: str, batch: int, context: int) -> AttentionMetadata:
    blocks_each = -(-context // BLOCK)
    rows = tables(way, batch, context, blocks_each)
    last = context - 1
    slots = torch.tensor([t[last // BLOCK] * BLOCK + last % BLOCK for t in rows])
    meta = AttentionMetadata(slots, [], 0, None, None, BLOCK)
    if way == "batched":
        meta.decode_blocks = torch.tensor(rows)
        meta.decode_bias = torch.zeros(batch, 1, 1, context)
    elif way == "gathered":
        meta.decode_contexts = [DecodeContext(context, blocks=torch.tensor(t)) for t in rows]
    elif way == "in place":
        meta.decode_contexts = [decode_context(t, context, BLOCK) for t in rows]
        assert all(c.runs is not None and len(c.runs) == 1 for c in meta.decode_contexts)
    else:  # merged whatever the context's length, to show where merging starts to pay
        meta.decode_contexts = [
            DecodeContext(context, runs=((0, 2 * BLOCK), (t[2] * BLOCK, context - 2 * BLOCK))) for t in rows
        ]
    return meta


@dataclass(frozen=True)
class Tensors:
    """One decode step's attention inputs: the batch's query, key and value, and the KV cache."""

    q: torch.Tensor  # [batch, heads, head_dim]
    k: torch.Tensor  # [batch, kv_heads, head_dim]
    v: torch.Tensor
    k_cache: torch.Tensor  # [slots, kv_heads, head_dim]
    v_cache: torch.Tensor


def time_way(meta, t: Tensors, calls: int = 20) -> float:
    with torch.inference_mode():
        paged_attention(t.q, t.k, t.v, t.k_cache, t.v_cache, meta)  # warm-up
        return least_seconds(lambda: paged_attention(t.q, t.k, t.v, t.k_cache, t.v_cache, meta), calls)


@dataclass(frozen=True)
class Shape:
    """The attention of the model's text stack: heads, KV heads, head size, layers."""

    heads: int
    kv_heads: int
    dim: int
    layers: int

    @classmethod
    def of(cls, model: str) -> Shape:
        from transformers import AutoConfig

        text = AutoConfig.from_pretrained(resolve_model(model)).get_text_config()
        heads = text.num_attention_heads
        dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(heads, text.num_key_value_heads, dim, text.num_hidden_layers)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="small-llava")
    parser.add_argument("--model", help="a checkpoint directory (instead of --preset)")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="128,512,2048")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    shape = Shape.of(args.model or args.preset)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    gflops = [single_thread_gflops()]
    samples = time_ways(shape, batches, contexts, args.rounds)
    gflops.append(single_thread_gflops())
    print(
        f"\n{args.model or args.preset}: {shape.layers} layers, {shape.heads} heads, "
        f"{shape.kv_heads} KV heads of {shape.dim}; {args.threads} thread(s); "
        f"matmul {gflops[0]:.0f} -> {gflops[1]:.0f} GFLOP/s"
    )
    rows = table(samples, batches, contexts)
    figures = {"model": args.model or args.preset, "threads": args.threads}
    print(json.dumps({**figures, "matmul_gflops": [round(g, 1) for g in gflops], "rows": rows}))


def time_ways(shape: Shape, batches: list[int], contexts: list[int], rounds: int) -> dict[tuple, list[float]]:
    """Every way at every batch and context, `rounds` times, the ways' order rotated each round: a
    step's seconds over all the layers, by (way, batch, context)."""
    slots = 2 * max(batches) * (-(-max(contexts) // BLOCK) + 2) * BLOCK
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(slots, shape.kv_heads, shape.dim, generator=gen)
    v_cache = torch.randn(slots, shape.kv_heads, shape.dim, generator=gen)
    samples: dict[tuple[str, int, int], list[float]] = {}
    for round_ in range(rounds):
        order = WAYS[round_ % len(WAYS) :] + WAYS[: round_ % len(WAYS)]
        for batch in batches:
            q = torch.randn(batch, shape.heads, shape.dim, generator=gen)
            k, v = (
                torch.randn(batch, shape.kv_heads, shape.dim, generator=gen),
                torch.randn(batch, shape.kv_heads, shape.dim, generator=gen),
            )
            tensors = Tensors(q, k, v, k_cache, v_cache)
            for context in contexts:
                for way in order:
                    if way == "two runs" and context < 256:  # no second run to speak of
                        continue
                    seconds = time_way(metadata(way, batch, context), tensors)
                    samples.setdefault((way, batch, context), []).append(seconds * shape.layers)
        print(f"round {round_ + 1} of {rounds} done", flush=True)
    return samples


def table(samples: dict[tuple, list[float]], batches: list[int], contexts: list[int]) -> list[dict]:
    """The Markdown table printed, and its rows as the JSON line gives them."""
    rows = []
    print("| batch | context | " + " | ".join(f"{w} (ms a step)" for w in WAYS) + " | in place / batched |")
    print("| --- " * (len(WAYS) + 3) + "|")
    for batch in batches:
        for context in contexts:
            cells, row = [], {"batch": batch, "context": context}
            for way in WAYS:
                got = samples.get((way, batch, context))
                if not got:
                    cells.append("—")
                    continue
                med = statistics.median(got) * 1e3
                cells.append(f"{med:.2f} [{min(got) * 1e3:.2f}–{max(got) * 1e3:.2f}]")
                row[way.replace(" ", "_") + "_ms"] = round(med, 3)
            base = samples[("batched", batch, context)]
            ratio = statistics.median(
                a / b for a, b in zip(samples[("in place", batch, context)], base, strict=True)
            )
            row["in_place_over_batched"] = round(ratio, 3)
            rows.append(row)
            print(f"| {batch} | {context} | " + " | ".join(cells) + f" | {ratio:.2f}× |")
    return rows


if __name__ == "__main__":
    main()
