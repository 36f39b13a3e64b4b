"""Random sequences of admissions, engine steps, cancels, hand-offs, KV releases and expiries,
driven through a request ledger and a real engine: after every operation the two agree (nothing in
the engine the ledger forgot, kept KV still held and served, every block accounted for), and once
everything has ended, nothing is held at all.

The engine runs on the test's thread (an inline port in place of the engine thread: calls run at
once, in order, which is what the ledger relies on), so a failing sequence replays exactly."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from common.engine import AdmissionError, Engine, EngineConfig
from common.protocol import RequestSpec, SamplingParams
from common.roles import Role, parse_roles
from common.transfer import TcpBackend, TransferConfig
from services.prefill.handler import KV_TTL, _export
from services.worker.ledger import Held, Ledger
from tests.helpers.images import make_image

ROLE_SETS = ("e", "p", "ep", "epd")
BLOCKS = 16  # of 16 tokens: room for two or three requests at once, so long ones preempt others


class InlineEngine:
    """The ledger's engine port, run on the caller's thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def post(self, fn) -> None:
        fn()

    async def call(self, fn):
        return fn()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.slow  # a property sweep of minutes: `make test`, not the fast tier
@pytest.mark.parametrize("roles", ROLE_SETS)
def test_random_sequences_keep_ledger_and_engine_in_agreement(roles: str, tiny_model_dir) -> None:
    block_bytes = 16 * 4 * 2 * 2 * 16 * 4  # tokens x layers x (K, V) x kv heads x head dim x fp32
    config = EngineConfig(
        roles=parse_roles(roles), detokenize=False, kv_cache_bytes=BLOCKS * block_bytes,
        token_budget=64, image_budget=2,
    )  # fmt: skip
    machine = type("Machine", (LedgerMachine,), {"model": tiny_model_dir, "config": config})
    run = settings(
        max_examples=60, stateful_step_count=30, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )(machine).TestCase  # fmt: skip
    run("runTest").runTest()


class LedgerMachine(RuleBasedStateMachine):
    model: Path
    config: EngineConfig

    def __init__(self) -> None:
        super().__init__()
        self.engine = Engine(self.model, self.config)  # fresh for each sequence: ~20 ms on tiny
        assert self.engine.blocks.num_blocks == (BLOCKS if self.engine.has_lm else 0)
        self.loop = asyncio.new_event_loop()
        self.clock = Clock()
        self.transfer = TcpBackend(TransferConfig(backend="tcp"))  # publish/release only: never started
        self.ledger = Ledger(InlineEngine(self.engine), self.transfer, clock=self.clock)
        self.ids = itertools.count()

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    # -- operations --------------------------------------------------------------------------------

    @rule(images=st.integers(0, 2), max_tokens=st.integers(1, 160))
    def add(self, images: int, max_tokens: int) -> None:
        rid = f"r{next(self.ids)}"
        if images and Role.ENCODE not in self.engine.config.roles:
            images = 0  # such an instance is sent only encoded requests
        imgs = [make_image(k + 10 * images) for k in range(images)]
        prompt = self.engine.processor.process(self.engine.chat_prompt(f"question {rid}", images), imgs)
        spec = RequestSpec(
            request_id=rid, prompt_token_ids=tuple(prompt.token_ids), arrival_time=0.0,
            sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        )  # fmt: skip
        held = self.ledger.begin(spec, Role.ENCODE if images else Role.PREFILL)
        admit = self.ledger.enter(held, lambda e: e.add_request(prompt, params=spec.sampling, request_id=rid))
        try:
            self.run(admit)
        except AdmissionError:  # longer than the KV cache holds: the handler fails it
            self.run(self.ledger.abort(rid))

    @precondition(lambda self: self.engine.has_unfinished())
    @rule(steps=st.integers(1, 12))
    def step(self, steps: int) -> None:
        for _ in range(steps):
            self.one_step()

    def one_step(self) -> None:
        for out in self.engine.step():
            held = self.ledger.get(out.request_id)
            if held is None:
                continue  # it left before its output came (a hand-off at admission, then a cancel)
            if out.finished:
                self.run(self.ledger.settle(out.request_id))
            elif out.next_stage is not None:
                self.hand_on(held, out.next_stage)

    def hand_on(self, held: Held, stage: Role) -> None:
        """What the handlers do with a hand-off, as far as holdings go: encode's features are shared
        by hash and outlive the request, so it settles; prefill serves its KV until released."""
        if stage == Role.DECODE:
            req, _, buffers, _ = _export(self.engine, held.request_id, 2, "native")
            assert req is not None
            self.ledger.keep_kv(held, tuple(self.transfer.publish(b) for b in buffers), KV_TTL)
        self.run(self.ledger.settle(held.request_id))

    @precondition(lambda self: len(self.ledger) > 0)
    @rule(pick=st.integers(0, 10**6))
    def cancel(self, pick: int) -> None:
        held = self.pick(pick)
        assert self.run(self.ledger.abort(held.request_id))

    @precondition(lambda self: any(h.kv_handles for h in self.ledger))
    @rule(pick=st.integers(0, 10**6))
    def decode_pulled_the_kv(self, pick: int) -> None:
        kept = [h for h in self.ledger if h.kv_handles]
        self.run(self.ledger.release_kv(kept[pick % len(kept)].request_id))

    @precondition(lambda self: any(h.kv_handles for h in self.ledger))
    @rule()
    def nobody_came_for_the_kv(self) -> None:
        self.clock.now += KV_TTL + 1
        self.run(self.ledger.expire())
        assert not any(h.kv_handles for h in self.ledger)

    @precondition(lambda self: len(self.ledger) > 0)
    @rule(pick=st.integers(0, 10**6))
    def drain_gives_it_back(self, pick: int) -> None:
        self.run(self.ledger.give_back(self.pick(pick).request_id))

    def pick(self, pick: int) -> Held:
        held = list(self.ledger)
        return held[pick % len(held)]

    # -- what must hold after each -----------------------------------------------------------------

    @invariant()
    def ledger_and_engine_agree(self) -> None:
        self.run(self.ledger.check_integrity())
        kept = {h for held in self.ledger for h in held.kv_handles}
        assert len(self.transfer.handles) == len(kept), "KV is served that no record keeps"
        if len(self.ledger) == 0:
            assert not self.engine.requests and self.engine.blocks.num_free == self.engine.blocks.num_blocks

    def teardown(self) -> None:
        """Everything still held ends; then nothing may remain, for this sequence or the next."""
        for held in list(self.ledger):
            self.run(self.ledger.abort(held.request_id))
        while self.engine.has_unfinished():  # outputs made before the cancels, for nobody now
            assert all(self.ledger.get(o.request_id) is None for o in self.engine.step())
        self.ledger_and_engine_agree()
        assert not self.engine.requests and self.engine.blocks.num_free == self.engine.blocks.num_blocks
        self.loop.close()
