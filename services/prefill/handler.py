"""The prefill stage: pull a request's image features as soon as its task arrives (event-driven
prefetch, 002 §3.2), run chunked prefill, then export the KV by layer group and queue the decode
task, keeping the KV until decode has pulled it.

An image wholly inside the prefix this instance caches is neither pulled nor encoded: its KV is
here (the engine attaches the prefix at admission; if it was evicted meanwhile, the engine says so
and its features are fetched as any other's). Features that are not stored anywhere are computed
here from the image's pixels when this instance holds the vision tower (an EP or EPD instance the
gateway sent a turn to for its cached history), else the request goes back to the encode queue.

Fallbacks: features that cannot be pulled (owner gone, evicted) are recomputed here when this
instance holds the vision tower, else the request goes back to the encode queue; when its pixels
are gone too, the request fails with a retryable error.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import torch

from common.bus import Task
from common.engine import Engine, kv_quant
from common.engine.admission import PREFILL_WAITING, prefill_room
from common.engine.kv_cache import layer_groups
from common.engine.prefix import PrefixLost
from common.engine.request import IN_PREFIX, Request
from common.engine.spec_prompt import spec_prompt
from common.protocol import (
    DecodeTask,
    EncodeTask,
    ImageSpec,
    InlineTensor,
    KvGroup,
    KvLocation,
    KvWire,
    TensorRef,
    dtype_name,
)
from common.roles import Role
from common.store import Stage
from common.store.features import FEATURE_TTL
from common.transfer import TransferError, TransferPath
from services.prefill.kv_stream import StreamedKv, StreamSink
from services.settings import WorkerSettings
from services.worker.context import StageContext
from services.worker.ledger import Held
from services.worker.stage import StageHandler
from services.worker.stage_metrics import path_label

log = logging.getLogger(__name__)
KV_TTL = 120.0  # seconds prefill keeps exported KV when no release notice comes
TURN_POLL = 0.02  # seconds between looks at the engine while a task waits its turn


@dataclass(frozen=True)
class Prefilled:
    """What a decode task says of the prefill: the tokens, how many of them have KV, the rope
    offset, the prompt tokens found cached, the KV's wire format and, while it streams, the handle
    of the prefill's outcome (`tail`)."""

    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    num_tokens: int
    rope_delta: int
    cached_tokens: int
    wire: KvWire
    tail: str = ""


