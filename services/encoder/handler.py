"""The encode stage: pull a request's pixels, run the vision tower in the engine's stage-level
batches, then publish the features and queue the prefill task, which carries only their hashes
and references (small features ride inline). An image the gateway found in the cached prefix of
the prefill instance it routes to (`ImageSpec.in_prefix`) is passed by, unpulled and unencoded, on
an instance that hands on to prefill; one that prefills itself decides from its own cache."""

from __future__ import annotations

import logging
import time

from common.bus import Task
from common.engine.admission import encode_room
from common.engine.request import IN_PREFIX
from common.protocol import FeatureEntry, PrefillTask, RequestSpec, TensorRef, dtype_name
from common.roles import Role
from common.store import Stage
from common.store.features import FEATURE_TTL
from common.transfer import share
from services.encoder.served import ServedFeatures
from services.settings import WorkerSettings
from services.worker.context import StageContext
from services.worker.ledger import Held
from services.worker.stage import StageHandler

log = logging.getLogger(__name__)
SERVED_FEATURE_BYTES: int = WorkerSettings.model_fields["served_feature_bytes"].default


class EncodeHandler(StageHandler):
    role = Role.ENCODE
    hands_on_to = Role.PREFILL
    pull_rule = staticmethod(encode_room)
    takes_idle_cores = True  # its steps are what a request's TTFT waits on

    def __init__(self, ctx: StageContext, *, served_feature_bytes: int = SERVED_FEATURE_BYTES) -> None:
        super().__init__(ctx)
        self.served = ServedFeatures(ctx.transfer, served_feature_bytes, FEATURE_TTL)

    @classmethod
    def from_settings(cls, ctx: StageContext, settings: WorkerSettings) -> EncodeHandler:
        return cls(ctx, served_feature_bytes=settings.served_feature_bytes)

    def figures(self) -> tuple[list[tuple[str, float, str]], list[tuple[str, float, str]]]:
        served = self.served
        served.prune()
        evicted = (
            "served_feature_evictions",
            served.evictions,
            "Served image features dropped for the budget",
        )
        held = ("served_feature_bytes", served.bytes, "Bytes of image features served for prefill to pull")
        budget = ("served_feature_budget_bytes", served.budget, "TRIDENT_SERVED_FEATURE_BYTES")
        return [evicted], [held, budget]

    async def take(self, task: Task) -> None:
        ctx = self.ctx
        spec = await ctx.resumed(task)
        if spec is None:  # its choices resume, each with a task of its own
            return
        held = ctx.ledger.begin(spec, self.role, task)
        ctx.metrics.taken(self.role, task.stored)
        ctx.ledger.mark(held, Stage.ENCODE_STARTED, encode_instance=ctx.instance_id)
        passed = self._passed_by(spec)
        pixels, features = [], []
        for img, by in zip(spec.images, passed, strict=True):
            pixels.append(None if by or img.pixels is None else await ctx.pull(held, img.pixels))
            features.append(IN_PREFIX if by else None)
        ctx.counters.images_to_encode += sum(p is not None for p in pixels)
        await ctx.admit(held, pixels, features)

    def _passed_by(self, spec: RequestSpec) -> list[bool]:
        """Which images are passed by: those the gateway found in the prefix cached where the
        request is prefilled, unless that is here (this instance's engine then decides)."""
        here = Role.PREFILL in self.ctx.roles
        return [img.in_prefix and not here for img in spec.images]

    async def hand_on(self, held: Held) -> None:
        """Publish each image's features, index them by content hash, and queue the prefill task."""
        ctx = self.ctx
        rid = held.request_id
        req = await ctx.engine.call(lambda: ctx.engine.engine.handoff.handed_off(rid))
        ctx.ledger.check_live(held)  # (req is None only when the request was cancelled)
        images, entries, evicted = [], [], []
        mine = [img.content_hash for img in held.spec.images]
        for img, done in zip(held.spec.images, req.images, strict=True):
            if done.features is IN_PREFIX:  # passed by: the prefill instance has its KV
                images.append(img.model_copy(update={"in_prefix": False}))
                continue
            features = done.features.contiguous()
            # Always served and indexed, so any prefill instance can find them by hash; the task
            # itself carries small features inline and saves prefill the pull. Features are shared
            # by every request with this image, so they stay while used, within the byte budget.
            handle, dropped = self.served.serve(img.content_hash, features, keep=mine)
            evicted += dropped
            ref = TensorRef(
                owner=ctx.instance_id,
                address=ctx.transfer.address,
                handle=handle,
                shape=tuple(features.shape),
                dtype=dtype_name(features.dtype),
            )
            entries.append(FeatureEntry(content_hash=img.content_hash, ref=ref, created=time.time()))
            small = features.numel() * features.element_size() <= ctx.transfer.config.inline_max_bytes
            carried = share(ctx.transfer, features, ctx.instance_id) if small else ref
            pixels = img.pixels if isinstance(img.pixels, TensorRef) else None  # kept for a recompute
            images.append(img.model_copy(update={"pixels": pixels, "features": carried}))
        ctx.ledger.mark(held, Stage.ENCODE_ENDED, encode_instance=ctx.instance_id)
        ctx.metrics.ran(self.role, held.marks, Stage.ENCODE_STARTED)
        ctx.spans.record(held, "encode", Stage.ENCODE_STARTED, Stage.ENCODE_ENDED, images=len(images))
        encoded = held.spec.model_copy(update={"images": tuple(images)})
        to = held.task.message.prefill_to if held.task is not None else ""  # the gateway's choice
        await ctx.dispatch.send(PrefillTask(request=encoded), held.source, to=to or None)
        for entry in entries:  # after the task: it carries the refs; the index serves later requests
            await ctx.store.features.put(entry, ttl=FEATURE_TTL)
        await self._unindex(evicted)  # before the request settles: an idle encoder has done it
        await ctx.ledger.settle(rid)

    async def _unindex(self, evicted: list[str]) -> None:
        """Features no longer served leave the index (if it still names this encoder), so routing
        stops counting on them; a stale entry costs a prefill instance one failed pull."""
        try:
            for content_hash in evicted:
                await self.ctx.store.features.remove(content_hash, self.ctx.instance_id)
        except Exception as exc:
            log.warning("evicted features left in the index (%r)", exc)
