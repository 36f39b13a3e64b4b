"""One handler per task kind: admit the request into the engine (after pulling what it needs)."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import torch

from common.bus import Task
from common.engine import AdmissionError
from common.engine.admission import PREFILL_WAITING
from common.engine.processor import InputError
from common.protocol import DecodeTask, EncodeTask, PrefillTask, Release, RequestSpec, TensorRef
from common.roles import Role
from common.store import Stage
from common.transfer import TransferError, fetch
from services.worker.convert import to_prompt
from services.worker.outputs import fail_request
from services.worker.state import Held

if TYPE_CHECKING:
    from services.worker.worker import StageWorker

log = logging.getLogger(__name__)
ADMIT_POLL = 0.02  # seconds between looks at the engine while a task waits (KV blocks, its turn)


async def handle_encode(w: StageWorker, task: Task) -> None:
    spec = await _resumed(w, task)
    rid = spec.request_id
    w.begin(Held(rid, task), spec)
    w.record.mark(rid, Stage.ENCODE_STARTED, encode_instance=w.instance_id)
    pixels = []
    for img in spec.images:
        pixels.append(await _pull_tensor(w, img.pixels) if img.pixels is not None else None)
    w.counters.images_encoded += sum(p is not None for p in pixels)
    await _admit(w, rid, spec, pixels, [None] * len(spec.images))


async def handle_prefill(w: StageWorker, task: Task) -> None:
    spec = await _resumed(w, task)
    rid = spec.request_id
    w.begin(Held(rid, task), spec)
    if spec.images and not w.settings.prefetch and not await _wait_for_turn(w, rid):
        return  # cancelled while it waited
    features, pixels = await _pull_features(w, rid, spec), [None] * len(spec.images)
    if features is None:  # lost: recompute here if we hold the vision tower, else send it back
        if Role.ENCODE not in w.roles:
            await _send_back_to_encode(w, rid, spec)
            return
        pixels, features = await _pull_pixels(w, spec), [None] * len(spec.images)
        if pixels is None:
            await fail_request(
                w, rid, "service_unavailable", "image features and pixels are both gone; retry"
            )
            return
    w.record.mark(rid, Stage.PREFILL_STARTED, prefill_instance=w.instance_id)
    w.counters.prefills += 1
    await _admit(w, rid, spec, pixels, features)


async def _wait_for_turn(w: StageWorker, rid: str) -> bool:
    """Without prefetch: wait until the engine has no request waiting to start, so that this one
    would be scheduled next, and only then pull its features: the transfer is not overlapped with
    queueing. False if the request was cancelled meanwhile.

    The wait is bounded: the tasks fetched with this one wait unheld behind it, and JetStream
    redelivers a task not settled or marked in progress within ack_wait."""
    deadline = time.monotonic() + w.bus.config.ack_wait / (2 * PREFILL_WAITING)
    while w.loop.stats.get("waiting", 0) > 0 and time.monotonic() < deadline:
        if rid not in w.held:
            return False
        await asyncio.sleep(ADMIT_POLL)
    return rid in w.held


async def _pull_features(w: StageWorker, rid: str, spec) -> list[torch.Tensor] | None:
    """Fetch every image's features (as soon as the task arrives: event-driven prefetch, 002 §3.2).
    None when any cannot be had (owner gone, evicted): the caller recomputes."""
    if not spec.images:
        return []
    w.record.mark(rid, Stage.EP_TRANSFER_STARTED)
    out = []
    for img in spec.images:
        ref = img.features
        if ref is None:
            entry = await w.store.features.get(img.content_hash)
            ref = entry.ref if entry is not None else None
        try:
            if ref is None:
                raise TransferError(f"no features registered for image {img.content_hash[:12]}")
            out.append(await _pull_tensor(w, ref))
        except TransferError as exc:
            log.warning(
                "features of %s for %s unavailable (%s); recomputing", img.content_hash[:12], rid, exc
            )
            w.counters.feature_fetch_failures += 1
            if isinstance(ref, TensorRef):
                await w.store.features.remove(img.content_hash, ref.owner)
            return None
    w.record.mark(rid, Stage.EP_TRANSFER_ENDED)
    return out


async def _pull_pixels(w: StageWorker, spec) -> list[torch.Tensor] | None:
    try:
        return [await _pull_tensor(w, img.pixels) for img in spec.images]
    except (TransferError, AttributeError) as exc:
        log.warning("pixels of %s unavailable: %s", spec.request_id, exc)
        return None


async def _pull_tensor(w: StageWorker, ref) -> torch.Tensor:
    if ref is None:
        raise TransferError("nothing to pull")
    pulled = await fetch(w.transfer, ref)
    tensor = pulled.tensor.clone()  # the pool buffer goes back for reuse
    pulled.release()
    return tensor


async def _send_back_to_encode(w: StageWorker, rid: str, spec) -> None:
    if any(img.pixels is None for img in spec.images):
        await fail_request(
            w, rid, "service_unavailable", "image features are gone and no pixels travel with them"
        )
        return
    retry = spec.model_copy(
        update={"images": tuple(i.model_copy(update={"features": None}) for i in spec.images)}
    )
    await w.bus.tasks.publish(EncodeTask(request=retry), msg_id=w.msg_id(rid, "encode"))
    w.record.mark(rid, Stage.ENCODE_QUEUED)
    await w.settle(rid)


async def handle_decode(w: StageWorker, task: Task) -> None:
    msg: DecodeTask = task.message
    spec = msg.request
    rid = spec.request_id
    need = len(spec.prompt_token_ids) + spec.sampling.max_tokens
    capacity = w.engine.blocks.num_blocks * w.engine.config.block_size
    if need > capacity:
        await fail_request(
            w, rid, "service_unavailable",
            f"the request needs {need} tokens of KV cache and a decode instance holds {capacity}",
        )  # fmt: skip
        return
    # Hold the task while blocks free up, rather than give it back: every nak counts as a delivery,
    # and a request that waits out its deliveries would be dead-lettered and never answered. The
    # keep-alive loop extends a held task's ack deadline; this instance pulls nothing else meanwhile.
    w.begin(Held(rid, task))
    if task.deliveries > 1:
        # The decoder that had it may have died mid-generation: the KV this task points to covers
        # only the tokens before the task, and the client has seen more. Resume from those.
        streamed = await _streamed(w, rid, spec.output_token_ids)
        if len(streamed) > len(spec.output_token_ids):
            await _release(w, msg)
            await _back_to_prefill(w, msg, streamed)
            return
    while not await w.loop.call(lambda: w.engine.can_admit(need)):
        if rid not in w.held:
            return  # cancelled while waiting
        if w.draining:
            w.held.pop(rid, None)
            await task.nak()  # another replica takes it
            return
        await asyncio.sleep(ADMIT_POLL)
    w.record.mark(rid, Stage.PD_TRANSFER_STARTED, decode_instance=w.instance_id)
    buffers, refs = [], iter(msg.kv.refs())
    try:
        for group in msg.kv.groups:  # one transfer per group of layers (002 §3.3)
            buffers.append(group.inline.to_tensor() if group.inline else await _pull_tensor(w, next(refs)))
    except TransferError as exc:
        # The prefill instance is gone or dropped the KV (or released it to a decoder that died):
        # prefill the request again over its prompt and the tokens the client has already seen.
        log.warning("KV of %s unavailable (%s); sending it back to prefill", rid, exc)
        w.counters.kv_pull_failures += 1
        await _back_to_prefill(w, msg, await _streamed(w, rid, spec.output_token_ids))
        return
    w.record.mark(rid, Stage.PD_TRANSFER_ENDED)
    try:
        await w.loop.call(
            lambda: w.engine.add_prefilled(
                rid, list(spec.prompt_token_ids), list(spec.output_token_ids), spec.sampling, buffers
            )
        )
    except AdmissionError as exc:
        await fail_request(w, rid, "invalid_request_error", str(exc))
        return
    await _release(w, msg)
    w.record.mark(rid, Stage.DECODE_STARTED)
    w.counters.decodes_admitted += 1


async def _release(w: StageWorker, msg: DecodeTask) -> None:
    """Tell the prefill instance that holds the request's KV to free it."""
    handles = tuple(r.handle for r in msg.kv.refs())
    release = Release(request_id=msg.request.request_id, owner=msg.kv.owner, handles=handles)
    await w.bus.events.release(release)


