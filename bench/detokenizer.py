"""Streaming detokenisation: what turning one request's tokens into text pieces costs the gateway's
event loop, token by token, against decoding the whole output again at every token.

    python bench/detokenizer.py [--model DIR] [--lengths 256,1024,2048] [--repeats 3]

With no --model, small-llava's tokenizer is built in memory, as `trident make-model` trains it.
Ids are drawn at random from the vocabulary (what a random-weight model emits: words, stray UTF-8
bytes). Both ways must give the same text. Prints a line per length and, last, one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from transformers import AutoTokenizer

from common.checkpoints.presets import get_preset
from common.checkpoints.tokenizer import build_tokenizer
from common.engine.detokenizer import IncrementalDetokenizer


def windowed(tokenizer, ids: list[int]) -> str:
    detok = IncrementalDetokenizer(tokenizer)
    return "".join(detok.add([i]) for i in ids) + detok.flush()


def whole_output(tokenizer, ids: list[int]) -> str:
    """The baseline: decode the whole output at every token and release what is new."""
    pieces, emitted = [], 0
    for n in range(1, len(ids) + 1):
        full = tokenizer.decode(ids[:n], skip_special_tokens=True)
        if not full.endswith("\ufffd"):
            pieces.append(full[emitted:])
            emitted = len(full)
    pieces.append(tokenizer.decode(ids, skip_special_tokens=True)[emitted:])
    return "".join(pieces)


def best_ms(fn, tokenizer, ids: list[int], repeats: int) -> tuple[float, str]:
    times, text = [], ""
    for _ in range(repeats):
        t = time.perf_counter()
        text = fn(tokenizer, ids)
        times.append((time.perf_counter() - t) * 1e3)
    return min(times), text


def load_tokenizer(model: str | None):
    if model:
        return AutoTokenizer.from_pretrained(model)
    return build_tokenizer(get_preset("small-llava"))[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a checkpoint directory (default: small-llava's tokenizer)")
    ap.add_argument("--lengths", default="256,1024,2048")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tokenizer = load_tokenizer(args.model)
    rng = random.Random(0)
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        ids = [rng.randrange(len(tokenizer)) for _ in range(length)]
        ours, text = best_ms(windowed, tokenizer, ids, args.repeats)
        base, _ = best_ms(whole_output, tokenizer, ids, args.repeats)
        if text != tokenizer.decode(ids, skip_special_tokens=True):
            raise SystemExit(f"{length} tokens: the windowed text differs from the full decode")
        rows.append(
            {
                "tokens": length,
                "windowed_ms": round(ours, 2),
                "whole_output_ms": round(base, 2),
                "speedup": round(base / ours, 1),
            }
        )
        print(
            f"{length:6d} tokens  windowed {ours:8.2f} ms   whole output each token {base:8.2f} ms"
            f"   {base / ours:5.1f}x",
            flush=True,
        )
    print(json.dumps({"tokenizer": args.model or "small-llava", "rows": rows}))


if __name__ == "__main__":
    main()
