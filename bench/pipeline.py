"""Per-request latency breakdown through the deployed pipeline (seed 000 Figure 11), and the TTFT
that disaggregation adds over the coupled EPD baseline at low load.

    python bench/pipeline.py [--presets tiny-llava,small-llava] [--requests 40] [--max-tokens 16]

For each preset, two real deployments run side by side — EPD (one instance, all roles) and E+P+D
(three instances), each with its own nats-server and redis-server — and requests with one distinct
image each are sent strictly one at a time, alternating between them (low load), over the OpenAI
API, streaming. Alternating makes the comparison paired: the two see the same machine at the
same moments, so drift in the machine's speed (other tenants, frequency) cancels instead of
landing on whichever deployment ran second. The client measures TTFT and end-to-end latency; the
stage timestamps the services write to Redis give the breakdown: encode queue/exec, E→P
transfer, prefill queue/exec, P→D transfer, decode (queue + exec). The added TTFT is the median
of the per-pair differences. A table goes to stdout and the key figures as one JSON object on the
last line.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import openai
from PIL import Image

from common.checkpoints import is_checkpoint_dir, write_checkpoint
from common.store import Store, StoreConfig
from trident.launcher.cluster import running_cluster

METHODS = ("epd", "e+p+d")
# One torch thread per worker and a small KV cache: the path's own costs, not the engine's speed.
SMALL = {"TRIDENT_NUM_THREADS": "1", "TRIDENT_KV_CACHE_BYTES": str(16 << 20), "TRIDENT_PROFILE_REPEATS": "1"}
# (name, from stage, to stage): the intervals of one request's path, in order.
INTERVALS = [
    ("encode_queue", "encode_queued", "encode_started"),
    ("encode_exec", "encode_started", "encode_ended"),
    ("ep_transfer", "ep_transfer_started", "ep_transfer_ended"),
    ("prefill_queue", "prefill_queued", "prefill_started"),
    ("prefill_exec", "prefill_started", "prefill_ended"),
    ("pd_transfer", ("pd_transfer_started", "prefill_ended"), "pd_transfer_ended"),  # the exposed part
    ("decode", "pd_transfer_ended", "end"),
]


def image_url(seed: int, size: int) -> str:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def ask(client: openai.OpenAI, model: str, i: int, max_tokens: int) -> dict:
    """One streamed request with picture `i`: its id, TTFT and latency (seconds)."""
    content = [
        {"type": "image_url", "image_url": {"url": image_url(i, 96)}},
        {"type": "text", "text": f"Describe picture {i} in detail"},
    ]
    start = time.perf_counter()
    first, rid = None, None
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        rid = chunk.id
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter()
    end = time.perf_counter()
    return {"id": rid, "ttft": (first or end) - start, "latency": end - start}


async def stage_records(redis_url: str, ids: list[str]) -> list[dict[str, float]]:
    store = await Store.connect(StoreConfig(url=redis_url))
    try:
        records = [await store.requests.get(rid) for rid in ids]
    finally:
        await store.close()
    return [r.stages if r is not None else {} for r in records]  # aligned with `ids`


def breakdown(stages: list[dict[str, float]]) -> dict[str, float]:
    """p50 of each interval in ms, over the requests that passed through it."""
    out = {}
    for name, a, b in INTERVALS:
        starts = (a,) if isinstance(a, str) else a  # several: the latest (KV pulled while it streamed)
        values = [
            (s[b] - max(s[k] for k in starts)) * 1000
            for s in stages
            if b in s and all(k in s for k in starts)
        ]
        if values:
            out[name] = round(statistics.median(values), 3)
    return out


def summarise(results: list[dict], stages: list[dict[str, float]]) -> dict:
    ttft = [r["ttft"] * 1000 for r in results]
    latency = [r["latency"] * 1000 for r in results]
    parts = breakdown(stages)
    transfer = parts.get("ep_transfer", 0) + parts.get("pd_transfer", 0)
    # Server-side TTFT: the first token leaves its instance. The client's TTFT counts the first
    # non-empty text, which waits for the next token when the first is part of a UTF-8 character.
    first = [
        (s["first_token"] - s["arrival"]) * 1000 for s in stages if "first_token" in s and "arrival" in s
    ]
    return {
        "server_ttft_p50_ms": round(statistics.median(first), 2),
        "ttft_p50_ms": round(statistics.median(ttft), 2),
        "latency_p50_ms": round(statistics.median(latency), 2),
        "breakdown_p50_ms": parts,
        "transfer_fraction": round(transfer / statistics.median(latency), 5),
    }


def measure(model_dir: Path, n: int, max_tokens: int, workdir: Path) -> tuple[dict, float, float]:
    """Both methods side by side, requests alternating; per method its summary, and the median
    per-pair TTFT that E+P+D adds, at the client and at the server."""
    with contextlib.ExitStack() as stack:
        clusters = {
            m: stack.enter_context(running_cluster(model_dir, workdir / m.replace("+", "-"), m, env=SMALL))
            for m in METHODS
        }
        clients = {
            m: openai.OpenAI(base_url=c.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            for m, c in clusters.items()
        }
        for m in METHODS:  # warm-up: first-call costs
            for i in range(2):
                ask(clients[m], model_dir.name, 10_000 + i, 4)
        results: dict[str, list[dict]] = {m: [] for m in METHODS}
        for i in range(n):
            for m in METHODS if i % 2 else METHODS[::-1]:  # neither always goes first
                results[m].append(ask(clients[m], model_dir.name, i, max_tokens))
        stages = {
            m: asyncio.run(stage_records(c.redis.url, [r["id"] for r in results[m]]))
            for m, c in clusters.items()
        }
    added = [(b["ttft"] - a["ttft"]) * 1000 for a, b in zip(results["epd"], results["e+p+d"], strict=True)]
    server = [
        ((b["first_token"] - b["arrival"]) - (a["first_token"] - a["arrival"])) * 1000
        for a, b in zip(stages["epd"], stages["e+p+d"], strict=True)
        if {"first_token", "arrival"} <= a.keys() & b.keys()
    ]
    per = {m: summarise(results[m], stages[m]) for m in METHODS}
    return per, statistics.median(added), statistics.median(server)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny-llava,small-llava")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    summary: dict = {"requests": args.requests, "max_tokens": args.max_tokens}
    with tempfile.TemporaryDirectory(prefix="trident-pipeline-") as tmp:
        for preset in args.presets.split(","):
            model_dir = Path(".trident/models") / preset
            if not is_checkpoint_dir(model_dir):
                write_checkpoint(model_dir, preset, seed=0)
            per, added, added_server = measure(model_dir, args.requests, args.max_tokens, Path(tmp))
            print(
                f"\n{preset}: {args.requests} sequential requests to each, alternating, 1 image, "
                f"{args.max_tokens} tokens"
            )
            print(f"{'method':8} {'TTFT p50':>10} {'server TTFT':>12} {'latency p50':>12} {'transfers':>15}")
            for m, r in per.items():
                ttft, lat, share = r["ttft_p50_ms"], r["latency_p50_ms"], r["transfer_fraction"]
                print(
                    f"{m:8} {ttft:>8.1f}ms {r['server_ttft_p50_ms']:>10.1f}ms {lat:>10.1f}ms {share:>14.3%}"
                )
            print(
                "E+P+D breakdown p50 (ms): "
                + ", ".join(f"{k} {v:.2f}" for k, v in per["e+p+d"]["breakdown_p50_ms"].items())
            )
            print(
                f"E+P+D adds {added:.1f} ms TTFT over EPD (client), {added_server:.1f} ms (server): "
                "median of the per-pair differences"
            )
            summary[preset] = {
                **per,
                "ttft_added_ms": round(added, 2),
                "server_ttft_added_ms": round(added_server, 2),
            }
    summary["goal_transfer_under_1pct"] = all(
        summary[p]["e+p+d"]["transfer_fraction"] < 0.01 for p in args.presets.split(",")
    )
    summary["goal_added_ttft_le_10ms"] = all(
        summary[p]["ttft_added_ms"] <= 10 for p in args.presets.split(",")
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
