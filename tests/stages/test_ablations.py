"""The ablations' switches (bench/ablations.py) keep E+P+D's answers right: the two other batching
policies, no feature prefetch, the KV cache sent as one transfer, and every KV group streamed during
the prefill step. Each variant is the environment a deployment of it gets, read into the workers'
settings and from them into the engines and handlers, as a worker reads its own; the three
instances run in process (tests/stages/rig.py), and each switch is checked to have taken effect."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from common.engine.config import Policy
from common.roles import Role
from services.settings import WorkerSettings
from tests.helpers.images import make_image
from tests.stages.flows import QUESTION, D, E, P, ask, serving
from tests.stages.rig import ServingThread, StageRig, stage_rig

VARIANTS = {
    "prefill-first": {"TRIDENT_POLICY": "prefill-first"},
    "decode-first": {"TRIDENT_POLICY": "decode-first"},
    # A token budget below one image's prompt keeps requests waiting at prefill for several steps,
    # so prefill tasks wait for their turn before they pull their features.
    "no-prefetch": {"TRIDENT_PREFETCH": "0", "TRIDENT_TOKEN_BUDGET": "32"},
    # More layers than any model has: the whole KV cache in one transfer.
    "one-kv-transfer": {"TRIDENT_KV_LAYER_GROUP": "1000000"},
    # Nothing rides inline, so even the tiny model's KV streams while its prefill step runs (one
    # layer a group: a transfer per layer). Exported after the step instead: test_kv_streamed.py.
    "kv-streamed": {
        "TRIDENT_KV_STREAM": "1",
        "TRIDENT_TRANSFER_INLINE_MAX_BYTES": "0",
        "TRIDENT_KV_LAYER_GROUP": "1",
    },
}
IMAGES = [1, 2, 0, 1, 2, 1]  # images per request of a burst
TOKENS = 16


def took_effect(variant: str, rigs: list[StageRig]) -> None:
    """The switch reached what it switches: the engines' policy, or the prefill handler's options."""
    prefill = rigs[1].handlers[Role.PREFILL]
    if variant in ("prefill-first", "decode-first"):
        assert {rig.engine.config.policy for rig in rigs} == {Policy(variant)}
    elif variant == "no-prefetch":
        assert not prefill.prefetch and rigs[1].engine.config.token_budget == 32
    elif variant == "one-kv-transfer":
        assert prefill.kv_layer_group == 1_000_000
    else:
        assert prefill.kv_stream and prefill.kv_layer_group == 1
        assert rigs[1].ctx.transfer.config.inline_max_bytes == 0


def test_prefetch_is_on_unless_switched_off(monkeypatch):
    assert WorkerSettings().prefetch
    monkeypatch.setenv("TRIDENT_PREFETCH", "0")
    assert not WorkerSettings().prefetch


@pytest.mark.slow  # five variants of three instances each: `make test`
@pytest.mark.parametrize("variant", list(VARIANTS))
async def test_answers_match_hf_one_at_a_time_and_in_a_burst(
    variant, monkeypatch, tiny_model_dir, hf_generate, nats_server, redis_server, owner: ServingThread
):
    for name, value in {"TRIDENT_KV_CACHE_BYTES": str(16 << 20), **VARIANTS[variant]}.items():
        monkeypatch.setenv(name, value)
    settings = WorkerSettings()
    async with contextlib.AsyncExitStack() as stack:
        rigs = [
            await stack.enter_async_context(
                stage_rig(roles, tiny_model_dir, nats_server, redis_server, settings=settings)
            )
            for roles in (E, P, D)
        ]
        took_effect(variant, rigs)
        engine = rigs[0].engine

        def request(n: int):
            prompt = engine.chat_prompt(QUESTION, n)
            images = [make_image(i) for i in range(n)]
            return engine.processor.process(prompt, images), hf_generate(prompt, images, TOKENS)

        async with serving(*rigs):
            for n in (1, 2):
                processed, want = request(n)
                assert await ask(rigs[0], owner, processed, f"one-{n}", TOKENS) == want
            burst = [request(n) for n in IMAGES]
            answers = await asyncio.gather(
                *(ask(rigs[0], owner, p, f"burst-{i}", TOKENS) for i, (p, _) in enumerate(burst))
            )
            assert answers == [want for _, want in burst]
        for rig in rigs:
            await rig.idle()
