"""Modality-aware routing (002 §3.4) and task publishing: text-only requests, and requests whose
image features are all in the feature store, go straight to prefill; the rest go to encode."""

from __future__ import annotations

import time

from common.engine.processor import ProcessedPrompt
from common.errors import APIError
from common.protocol import (
    EncodeTask,
    ImageSpec,
    PrefillTask,
    RequestSpec,
    SamplingParams,
    TensorRef,
    dtype_name,
)
from common.roles import Role

PIXEL_TTL = 300.0  # seconds the gateway serves pixels too large to ride inline


async def live_roles(store) -> set[Role]:
    return {role for hb in await store.registry.instances() for role in hb.roles if not hb.draining}


async def route(gw, rid: str, prompt: ProcessedPrompt, sampling: SamplingParams) -> Role:
    """Pick the first stage, check an instance can serve it, record the request and queue the task;
    returns the stage it went to."""
    hashes = [img.content_hash for img in prompt.images]
    stored = await gw.store.features.get_many(hashes) if hashes else {}
    needs_encode = any(h not in stored for h in hashes)
    roles = await live_roles(gw.store)
    needed = ({Role.ENCODE} if needs_encode else set()) | {Role.PREFILL, Role.DECODE}
    missing = sorted(needed - roles)
    if missing:
        raise APIError(
            503, f"no live instance serves {', '.join(missing)}; start one and retry", code="no_instance"
        )
    images = []
    for img in prompt.images:
        # Pixels stay on the gateway, served by handle: the encoder pulls them, and a prefill
        # instance that cannot fetch the features later recomputes from them.
        pixels = gw.transfer.publish(img.pixel_values.contiguous(), ttl=PIXEL_TTL)
        ref = TensorRef(
            owner=gw.instance_id, address=gw.transfer.address, handle=pixels,
            shape=tuple(img.pixel_values.shape), dtype=dtype_name(img.pixel_values.dtype),
        )  # fmt: skip
        features = None if needs_encode else stored[img.content_hash].ref
        images.append(
            ImageSpec(content_hash=img.content_hash, num_tokens=img.num_tokens, pixels=ref, features=features)
        )
    spec = RequestSpec(
        request_id=rid,
        prompt_token_ids=tuple(prompt.token_ids),
        images=tuple(images),
        sampling=sampling,
        arrival_time=time.time(),
    )
    await gw.store.requests.create(
        rid,
        arrival=spec.arrival_time,
        prompt_tokens=len(prompt.token_ids),
        num_images=len(images),
        image_tokens=sum(i.num_tokens for i in images),
        max_tokens=sampling.max_tokens,
    )
    task = EncodeTask(request=spec) if needs_encode else PrefillTask(request=spec)
    await gw.dispatch.send(task, "gateway")
    gw.metrics.routed.labels(task.ROLE).inc()
    return task.ROLE
