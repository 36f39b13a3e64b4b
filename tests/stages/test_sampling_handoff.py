"""Each sampling field survives the P→D hand-off and a decoder's replay: a prefill instance makes the
first token (and forks n choices), a decoder goes on, is taken for dead mid-answer, and another
decoder resumes from the tokens the client has (the gateway's journal) — every token, and its
log-probabilities, what one engine makes uninterrupted with the same seed."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from common.bus import EventStream
from common.engine import Engine, EngineConfig
from common.protocol import FinalOutput, PrefillTask, RequestSpec, SamplingParams, TokenDelta, TokenLogprob
from common.protocol.sampling import choice_id
from common.roles import Role
from tests.stages.rig import StageRig, stage_rig

P, D = frozenset({Role.PREFILL}), frozenset({Role.DECODE})
QUESTION = "Tell me a long story about a small boat"
KILL_AT = 5  # output tokens the first decoder makes before it is taken for dead
SEEDED = {"temperature": 1.0, "seed": 11, "max_tokens": 24}
FIELDS = {
    "seed": {"top_p": 0.9},
    "logprobs": {"logprobs": 3},
    "logit_bias": {"logit_bias": ((5, 4.0), (9, -100.0), (300, 2.0))},
    "presence-frequency": {"presence_penalty": 1.5, "frequency_penalty": 0.8},
    "repetition": {"repetition_penalty": 1.6},
    "min_p": {"min_p": 0.2},
    "min_tokens": {"min_tokens": 20, "logit_bias": "eos"},  # eos raised: only min_tokens holds it off
    "n": {"n": 3, "logprobs": 1},
}


@pytest.fixture(scope="module")
def oracle(tiny_model_dir) -> Engine:
    return Engine(tiny_model_dir, EngineConfig(detokenize=False))


class Outputs:
    """A request's outputs as a gateway takes them: first copy of each index wins."""

    def __init__(self, stream: EventStream) -> None:
        self.stream = stream
        self.tokens: dict[int, tuple[int, TokenLogprob | None]] = {}
        self.expected: int | None = None
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self.stream:
            if isinstance(msg, TokenDelta):
                for k, t in enumerate(msg.token_ids):
                    lp = msg.logprobs[k] if msg.logprobs else None
                    self.tokens.setdefault(msg.index + k, (t, lp))
            elif isinstance(msg, FinalOutput):
                self.expected = msg.num_outputs
            else:
                raise AssertionError(f"unexpected {msg}")

    def contiguous(self) -> list[int]:
        out = []
        while len(out) in self.tokens:
            out.append(self.tokens[len(out)][0])
        return out

    @property
    def done(self) -> bool:
        return self.expected is not None and len(self.contiguous()) >= self.expected

    def answer(self) -> tuple[list[int], list[TokenLogprob | None]]:
        return [self.tokens[i][0] for i in range(self.expected)], [
            self.tokens[i][1] for i in range(self.expected)
        ]


def pause_before(engine: Engine, rid: str, outputs: int) -> tuple[threading.Event, threading.Event]:
    """Hold the engine thread before any step once `rid` has made `outputs` tokens: the first event
    says it holds, the second lets it go."""
    holding, release = threading.Event(), threading.Event()
    step = engine.step

    def stepping():
        req = engine.requests.get(rid)
        if req is not None and len(req.output_token_ids) >= outputs and not release.is_set():
            holding.set()
            release.wait(60)
        return step()

    engine.step = stepping
    return holding, release


def params_for(name: str, oracle: Engine) -> SamplingParams:
    fields = dict(FIELDS[name])
    if fields.get("logit_bias") == "eos":
        fields["logit_bias"] = tuple((e, 100.0) for e in sorted(oracle.eos_ids))
    return SamplingParams(**SEEDED, **fields)


async def send(p: StageRig, rid: str, params: SamplingParams) -> RequestSpec:
    prompt = p.engine.processor.process(p.engine.chat_prompt(QUESTION, 0), [])
    spec = RequestSpec(
        request_id=rid, prompt_token_ids=tuple(prompt.token_ids), sampling=params, arrival_time=time.time()
    )
    await p.ctx.dispatch.send(PrefillTask(request=spec), "test")
    return spec


async def kill_and_replay(p: StageRig, d1: StageRig, d2: StageRig, rid: str, seen: Outputs, task) -> None:
    """Take `d1` for dead while it holds `rid` (its record and engine entry dropped, its task handed
    back as a dead instance's is), journal what the client has, and let `d2` resume it."""
    await d1.until(lambda: len(seen.contiguous()) >= KILL_AT, what="the first tokens")
    d1.ledger.forget(rid)
    await task.nak()
    streamed = seen.contiguous()
    await d1.ctx.store.requests.journal_outputs({rid: streamed}, [], ttl=60)
    again = await d2.take(Role.DECODE)
    assert again.message.request.request_id == rid and again.redelivered
    await p.take(Role.PREFILL)  # prefilled again over the prompt and the streamed tokens
    await d2.take(Role.DECODE)


