"""Modality-aware routing (002 §3.4) and task publishing: text-only requests, and requests whose
image features are all in the feature store, go straight to prefill; the rest go to encode. An
image wholly inside the prefix cached on the prefill instance chosen for the request (kv_routing.py)
needs no encoding and no features: its KV is there. So a turn that resends only history images goes
straight to that instance, and one that also adds an image goes there too when it holds the vision
tower (EP, EPD: it encodes the new image itself), else through encode with the history images marked
to pass by. The prefill instance checks its own cache and, if the prefix was evicted meanwhile,
fetches or recomputes those features as it does for any lost ones.

Redis holds what routing reads (the registry, the feature index) but is not needed to route: while
it restarts, features count as not stored and routing waits, a bounded time, for the registry to
show an instance of every stage the request needs before answering 503.

A stage with no live instance (scaled to zero, its first instance still loading, or its last one
dead) is waited for the same way: the request is held (TRIDENT_HOLD_TIMEOUT, at most
TRIDENT_MAX_HELD at once) and goes on as soon as an instance registers, or ends with a 503 that says
which stage it waited for."""

from __future__ import annotations

import asyncio
import logging
import time

from common.bus import PublishError, QueueFull
from common.engine.processor import ProcessedPrompt
from common.errors import APIError, Unavailable
from common.protocol import (
    EncodeTask,
    ImageSpec,
    PrefillTask,
    RequestSpec,
    SamplingParams,
    TensorRef,
    TraceContext,
    dtype_name,
)
from common.roles import Role
from common.store.features import FEATURE_TTL
from services.gateway.kv_routing import Choice

log = logging.getLogger(__name__)
PIXEL_TTL = 300.0  # seconds the gateway serves pixels at most (released when the request ends)
POLL = 0.1  # seconds between looks at the registry while a request is held


def live_roles(beats) -> set[Role]:
    return {role for hb in beats for role in hb.roles if not hb.draining}


class LiveRoles:
    """The roles live instances serve, as routing asks for them: read from the registry at most
    every `max_age` seconds, so a thousand requests a second cost two registry reads, not a
    thousand (one read at a time, its answer shared). A role that is missing is asked for again
    after `max_age` (the wait loop polls)."""

    def __init__(self, store, max_age: float = 0.5) -> None:
        self.store = store
        self.max_age = max_age
        self._roles: set[Role] = set()
        self.beats: list = []  # the registry's heartbeats as last read (routing by prefix weighs them)
        self._at = float("-inf")
        self._reading: asyncio.Future[set[Role]] | None = None  # one read, shared by all who ask
        self.held = 0  # requests waiting for a stage's instance now

    async def get(self) -> set[Role]:
        if time.monotonic() - self._at <= self.max_age:
            return self._roles
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read())
            # Read by whoever awaits it; a failure nobody awaited any more is not an error to log.
            self._reading.add_done_callback(lambda f: f.cancelled() or f.exception())
        return await asyncio.shield(self._reading)  # a waiter that leaves does not cancel it

    async def _read(self) -> set[Role]:
        self.beats = await self.store.registry.instances()
        roles = live_roles(self.beats)
        self._roles, self._at = roles, time.monotonic()
        return roles


async def route(
    gw, rid: str, prompt: ProcessedPrompt, sampling: SamplingParams, trace: TraceContext | None = None
) -> RequestSpec:
    """Pick the first stage, wait until an instance can serve it, record the request and queue the
    task (carrying `trace`, the request's trace context); returns the request as sent."""
    hashes = [img.content_hash for img in prompt.images]
    stored = await _stored_features(gw, hashes)
    await _wait_for_roles(gw, {Role.PREFILL, Role.DECODE})
    spec = RequestSpec(
        request_id=rid,
        prompt_token_ids=tuple(prompt.token_ids),
        images=tuple(_image_spec(gw, img) for img in prompt.images),
        sampling=sampling,
        arrival_time=time.time(),
        gateway=gw.instance_id,
        trace=trace,
    )
    choice = _prefix_choice(gw, spec)  # the prefill instance holding its prefix, if any
    inside = set(choice.in_prefix)
    # What must be encoded first: images neither stored nor in the target's cached prefix, unless
    # the target holds the vision tower (EP, EPD), which encodes them there beside its history.
    unresolved = [i for i, h in enumerate(hashes) if i not in inside and h not in stored]
    needs_encode = bool(unresolved) and not choice.encodes
    if needs_encode:
        await _wait_for_roles(gw, {Role.ENCODE})
        images = tuple(img.model_copy(update={"in_prefix": i in inside}) for i, img in enumerate(spec.images))
    else:  # to prefill: the features stored, the rest found in the prefix (or encoded) there
        images = tuple(
            img.model_copy(update={"features": stored[img.content_hash].ref})
            if img.content_hash in stored
            else img
            for img in spec.images
        )
    spec = spec.model_copy(update={"images": images})
    gw.record.create(
        rid,
        arrival=spec.arrival_time,
        prompt_tokens=len(prompt.token_ids),
        num_images=len(images),
        image_tokens=sum(i.num_tokens for i in images),
        max_tokens=sampling.max_tokens,
        encoded_images=sum(h in stored for h in hashes),
    )
    to = choice.target  # an encoder sends the prefill task there once it has encoded
    task = EncodeTask(request=spec, prefill_to=to or "") if needs_encode else PrefillTask(request=spec)
    try:
        await gw.dispatch.send(task, "gateway", to=None if needs_encode else to)
    except QueueFull as exc:
        raise APIError(429, f"{exc}; retry shortly", code="queue_full", retry_after=2) from exc
    except PublishError as exc:
        raise Unavailable("the message broker did not store the request in time") from exc
    gw.metrics.routed.labels(task.ROLE).inc()
    gw.metrics.images_in_prefix.inc(len(inside))
    return spec