async def _back_to_prefill(w: StageWorker, msg: DecodeTask, outputs: tuple[int, ...]) -> None:
    """Queue the request for prefill again, over its prompt and `outputs` (the tokens the client has)."""
    spec = msg.request.model_copy(update={"output_token_ids": outputs})
    await w.bus.tasks.publish(PrefillTask(request=spec), msg_id=w.msg_id(spec.request_id, "prefill"))
    await w.settle(spec.request_id)


async def _resumed(w: StageWorker, task: Task) -> RequestSpec:
    """The task's request, resuming from the tokens already streamed if this is a redelivery: the
    instance that had it may have died while generating (a hybrid holds its task until the end)."""
    spec: RequestSpec = task.message.request
    if task.deliveries == 1:
        return spec
    return spec.model_copy(
        update={"output_token_ids": await _streamed(w, spec.request_id, spec.output_token_ids)}
    )


async def _streamed(w: StageWorker, rid: str, known: tuple[int, ...]) -> tuple[int, ...]:
    """The output tokens a request resumes from: the gateway's journal of what it streamed, when
    that extends what the task knows (`known`: tokens generated before the task was queued)."""
    try:
        journal = tuple(await w.store.requests.streamed_outputs(rid))
    except Exception as exc:  # no journal: resume from what the task knows, still correct
        log.warning("output journal of %s unreadable: %r", rid, exc)
        return known
    if len(journal) > len(known) and journal[: len(known)] == known:
        w.counters.resumed_tokens += len(journal) - len(known)
        return journal
    return known


async def _admit(w: StageWorker, rid: str, spec, pixels, features) -> None:
    params = spec.sampling
    try:
        prompt = to_prompt(spec, w.engine.processor.image_token_id, pixels, features)
        outputs = spec.output_token_ids
        await w.loop.call(
            lambda: w.engine.add_request(prompt, params=params, request_id=rid, output_token_ids=outputs)
        )
    except (AdmissionError, InputError, ValueError) as exc:
        await fail_request(w, rid, "invalid_request_error", str(exc))


HANDLERS = {"encode": handle_encode, "prefill": handle_prefill, "decode": handle_decode}
TASK_TYPES = {"encode": EncodeTask, "prefill": PrefillTask, "decode": DecodeTask}