@pytest.mark.parametrize("name", list(FIELDS))
async def test_a_field_survives_the_hand_off_and_a_decoders_replay(
    tiny_model_dir, nats_server, redis_server, oracle, name
):
    params = params_for(name, oracle)
    want = oracle.generate([oracle.chat_prompt(QUESTION, 0)], params=params)
    async with (
        stage_rig(P, tiny_model_dir, nats_server, redis_server) as p,
        stage_rig(D, tiny_model_dir, nats_server, redis_server) as d1,
        stage_rig(D, tiny_model_dir, nats_server, redis_server) as d2,
    ):
        rid = f"r-{name}"
        ids = [choice_id(rid, i) for i in range(params.n)]
        seen = [Outputs(await p.ctx.bus.events.outputs(i)) for i in ids]
        holding, release = pause_before(d1.engine, ids[-1], KILL_AT)
        await send(p, rid, params)
        prefill = await p.take(Role.PREFILL)
        decodes = [await d1.take(Role.DECODE) for _ in ids]  # one decode task a choice
        if params.logprobs is not None:  # the prefill's tokens' log-probabilities ride with each task
            for task in decodes:
                request = task.message.request
                made = want[ids.index(request.request_id)].logprobs[: len(request.output_token_ids)]
                assert len(request.output_logprobs) == len(request.output_token_ids) >= 1
                got = [lp.logprob for lp in request.output_logprobs]
                assert got == pytest.approx([lp.logprob for lp in made], abs=1e-4)
        await p.until(lambda: prefill.settled, what="the prefill task settled once every choice left")
        await asyncio.to_thread(holding.wait, 60)
        last = next(t for t in decodes if t.message.request.request_id == ids[-1])
        try:
            await kill_and_replay(p, d1, d2, ids[-1], seen[-1], last)
        finally:
            release.set()
        await d1.until(lambda: all(s.done for s in seen), timeout=60, what="every choice's answer")
        for choice, outputs in zip(want, seen, strict=True):
            tokens, logprobs = outputs.answer()
            assert tokens == choice.token_ids, choice.request_id
            if params.logprobs is None:
                assert logprobs == [None] * len(tokens)
                continue
            for ours, theirs in zip(logprobs, choice.logprobs, strict=True):
                assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)
                assert [t for t, _ in ours.top] == [t for t, _ in theirs.top]
        if name == "min_tokens":
            assert len(want[0].token_ids) == 21 and want[0].finish_reason == "stop"
        for rig in (p, d1, d2):
            await rig.idle()
        for s in seen:
            s.task.cancel()
            await s.stream.close()


async def test_a_hybrid_that_dies_mid_answer_resumes_each_choice_from_its_own_tokens(
    tiny_model_dir, nats_server, redis_server, oracle
):
    """PD (decodes where it prefills): the choices run under the request's one task. The instance
    is taken for dead mid-answer; the task, redelivered, resumes as its choices, each a task of its
    own from the tokens its client has (the gateway's journal)."""
    pd = P | D
    params = params_for("n", oracle)
    want = oracle.generate([oracle.chat_prompt(QUESTION, 0)], params=params)
    async with (
        stage_rig(pd, tiny_model_dir, nats_server, redis_server) as first,
        stage_rig(pd, tiny_model_dir, nats_server, redis_server) as second,
    ):
        ids = [choice_id("r-pd", i) for i in range(params.n)]
        seen = [Outputs(await first.ctx.bus.events.outputs(i)) for i in ids]
        holding, release = pause_before(first.engine, ids[0], KILL_AT)
        await send(first, "r-pd", params)
        task = await first.take(Role.PREFILL)
        await asyncio.to_thread(holding.wait, 60)
        try:
            await first.until(lambda: all(len(s.contiguous()) >= KILL_AT for s in seen), what="tokens")
            assert {h.request_id for h in first.ledger} == set(ids) and not task.settled
            for rid in ids:
                first.ledger.forget(rid)
            await task.nak()
            journal = {rid: s.contiguous() for rid, s in zip(ids, seen, strict=True)}
            await first.ctx.store.requests.journal_outputs(journal, [], ttl=60)
            again = await second.fetch(Role.PREFILL)
            assert again.redelivered and again.message.request.sampling.n == 3
            await second.handlers[Role.PREFILL].take(again)
            assert again.settled  # handed on as its choices
            resumed = [await second.take(Role.PREFILL) for _ in ids]
        finally:
            release.set()
        by_id = {t.message.request.request_id: t.message.request for t in resumed}
        assert {rid: list(by_id[rid].output_token_ids) for rid in ids} == journal
        assert [by_id[rid].sampling.seed for rid in ids] == [11, 12, 13]
        await second.until(lambda: all(s.done for s in seen), timeout=60, what="every choice's answer")
        assert [s.answer()[0] for s in seen] == [c.token_ids for c in want]
        for rig in (first, second):
            await rig.idle()
        for s in seen:
            s.task.cancel()
            await s.stream.close()


async def test_a_forked_requests_task_is_acked_once_its_choices_have_left(
    tiny_model_dir, nats_server, redis_server
):
    """The ledger's rule for choices forked under one task: the request's own settle waits for its
    choices; a choice settled or cancelled counts as gone; the last to go acks the task."""
    async with stage_rig(P, tiny_model_dir, nats_server, redis_server) as p:
        spec = await send(p, "r-ack", SamplingParams(n=3, max_tokens=4))
        task = await p.fetch(Role.PREFILL)
        parent = p.ledger.begin(spec, Role.PREFILL, task)
        one, two = p.ledger.adopt(parent, [("r-ack-n1", 1), ("r-ack-n2", 2)])
        assert parent.spec.sampling.n == 1 and one.spec.sampling.seed == two.spec.sampling.seed is None
        assert one.source == two.source == task.stream_seq  # a choice hands on under the task's name
        one.in_engine = two.in_engine = parent.in_engine = False  # nothing of theirs is in the engine
        await p.ledger.settle("r-ack")
        assert not task.settled and p.ledger.get("r-ack") is parent and parent.holds_task
        assert task in p.ledger.tasks()  # still kept alive (and listed in the heartbeat)
        await p.ledger.settle("r-ack-n1")
        assert not task.settled
        await p.ledger.abort("r-ack-n2")
        await p.until(lambda: task.settled, what="the task acked")
        assert len(p.ledger) == 0
