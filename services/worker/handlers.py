"""One handler per task kind: admit the request into the engine (after pulling what it needs)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from common.bus import Task
from common.engine import AdmissionError
from common.engine.processor import InputError
from common.protocol import DecodeTask, EncodeTask, PrefillTask, Release, TensorRef
from common.store import Stage
from common.transfer import TransferError, fetch
from services.worker.convert import to_params, to_prompt
from services.worker.outputs import fail_request
from services.worker.state import Held

if TYPE_CHECKING:
    from services.worker.worker import StageWorker

log = logging.getLogger(__name__)


async def handle_encode(w: StageWorker, task: Task) -> None:
    spec = task.message.request
    rid = spec.request_id
    w.begin(Held(rid, "encode", task, spec.arrival_time, len(spec.prompt_token_ids)), spec)
    await w.store.requests.mark(rid, Stage.ENCODE_STARTED, encode_instance=w.instance_id)
    pixels = []
    for img in spec.images:
        pulled = await fetch(w.transfer, img.pixels) if img.pixels is not None else None
        pixels.append(None if pulled is None else pulled.tensor.clone())
    w.counters.images_encoded += sum(p is not None for p in pixels)
    await _admit(w, rid, spec, pixels, [None] * len(spec.images))


async def handle_prefill(w: StageWorker, task: Task) -> None:
    spec = task.message.request
    rid = spec.request_id
    w.begin(Held(rid, "prefill", task, spec.arrival_time, len(spec.prompt_token_ids)), spec)
    features = await _pull_features(w, rid, spec) if spec.images else []
    if features is None:
        return  # failed and reported
    await w.store.requests.mark(rid, Stage.PREFILL_STARTED, prefill_instance=w.instance_id)
    w.counters.prefills += 1
    await _admit(w, rid, spec, [None] * len(spec.images), features)


async def _pull_features(w: StageWorker, rid: str, spec) -> list[torch.Tensor] | None:
    """Fetch every image's features (event-driven prefetch: started as soon as the task arrives)."""
    await w.store.requests.mark(rid, Stage.EP_TRANSFER_STARTED)
    out = []
    for img in spec.images:
        ref = img.features
        if ref is None:
            entry = await w.store.features.get(img.content_hash)
            ref = entry.ref if entry is not None else None
        try:
            if ref is None:
                raise TransferError(f"no features registered for image {img.content_hash[:12]}")
            pulled = await fetch(w.transfer, ref)
            out.append(pulled.tensor.clone())
            pulled.release()
        except TransferError as exc:
            w.counters.feature_fetch_failures += 1
            if isinstance(ref, TensorRef):
                await w.store.features.remove(img.content_hash, ref.owner)
            # The pixels stayed with the gateway's encode task, so recomputing needs the client's
            # request again; report it as retryable.
            await fail_request(w, rid, "service_unavailable", f"image features unavailable ({exc}); retry")
            return None
    await w.store.requests.mark(rid, Stage.EP_TRANSFER_ENDED)
    return out


async def handle_decode(w: StageWorker, task: Task) -> None:
    msg: DecodeTask = task.message
    rid = msg.request_id
    need = len(msg.prompt_token_ids) + msg.sampling.max_tokens
    if not await w.loop.call(lambda: w.engine.can_admit(need)):
        await task.nak(delay=0.05)  # no room after all: another replica (or we, later) takes it
        return
    w.begin(Held(rid, "decode", task, msg.arrival_time, len(msg.prompt_token_ids), len(msg.output_token_ids)))
    await w.store.requests.mark(rid, Stage.PD_TRANSFER_STARTED, decode_instance=w.instance_id)
    buffers = []
    try:
        for ref in msg.kv.refs():
            pulled = await w.transfer.pull(ref.address, ref.handle)
            buffers.append(pulled.tensor.clone())
            pulled.release()
    except TransferError as exc:
        w.counters.kv_pull_failures += 1
        await fail_request(w, rid, "service_unavailable", f"KV cache of the request was lost ({exc}); retry")
        return
    await w.store.requests.mark(rid, Stage.PD_TRANSFER_ENDED)
    params = to_params(msg.sampling)
    try:
        await w.loop.call(
            lambda: w.engine.add_prefilled(
                rid, list(msg.prompt_token_ids), list(msg.output_token_ids), params, buffers
            )
        )
    except AdmissionError as exc:
        await fail_request(w, rid, "invalid_request_error", str(exc))
        return
    await w.bus.events.release(
        Release(request_id=rid, owner=msg.kv.owner, handles=tuple(r.handle for r in msg.kv.refs()))
    )
    await w.store.requests.mark(rid, Stage.DECODE_STARTED)
    w.counters.decodes_admitted += 1


async def _admit(w: StageWorker, rid: str, spec, pixels, features) -> None:
    params = to_params(spec.sampling)
    try:
        prompt = to_prompt(spec, w.engine.processor.image_token_id, pixels, features)
        await w.loop.call(lambda: w.engine.add_request(prompt, params=params, request_id=rid))
    except (AdmissionError, InputError, ValueError) as exc:
        await fail_request(w, rid, "invalid_request_error", str(exc))


HANDLERS = {"encode": handle_encode, "prefill": handle_prefill, "decode": handle_decode}
TASK_TYPES = {"encode": EncodeTask, "prefill": PrefillTask, "decode": DecodeTask}