class PrefillHandler(StageHandler):
    role = Role.PREFILL
    hands_on_to = Role.DECODE
    pull_rule = staticmethod(prefill_room)
    takes_idle_cores = True  # its steps are what a request's TTFT waits on
    routed_by_prefix = True  # a prompt's cached prefix is what it skips computing

    def first_token(self, held: Held) -> None:
        """Prefill ends with the first token: it is what TTFT measures."""
        self.ctx.ledger.mark(held, Stage.PREFILL_ENDED)
        self.ctx.ledger.mark(held, Stage.FIRST_TOKEN)
        self.ctx.metrics.ran(self.role, held.marks, Stage.PREFILL_STARTED)
        prompt = len(held.spec.prompt_token_ids)
        self.ctx.spans.record(held, "prefill", Stage.PREFILL_STARTED, Stage.FIRST_TOKEN, prompt_tokens=prompt)

    def __init__(
        self,
        ctx: StageContext,
        *,
        prefetch: bool = True,
        kv_layer_group: int = 4,
        kv_wire: KvWire = KvWire.NATIVE,
        kv_stream: bool = True,
    ) -> None:
        super().__init__(ctx)
        self.prefetch = prefetch
        self.kv_layer_group = kv_layer_group
        self.kv_wire = kv_wire
        self.kv_stream = kv_stream  # read by the sink at each request's last prefill step
        engine = ctx.engine.engine
        sink = StreamSink(self, ctx.engine, dtype_name(engine.kv_spec.dtype))
        ctx.engine.post(lambda: engine.handoff.stream_kv(sink, kv_layer_group))

    @classmethod
    def from_settings(cls, ctx: StageContext, settings: WorkerSettings) -> PrefillHandler:
        return cls(
            ctx,
            prefetch=settings.prefetch,
            kv_layer_group=settings.kv_layer_group,
            kv_wire=settings.kv_wire,
            kv_stream=settings.kv_stream,
        )

    def finished(self, held: Held) -> None:
        """A request whose first token ended it here: a decoder that has its streamed KV learns so."""
        if held.kv_stream is not None:
            outputs = list(held.sent)

            def serve(queued: asyncio.Task) -> None:
                if not queued.cancelled() and queued.exception() is None and queued.result() is not None:
                    queued.result().finish(True, outputs)

            held.kv_stream.add_done_callback(serve)

    async def take(self, task: Task) -> None:
        ctx = self.ctx
        spec = await ctx.resumed(task)
        if spec is None:  # its choices resume, each with a task of its own
            return
        held = ctx.ledger.begin(spec, self.role, task)
        ctx.metrics.taken(self.role, task.stored)
        if spec.images and not self.prefetch:
            await self._wait_for_turn(held)
        cached = await self._cached_images(held)
        inputs = await self._inputs(held, cached)
        if inputs is None:
            return
        ctx.ledger.mark(held, Stage.PREFILL_STARTED, prefill_instance=ctx.instance_id)
        ctx.counters.prefills += 1
        try:
            await ctx.admit(held, *inputs)
        except PrefixLost as lost:  # evicted since it was looked at: fetch those as any other
            log.info("%s; fetching their features", lost)
            inputs = await self._inputs(held, set())
            if inputs is not None:
                await ctx.admit(held, *inputs)

    async def _cached_images(self, held: Held) -> set[int]:
        """The request's images whose KV the prefix cached here holds now (nothing to pull for them)."""
        spec, ctx = held.spec, self.ctx
        if not spec.images:
            return set()
        engine = ctx.engine.engine
        none = [None] * len(spec.images)
        try:
            prompt = spec_prompt(spec, engine.processor.placeholder_ids, none, none)
        except ValueError:
            return set()  # a prompt the engine cannot take: admission fails it, saying why
        outputs = list(spec.output_token_ids)
        return set(await ctx.engine.call(lambda: engine.handoff.cached_images(prompt, outputs)))

    async def _inputs(self, held: Held, cached: set[int]) -> tuple[list, list] | None:
        """Each image's pixels and features as the engine takes them: IN_PREFIX for those in
        `cached`, pulled features for the rest, or where they cannot be had their pixels to encode
        here if this instance holds the vision tower. None when the request went back to encode or
        failed (its pixels gone too)."""
        ctx, spec = self.ctx, held.spec
        features, lacking = await self._pull_features(held, cached)
        pixels: list[torch.Tensor | None] = [None] * len(spec.images)
        if lacking:
            ctx.ledger.check_live(held)  # (or dropped because the request was cancelled meanwhile)
            if Role.ENCODE not in ctx.roles:
                await self._send_back_to_encode(held)
                return None
            pixels = await self._pull_pixels(held, lacking)
            if pixels is None:
                ctx.ledger.check_live(held)
                await ctx.fail(
                    held.request_id, "service_unavailable", "image features and pixels are both gone; retry"
                )
                return None
            ctx.counters.images_to_encode += len(lacking)
        return pixels, features

    def announce(self, stream: StreamedKv) -> None:
        """On the event loop, while the request's last prefill step runs: queue its decode task,
        pointing at the KV the step is streaming (kv_stream.py)."""
        held = self.ctx.ledger.get(stream.request_id)
        if held is None or not self.ctx.ledger.live(held) or not held.holds_task:
            stream.release()  # cancelled meanwhile: nobody will pull it
            return
        self.ctx.ledger.keep_kv(held, stream.all_handles, KV_TTL)  # from now a cancel releases them
        held.kv_stream = asyncio.create_task(self._queue_streamed(held, stream))

    async def _queue_streamed(self, held: Held, stream: StreamedKv) -> StreamedKv | None:
        """Queue the decode task of a streaming request and settle its prefill task: from then on
        the decode task is the request's one task (a decoder that finds this instance dead sends
        it back to prefill). None if it could not be queued: it is handed on after its step then."""
        ctx = self.ctx
        # The groups as the engine streams them: as many layers each as the first one's buffer has.
        layers = layer_groups(ctx.engine.engine.kv_spec.num_layers, stream.shapes[0][0])
        groups = [
            KvGroup(layer_start=g.start, layer_end=g.stop, handle=handle, shape=shape)
            for g, handle, shape in zip(layers, stream.handles, stream.shapes, strict=True)
        ]
        prefilled = Prefilled(
            stream.prompt_token_ids,
            stream.output_token_ids,
            stream.num_tokens,
            stream.rope_delta,
            stream.cached_tokens,
            stream.wire,
            stream.tail,
        )
        task = self._decode_task(held, groups, prefilled)
        try:
            await ctx.dispatch.send(task, held.source)
        except Exception as exc:
            log.warning("decode task of %s not queued as its KV streamed (%r)", held.request_id, exc)
            if ctx.ledger.get(held.request_id) is held:
                ctx.ledger.withdraw_kv(held)
            return None
        await ctx.ledger.settle(held.request_id, keep_outputs=True)  # until its outcome is served
        return stream

    async def hand_on(self, held: Held) -> None:
        """Export the KV per group of layers, serve the buffers, and queue the decode task; for a
        request whose KV streamed, serve its outcome and let the engine's blocks go."""
        ctx, rid, group, wire = self.ctx, held.request_id, self.kv_layer_group, self.kv_wire
        if held.kv_stream is not None:
            if (stream := await held.kv_stream) is not None:
                ctx.ledger.check_live(held)
                ctx.ledger.leave_engine(held)  # the handles hold copies of the KV
                stream.finish(False, held.sent)
                held.sent = []  # the decoder answers for them once it has the outcome
                return
            held.kv_stream = None  # its decode task was not queued: hand it on as if unstreamed
        req, shapes, buffers, ready = await ctx.engine.call(
            lambda: _export(ctx.engine.engine, rid, group, wire)
        )
        ctx.ledger.check_live(held)  # (req is None only when the request was cancelled)
        groups, handles = [], []
        spec = ctx.engine.engine.kv_spec
        for layers, shape, buf in zip(layer_groups(spec.num_layers, group), shapes, buffers, strict=True):
            if buf.numel() * buf.element_size() <= ctx.transfer.config.inline_max_bytes:
                # Rides inline in the decode task: nothing to pull, nothing to release.
                kv_group = KvGroup(
                    layer_start=layers.start,
                    layer_end=layers.stop,
                    shape=shape,
                    inline=InlineTensor.from_tensor(buf),
                )
            else:
                # Served until released: the ledger owns it.
                handles.append(ctx.transfer.publish(buf, ready=ready))
                kv_group = KvGroup(
                    layer_start=layers.start, layer_end=layers.stop, handle=handles[-1], shape=shape
                )
            groups.append(kv_group)
        ctx.ledger.keep_kv(held, tuple(handles), KV_TTL)  # before any await: a cancel releases them
        prefilled = Prefilled(
            tuple(req.prompt_token_ids),
            tuple(req.output_token_ids),
            req.num_computed_tokens,
            req.rope_delta,
            req.num_cached_tokens,
            wire,
        )
        task = self._decode_task(held, groups, prefilled)
        await ctx.dispatch.send(task, held.source)
        await ctx.ledger.settle(rid)  # the KV stays until decode says it has it

    def _decode_task(self, held: Held, groups: list[KvGroup], prefilled: Prefilled) -> DecodeTask:
        """The request's decode task, its KV served here in `groups`."""
        ctx, spec = self.ctx, self.ctx.engine.engine.kv_spec
        location = KvLocation(
            owner=ctx.instance_id,
            address=ctx.transfer.address,
            groups=tuple(groups),
            num_tokens=prefilled.num_tokens,
            block_size=spec.block_size,
            dtype=dtype_name(spec.dtype),
            rope_delta=prefilled.rope_delta,
            wire=prefilled.wire,
            tail=prefilled.tail,
        )
        # The outputs' log-probabilities made here ride along: the decoder answers for them now.
        outputs = prefilled.output_token_ids
        logprobs = tuple(held.sent_logprobs[: len(outputs)]) if any(held.sent_logprobs) else ()
        update = {
            "prompt_token_ids": prefilled.prompt_token_ids,
            "output_token_ids": outputs,
            "output_logprobs": logprobs,
        }
        request = held.spec.model_copy(update=update)
        return DecodeTask(request=request, kv=location, cached_tokens=prefilled.cached_tokens)

    async def watch(self) -> None:
        """Decode has pulled a request's KV: free it here."""
        async with await self.ctx.bus.events.releases(self.ctx.instance_id) as stream:
            async for release in stream:
                await self.ctx.ledger.release_kv(release.request_id)

    async def _wait_for_turn(self, held: Held) -> None:
        """Without prefetch: wait until the engine has no request waiting to start, so that this one
        would be scheduled next, and only then pull its features: the transfer is not overlapped with
        queueing. Raises Cancelled if the request was cancelled meanwhile.

        The wait is bounded: the tasks fetched with this one wait unheld behind it, and JetStream
        redelivers a task not settled or marked in progress within ack_wait."""
        ctx = self.ctx
        deadline = time.monotonic() + ctx.bus.config.ack_wait / (2 * PREFILL_WAITING)
        while ctx.engine.stats.waiting > 0 and time.monotonic() < deadline:
            await asyncio.sleep(TURN_POLL)
            ctx.ledger.check_live(held)

    async def _pull_features(
        self, held: Held, cached: set[int]
    ) -> tuple[list[torch.Tensor | None], list[int]]:
        """Each image's features (IN_PREFIX for those in `cached`), and the images whose features
        cannot be had (owner gone, evicted, never stored). On an instance without the vision tower
        the first such image ends the pulls: the request goes back to encode whole."""
        ctx = self.ctx
        out: list[torch.Tensor | None] = []
        lacking: list[int] = []
        paths: list[TransferPath] = []
        todo = [img for i, img in enumerate(held.spec.images) if i not in cached]
        if todo:
            ctx.ledger.mark(held, Stage.EP_TRANSFER_STARTED)
        for i, img in enumerate(held.spec.images):
            if i in cached:
                out.append(IN_PREFIX)
                continue
            pulled = await self._pull_one(held, img)
            if pulled is None:
                lacking.append(i)
                if Role.ENCODE not in ctx.roles:
                    return out, lacking
                out.append(None)
                continue
            out.append(pulled[0])
            paths.append(pulled[1])
        if todo and not lacking:
            nbytes = sum(t.numel() * t.element_size() for t in out if t is not IN_PREFIX)
            path = path_label(paths)
            ctx.ledger.mark(held, Stage.EP_TRANSFER_ENDED, ep_path=path, ep_bytes=str(nbytes))
            seconds = held.marks[Stage.EP_TRANSFER_ENDED] - held.marks[Stage.EP_TRANSFER_STARTED]
            ctx.metrics.transferred("ep", seconds, nbytes, path)
            ctx.spans.record(
                held, "transfer", Stage.EP_TRANSFER_STARTED, Stage.EP_TRANSFER_ENDED, hop="ep", bytes=nbytes
            )
        return out, lacking

    async def _pull_one(self, held: Held, img: ImageSpec) -> tuple[torch.Tensor, TransferPath] | None:
        """One image's features and the path they came by, from the ref its task carries or the
        feature index; None when they cannot be had."""
        ctx = self.ctx
        ref = img.features
        if ref is None:
            found = await ctx.store.features.get_many_touched([img.content_hash], FEATURE_TTL)
            ref = found[img.content_hash].ref if found else None
        if ref is None and Role.ENCODE in ctx.roles:
            return None  # stored nowhere: encoded here, as the gateway may have meant
        try:
            if ref is None:
                raise TransferError(f"no features registered for image {img.content_hash[:12]}")
            return await ctx.pull_with_path(held, ref)
        except TransferError as exc:
            log.warning("features of %s for %s unavailable (%s)", img.content_hash[:12], held.request_id, exc)
            ctx.counters.feature_fetch_failures += 1
            if isinstance(ref, TensorRef):
                await ctx.store.features.remove(img.content_hash, ref.owner)
            return None

    async def _pull_pixels(self, held: Held, indices: list[int]) -> list[torch.Tensor | None] | None:
        """The pixels of the images at `indices` (None for the rest); None when any are gone."""
        try:
            return [
                await self.ctx.pull(held, img.pixels) if i in indices else None
                for i, img in enumerate(held.spec.images)
            ]
        except TransferError as exc:
            log.warning("pixels of %s unavailable: %s", held.request_id, exc)
            return None

    async def _send_back_to_encode(self, held: Held) -> None:
        ctx, spec = self.ctx, held.spec
        if any(img.pixels is None for img in spec.images):
            await ctx.fail(
                spec.request_id,
                "service_unavailable",
                "image features are gone and no pixels travel with them",
            )
            return
        retry = spec.model_copy(
            update={"images": tuple(i.model_copy(update={"features": None}) for i in spec.images)}
        )
        await ctx.dispatch.send(EncodeTask(request=retry), held.source)
        await ctx.ledger.settle(spec.request_id)


def _export(
    engine: Engine, rid: str, group: int, wire: KvWire
) -> tuple[Request | None, list[tuple[int, ...]], list[torch.Tensor], torch.cuda.Event | None]:
    """On the engine thread: the handed-off request, and its KV by group of layers: each buffer's
    shape, the buffer as it travels (packed by kv_quant on the INT8 wire), and on a GPU the event
    behind the copies on the engine's stream (a same-host decoder reads them only after it)."""
    req = engine.handoff.handed_off(rid)
    if req is None:
        return None, [], [], None
    buffers = engine.handoff.export_kv(rid, group)
    shapes = [tuple(b.shape) for b in buffers]
    buffers = [kv_quant.pack(b) for b in buffers] if wire == KvWire.INT8 else buffers
    ready = None
    if buffers and buffers[0].device.type == "cuda":
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(buffers[0].device))
    return req, shapes, buffers, ready
