"""How much of the P→D KV transfer hides behind the prefill, by prompt length (EPD-Serve's overlap
measure, 002 §3.3): the share of the transfer's time that no longer follows the prefill's end.

    python bench/kv_overlap.py [--preset small-llava] [--lengths 128,512,1024,2048] [--repeats 3]
                               [--group 4] [--wire native|int8] [--backend auto|ucx|tcp]

A prefill engine runs on its worker thread (services/worker/engine_loop.py) with the prefill stage's
own stream sink (services/prefill/kv_stream.py) and a real transfer backend; a puller in another
process stands for the decoder: it gets the handles as soon as the decode task would be queued and
pulls every group at once. For each prompt, two runs:

- after prefill (`TRIDENT_KV_STREAM=0`): the step ends, the KV is exported and published, then
  pulled. Its transfer time T is from the step's end (its first token sampled: when decode could
  begin) to the last byte landed;
- streamed: the handles go out as the step begins; the exposed time E is from the step's end to
  the last byte landed (0 when it landed first).

hidden = 1 - E / T (below 0 when streaming exposed more than T). The decode task's trip through
NATS is the same in both and left out. The last line is one JSON object: per length, the median T,
E and hidden share and their spread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from common.checkpoints import is_checkpoint_dir, write_checkpoint
from common.engine import Engine, EngineConfig
from common.engine.processor import ProcessedPrompt
from common.engine.sampling import SamplingParams
from common.protocol.tensors import KvWire, dtype_name
from common.roles import Role
from common.transfer import TransferConfig, create_backend
from services.prefill.handler import _export
from services.prefill.kv_stream import StreamSink
from services.worker.engine_loop import EngineLoop
from trident.bench.machine import single_thread_gflops


@dataclass
class Sample:
    length: int
    streamed: bool
    step_end: float  # wall clock
    step_seconds: float  # the prefill step's own time (streaming adds its exports to it)
    landed: float
    nbytes: int

    @property
    def after_step(self) -> float:
        return max(0.0, self.landed - self.step_end)


@dataclass(frozen=True)
class Prefill:
    """The prefill side as measured: the checkpoint, layers per KV transfer, the KV's wire format,
    the transfer backend, the engine's torch threads."""

    model: Path
    group: int = 4
    wire: KvWire = KvWire.NATIVE
    backend: str = "auto"
    threads: int = 1


class Harness:
    """The prefill side: engine loop, transfer, sink; the puller process on the other end."""

    def __init__(self, prefill: Prefill) -> None:
        config = EngineConfig(
            roles=frozenset({Role.PREFILL}),
            num_threads=prefill.threads,
            token_budget=8192,
            kv_cache_bytes=1 << 30,
            prefix_caching=False,
            detokenize=False,
        )
        self.engine = Engine(prefill.model, config)
        # Nothing rides inline: every prompt's KV travels by handle, however small the model.
        config = TransferConfig(backend=prefill.backend, inline_max_bytes=0)  # type: ignore[arg-type]
        self.transfer = create_backend(config)
        self.kv_layer_group, self.kv_wire, self.kv_stream = prefill.group, prefill.wire, True
        self.ctx = self  # the sink reads handler.ctx.transfer
        self.step_end = self.step_seconds = 0.0  # the last step's end (its first token sampled) and length
        self.engine.on_step = self._stepped
        self._handed_off: asyncio.Queue = asyncio.Queue()
        self._announced: set[str] = set()

    async def start(self) -> None:
        await self.transfer.start()
        self.loop = EngineLoop(self.engine, self._on_outputs)
        self.loop.start()
        sink = StreamSink(self, self.loop, dtype_name(self.engine.kv_spec.dtype))
        await self.loop.call(lambda: self.engine.handoff.stream_kv(sink, self.kv_layer_group))
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.puller = ctx.Process(target=_puller, args=(self.transfer.config.backend, child), daemon=True)
        self.puller.start()

    def announce(self, stream) -> None:  # the sink's call, on the event loop: "queue the decode task"
        self._announced.add(stream.request_id)
        self.conn.send((self.transfer.address, stream.handles))

    def _stepped(self, _batch, seconds: float) -> None:
        self.step_end, self.step_seconds = time.time(), seconds

    def _on_outputs(self, outputs) -> None:
        for out in outputs:
            if out.next_stage is not None:
                self._handed_off.put_nowait(out.request_id)

    async def run(self, rid: str, length: int, streamed: bool) -> Sample:
        self.kv_stream = streamed
        prompt = _text_prompt(self.engine, length)
        params = SamplingParams(max_tokens=8)
        await self.loop.call(lambda: self.engine.add_request(prompt, params=params, request_id=rid))
        assert await self._handed_off.get() == rid
        handles, streamed = [], rid in self._announced  # small KV does not stream
        if not streamed:  # the hand-off as the prefill stage does it when the KV did not stream
            group, wire = self.kv_layer_group, self.kv_wire
            _, _, buffers, ready = await self.loop.call(lambda: _export(self.engine, rid, group, wire))
            handles = [self.transfer.publish(b, ready=ready) for b in buffers]
            self.conn.send((self.transfer.address, handles))
        landed, nbytes = await asyncio.to_thread(self.conn.recv)
        await self.loop.call(lambda: self.engine.abort(rid))
        for handle in handles:
            self.transfer.release(handle)
        return Sample(length, streamed, self.step_end, self.step_seconds, landed, nbytes)

    async def close(self) -> None:
        self.conn.send(None)
        self.puller.join(10)
        await self.loop.stop()
        await self.transfer.close()


