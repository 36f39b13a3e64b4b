"""Turning engine outputs into messages: token deltas and finals to the gateway, stage hand-offs
to the next stage's queue (with the tensors published on the transfer backend)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from common.engine import RequestOutput
from common.engine.kv_cache import layer_groups
from common.protocol import (
    DecodeTask,
    ErrorOutput,
    FeatureEntry,
    FinalOutput,
    InlineTensor,
    KvGroup,
    KvLocation,
    PrefillTask,
    RequestSpec,
    TensorRef,
    TokenDelta,
    Usage,
    dtype_name,
)
from common.store import Stage
from common.transfer import share
from services.worker.state import KeptKV

if TYPE_CHECKING:
    from services.worker.worker import StageWorker

log = logging.getLogger(__name__)
FEATURE_TTL = 600.0  # seconds an encoder keeps published features (and their index entry)
KV_TTL = 120.0  # seconds prefill keeps exported KV when no release notice comes


async def publish_outputs(w: StageWorker, outputs: list[RequestOutput]) -> None:
    for out in outputs:
        try:
            await _publish_one(w, out)
        except Exception as exc:  # one request's failure must not stop the others' outputs
            log.exception("output of %s failed", out.request_id)
            await fail_request(w, out.request_id, "server_error", f"internal error: {exc}")


async def _publish_one(w: StageWorker, out: RequestOutput) -> None:
    if out.request_id not in w.held:
        return  # aborted meanwhile
    if out.new_token_ids:
        index = out.num_output_tokens - len(out.new_token_ids)
        await w.bus.events.publish_output(
            TokenDelta(request_id=out.request_id, index=index, token_ids=out.new_token_ids)
        )
        if index == 0:
            w.record.mark(out.request_id, Stage.PREFILL_ENDED)
            w.record.mark(out.request_id, Stage.FIRST_TOKEN)
        w.counters.tokens_generated += len(out.new_token_ids)
    if out.finished:
        usage = Usage(prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens)
        final = FinalOutput(
            request_id=out.request_id,
            finish_reason=out.finish_reason,
            usage=usage,
            num_outputs=out.num_output_tokens,
        )
        await w.bus.events.publish_output(final)
        w.record.finish(out.request_id, out.num_output_tokens, out.finish_reason)
        w.counters.finished += 1
        await w.settle(out.request_id)
    elif out.handed_off == "encoded":
        await hand_off_encoded(w, out.request_id)
    elif out.handed_off == "prefilled":
        await hand_off_prefilled(w, out.request_id)


async def hand_off_encoded(w: StageWorker, rid: str) -> None:
    """Publish the features, index them by content hash, and queue the prefill task (hashes only)."""
    req = await w.loop.call(lambda: w.engine.handed_off[rid])
    spec: RequestSpec = w.specs[rid]
    images, entries = [], []
    for img, done in zip(spec.images, req.images, strict=True):
        features = done.features.contiguous()
        # Always published and indexed, so any prefill instance can find it by hash; the task
        # itself carries small features inline and saves prefill the pull.
        handle = w.transfer.publish(features, ttl=FEATURE_TTL)
        ref = TensorRef(
            owner=w.instance_id,
            address=w.transfer.address,
            handle=handle,
            shape=tuple(features.shape),
            dtype=dtype_name(features.dtype),
        )
        entries.append(FeatureEntry(content_hash=img.content_hash, ref=ref, created=time.time()))
        carried = share(w.transfer, features, w.instance_id) if _small(w, features) else ref
        pixels = img.pixels if isinstance(img.pixels, TensorRef) else None  # kept for recompute
        images.append(img.model_copy(update={"pixels": pixels, "features": carried}))
    w.record.mark(rid, Stage.ENCODE_ENDED, encode_instance=w.instance_id)
    next_spec = spec.model_copy(update={"images": tuple(images)})
    w.record.mark(rid, Stage.PREFILL_QUEUED)
    await w.bus.tasks.publish(PrefillTask(request=next_spec), msg_id=w.msg_id(rid, "prefill"))
    for entry in entries:  # after the task: it carries the refs, the index serves later requests
        await w.store.features.put(entry, ttl=FEATURE_TTL)
    await w.loop.call(lambda: w.engine.release(rid))
    await w.settle(rid)


def _small(w: StageWorker, t) -> bool:
    return t.numel() * t.element_size() <= w.transfer.config.inline_max_bytes


async def hand_off_prefilled(w: StageWorker, rid: str) -> None:
    """Export the KV per group of layers, publish the buffers, and queue the decode task."""
    group = w.settings.kv_layer_group
    req, buffers = await w.loop.call(lambda: (w.engine.handed_off[rid], w.engine.export_kv(rid, group)))
    groups, handles = [], []
    for layers, buf in zip(layer_groups(w.engine.kv_spec.num_layers, group), buffers, strict=True):
        if _small(w, buf):  # rides inline in the decode task: nothing to pull, nothing to release
            inline = InlineTensor.from_tensor(buf)
            groups.append(
                KvGroup(layer_start=layers.start, layer_end=layers.stop, shape=buf.shape, inline=inline)
            )
            continue
        handle = w.transfer.publish(buf, ttl=KV_TTL)
        handles.append(handle)
        groups.append(
            KvGroup(layer_start=layers.start, layer_end=layers.stop, handle=handle, shape=tuple(buf.shape))
        )
    w.kept_kv[rid] = KeptKV(rid, handles, time.time() + KV_TTL)  # blocks stay until decode releases
    spec: RequestSpec = w.specs[rid]
    location = KvLocation(
        owner=w.instance_id,
        address=w.transfer.address,
        groups=tuple(groups),
        num_tokens=req.num_computed_tokens,
        block_size=w.engine.config.block_size,
        dtype=dtype_name(w.engine.kv_spec.dtype),
    )
    prefilled = spec.model_copy(
        update={
            "prompt_token_ids": tuple(req.prompt_token_ids),
            "output_token_ids": tuple(req.output_token_ids),
        }
    )
    task = DecodeTask(request=prefilled, kv=location)
    await w.bus.tasks.publish(task, msg_id=w.msg_id(rid, "decode"))
    await w.settle(rid, keep_spec=False)


async def fail_request(w: StageWorker, rid: str, code: str, message: str) -> None:
    """Tell the gateway the request failed, drop it here, and settle its task (it will not retry)."""
    w.counters.errors += 1
    try:
        await w.bus.events.publish_output(ErrorOutput(request_id=rid, code=code, message=message))
    finally:
        await w.loop.call(lambda: w.engine.abort(rid))
        await w.settle(rid)
