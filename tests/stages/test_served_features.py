"""The features an encoder serves are bounded in bytes (services/encoder/served.py): each image's
once, the least recently used out first (a pull counts as a use), the request being handed on
never, and an evicted image leaves the feature index. A prefill instance that pulls an evicted
image's features falls back as for any lost ones, and answers as HF."""

from __future__ import annotations

import time

import pytest
import torch

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
from common.store.features import FEATURE_TTL
from common.transfer import HandleNotFound, TcpBackend, TransferConfig
from services.encoder.served import ServedFeatures
from tests.helpers.images import make_image
from tests.stages.flows import QUESTION, answer
from tests.stages.rig import stage_rig

E, P, D = (frozenset({r}) for r in Role)
KB = 1024


def features(seed: int) -> torch.Tensor:
    return torch.full((64, 4), float(seed))  # 1 KiB


async def test_least_recently_used_go_first_a_pull_counts_and_a_reuse_is_not_published_again(owner):
    puller = TcpBackend(TransferConfig(backend="tcp"))
    await puller.start()
    served = ServedFeatures(owner.backend, budget=3 * KB, ttl=FEATURE_TTL)
    try:
        handles = {h: served.serve(h, features(i))[0] for i, h in enumerate("abc")}
        assert (served.bytes, len(owner.backend.handles)) == (3 * KB, 3)
        with await puller.pull(owner.backend.address, handles["a"]) as got:  # "a" is used again: b is oldest
            assert torch.equal(got, features(0))
        assert served.serve("c", features(2))[0] == handles["c"]  # held: the same handle, no copy
        handle_d, evicted = served.serve("d", features(3))
        assert evicted == ["b"] and served.evictions == 1 and served.bytes == 3 * KB
        with pytest.raises(HandleNotFound):
            await puller.pull(owner.backend.address, handles["b"])
        _, evicted = served.serve("e", features(4), keep=["a"])  # a request's own image stays
        assert evicted == ["c"]
        _, evicted = served.serve("f", features(5), keep=["a", "d", "e"])  # over budget rather than drop them
        assert evicted == [] and served.bytes == 4 * KB
        assert len(owner.backend.handles) == len(served) == 4
        assert handle_d in owner.backend.handles
    finally:
        await puller.close()


def test_features_idle_past_their_ttl_are_forgotten(owner):
    served = ServedFeatures(owner.backend, budget=8 * KB, ttl=0.05)
    served.serve("a", features(0))
    deadline = time.monotonic() + 10
    while len(served) and time.monotonic() < deadline:  # the handle expires: pruned, not evicted
        served.prune()
    assert (len(served), served.bytes, served.evictions) == (0, 0, 0)


def one_image(rig, gateway, rid: str, seed: int):
    """A one-image request as the gateway sends it, its image drawn from `seed`."""
    prompt = rig.engine.chat_prompt(QUESTION, 1)
    picture = [make_image(seed)]
    img = rig.engine.processor.process(prompt, picture).images[0]
    handle = gateway.backend.publish(img.pixel_values.contiguous())
    pixels = TensorRef(
        owner="gateway",
        address=gateway.backend.address,
        handle=handle,
        shape=tuple(img.pixel_values.shape),
        dtype=dtype_name(img.pixel_values.dtype),
    )
    spec = RequestSpec(
        request_id=rid,
        prompt_token_ids=tuple(rig.engine.processor.process(prompt, picture).token_ids),
        images=(ImageSpec(content_hash=img.content_hash, num_tokens=img.num_tokens, pixels=pixels),),
        sampling=SamplingParams(max_tokens=8),
        arrival_time=time.time(),
    )
    return spec, prompt, picture


async def test_a_pull_of_evicted_features_falls_back_and_answers_as_hf(
    tiny_model_dir, nats_server, redis_server, owner, hf_generate
):
    """An encoder whose budget holds one image's features: the second request's evicts the first's
    while the first's prefill task still points to them. The prefill instance's pull finds nothing,
    the index no longer names them, and the request goes back to encode; both answers are HF's."""
    async with (
        stage_rig(E, tiny_model_dir, nats_server, redis_server) as e,
        stage_rig(P, tiny_model_dir, nats_server, redis_server) as p,
        stage_rig(D, tiny_model_dir, nats_server, redis_server) as d,
    ):
        (first, *asked_first), (second, *asked_second) = (
            one_image(e, owner, rid, seed) for rid, seed in (("r-first", 0), ("r-second", 1))
        )
        streams = [await p.ctx.bus.events.outputs(s.request_id) for s in (first, second)]
        served = e.handlers[Role.ENCODE].served
        for spec in (first, second):
            await e.ctx.dispatch.send(EncodeTask(request=spec), "test")
            await e.take(Role.ENCODE)
            await e.idle()
            served.budget = served.bytes  # room for one image's features
        (evictions,), (held, _) = e.handlers[Role.ENCODE].figures()
        assert evictions[:2] == ("served_feature_evictions", 1) and held[1] == served.bytes == served.budget
        gone = first.images[0].content_hash
        assert await e.ctx.store.features.get(gone) is None  # left the index with the handle
        assert await e.ctx.store.features.get(second.images[0].content_hash) is not None

        served.budget = 2 * served.bytes  # the first one's, encoded again, evicts nothing now
        task = await p.fetch(Role.PREFILL)
        assert isinstance(task.message, PrefillTask) and task.message.request.request_id == "r-first"
        await p.handlers[Role.PREFILL].take(task)
        assert p.ctx.counters.feature_fetch_failures == 1
        await e.take(Role.ENCODE)  # sent back: encoded again
        for _ in range(2):
            await p.take(Role.PREFILL)
            await d.take(Role.DECODE)
        for stream, asked in zip(streams, (asked_first, asked_second), strict=True):
            assert await answer(stream) == hf_generate(*asked, 8)
        for rig in (e, p, d):
            await rig.idle()