def _text_prompt(engine: Engine, length: int) -> ProcessedPrompt:
    """`length` random text tokens (never the image placeholder)."""
    ids = torch.randint(10, engine.tokenizer.vocab_size - 10, (length,))
    ids[ids == engine.processor.image_token_id] = 10
    return ProcessedPrompt(
        token_ids=ids.tolist(), images=[], image_positions=torch.empty(0, dtype=torch.long)
    )


def _puller(backend: str, conn) -> None:
    asyncio.run(_pull_loop(backend, conn))


async def _pull_loop(backend: str, conn) -> None:
    puller = create_backend(TransferConfig(backend=backend, timeout=60.0))  # type: ignore[arg-type]
    await puller.start()
    while (job := await asyncio.to_thread(conn.recv)) is not None:
        address, handles = job
        pulled = await puller.pull_many(address, handles)
        landed = time.time()
        nbytes = sum(p.nbytes for p in pulled)
        for p in pulled:
            p.release()
        conn.send((landed, nbytes))
    await puller.close()


async def measure(prefill: Prefill, lengths: list[int], repeats: int) -> dict:
    harness = Harness(prefill)
    await harness.start()
    rows = {}
    try:
        await harness.run("warm", 64, True)
        for length in lengths:
            after, exposed, hidden, size, steps = [], [], [], 0, {False: [], True: []}
            for k in range(repeats):  # interleaved, so a slow spell of the machine hits both
                t = await harness.run(f"a-{length}-{k}", length, streamed=False)
                e = await harness.run(f"s-{length}-{k}", length, streamed=True)
                assert e.streamed and not t.streamed
                after.append(t.after_step)
                exposed.append(e.after_step)
                hidden.append(1.0 - e.after_step / t.after_step if t.after_step > 0 else 0.0)
                size = t.nbytes
                steps[False].append(t.step_seconds)
                steps[True].append(e.step_seconds)
            rows[length] = {
                "kv_bytes": size,
                "transfer_ms": _stat(after, 1000),
                "exposed_ms": _stat(exposed, 1000),
                "hidden": _stat(hidden, 1),
                "step_ms": _stat(steps[False], 1000),
                "streamed_step_ms": _stat(steps[True], 1000),
            }
    finally:
        await harness.close()
    return rows


def _stat(values: list[float], scale: float) -> dict:
    return {
        "median": round(statistics.median(values) * scale, 3),
        "min": round(min(values) * scale, 3),
        "max": round(max(values) * scale, 3),
    }


def table(rows: dict) -> str:
    lines = [
        "| prompt tokens | KV bytes | prefill step, ms (streamed) | transfer after prefill, ms "
        "| exposed when streamed, ms | hidden |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for length, r in rows.items():
        t, e, h = r["transfer_ms"], r["exposed_ms"], r["hidden"]
        lines.append(
            f"| {length} | {r['kv_bytes'] / 1e6:.1f} MB "
            f"| {r['step_ms']['median']:.0f} ({r['streamed_step_ms']['median']:.0f}) "
            f"| {t['median']:.1f} ({t['min']:.1f}–{t['max']:.1f}) "
            f"| {e['median']:.1f} ({e['min']:.1f}–{e['max']:.1f}) "
            f"| {100 * h['median']:.0f} % ({100 * h['min']:.0f}–{100 * h['max']:.0f}) |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small-llava")
    ap.add_argument("--model", type=Path, help="a checkpoint directory instead of a preset")
    ap.add_argument("--lengths", default="128,512,1024,2048")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--group", type=int, default=4, help="layers per KV transfer")
    ap.add_argument("--wire", type=KvWire, choices=list(KvWire), default=KvWire.NATIVE)
    ap.add_argument("--backend", choices=["auto", "ucx", "tcp"], default="auto")
    ap.add_argument("--threads", type=int, default=1, help="the prefill engine's torch threads")
    args = ap.parse_args()
    model = args.model or Path(".trident/models") / args.preset
    if args.model is None and not is_checkpoint_dir(model):
        write_checkpoint(model, args.preset, seed=0)
    lengths = [int(x) for x in args.lengths.split(",")]
    rate = single_thread_gflops()
    rows = asyncio.run(
        measure(Prefill(model, args.group, args.wire, args.backend, args.threads), lengths, args.repeats)
    )
    print(table(rows))
    print(
        json.dumps(
            {
                "matmul_gflops": round(rate, 1),
                "wire": args.wire,
                "group": args.group,
                "backend": args.backend,
                "overlap": rows,
            }
        )
    )