def _image_spec(gw, img) -> ImageSpec:
    """An image as it travels: its pixels stay on the gateway, served by handle, for an encoder to
    pull, and for a prefill instance that cannot have the features to recompute from."""
    pixels = gw.transfer.publish(img.pixel_values.contiguous(), ttl=PIXEL_TTL)
    ref = TensorRef(
        owner=gw.instance_id,
        address=gw.transfer.address,
        handle=pixels,
        shape=tuple(img.pixel_values.shape),
        dtype=dtype_name(img.pixel_values.dtype),
    )
    return ImageSpec(
        content_hash=img.content_hash,
        num_tokens=img.num_tokens,
        pixels=ref,
        grid_thw=img.grid_thw,
        image_size=img.image_size,
        video=img.video,
        seconds_per_patch=img.seconds_per_patch,
    )


def _prefix_choice(gw, spec: RequestSpec) -> Choice:
    """Where the request's prefill goes for the prefix it caches (kv_routing.py); target None: the
    shared queue."""
    router = gw.prefix_router
    if router is None:
        return Choice(None, "none")
    try:
        choice = router.choose(spec, gw.live_roles.beats)
    except Exception:  # a shortcut: without it, the shared queue
        log.exception("routing %s by prefix failed; queued for any instance", spec.request_id)
        return Choice(None, "none")
    gw.metrics.prefix_routes.labels(choice.reason).inc()
    return choice


async def _stored_features(gw, hashes: list[str]) -> dict:
    if not hashes:
        return {}
    try:
        return await gw.store.features.get_many_touched(hashes, FEATURE_TTL)  # a hit keeps them on
    except Exception as exc:  # the index is a shortcut: without it, encode again
        log.warning("feature index unreadable (%r); encoding", exc)
        return {}


async def _wait_for_roles(gw, needed: set[Role]) -> None:
    """Return once a live instance serves each stage in `needed`; hold the request meanwhile, up to
    the gateway's hold timeout and with at most its max_held requests held at once."""
    s, roles = gw.settings, gw.live_roles
    missing, problem = await _missing(roles, needed)
    if not missing:
        return
    if roles.held >= s.max_held:
        raise APIError(
            503,
            f"{problem}; {roles.held} requests already wait for an instance, the most this gateway "
            "holds (TRIDENT_MAX_HELD): retry later",
            code="no_instance",
            retry_after=5,
        )
    roles.held += 1
    try:
        deadline = time.monotonic() + s.hold_timeout
        while missing:
            if time.monotonic() >= deadline:
                raise APIError(
                    503,
                    f"{problem} after {s.hold_timeout:g} s held for one (TRIDENT_HOLD_TIMEOUT): "
                    "start one, or let the autoscaler bring one up, and retry",
                    code="no_instance",
                    retry_after=5,
                )
            await asyncio.sleep(POLL)
            missing, problem = await _missing(roles, needed)
    finally:
        roles.held -= 1


async def _missing(roles: LiveRoles, needed: set[Role]) -> tuple[list[str], str]:
    """The stages in `needed` no live instance serves, and what to tell the client about them."""
    try:
        missing = sorted(needed - await roles.get())
        return missing, f"no live instance serves {', '.join(missing)}"
    except Exception as exc:
        return ["?"], f"the instance registry cannot be read ({type(exc).__name__})"
