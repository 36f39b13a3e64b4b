"""KV streamed during the last prefill step (kv_stream.py): for every family, each group's buffer,
taken as the forward passes the group's last layer, equals the export after the prefill byte for
byte — with chunked prompts, images cut by chunks, and several requests ending in one step."""

from __future__ import annotations

import pytest
import torch

from common.checkpoints import write_checkpoint
from common.engine.request import Status
from common.engine.sampling import SamplingParams
from common.roles import Role
from tests.helpers.engine import engines
from tests.helpers.images import make_image

PRESETS = ["tiny-llava", "tiny-llava-next", "tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"]
EP = frozenset({Role.ENCODE, Role.PREFILL})


class Recorded:
    def __init__(self, shapes):
        self.shapes = shapes
        self.buffers: list[tuple[int, torch.Tensor]] = []

    def group(self, index, buffer):
        self.buffers.append((index, buffer.clone()))


class Sink:
    def __init__(self, refuse: set[str] = frozenset()):
        self.streams: dict[str, Recorded] = {}
        self.refuse = refuse

    def begin(self, req, shapes):
        assert req.request_id not in self.streams, "a request's stream began twice"
        if req.request_id in self.refuse:
            return None
        stream = self.streams[req.request_id] = Recorded(shapes)
        return stream


@pytest.fixture(scope="module", params=PRESETS)
def model_dir(request, tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("stream") / request.param, request.param, seed=0)


def run_to_hand_off(engine, rids) -> dict:
    """Step until every request has left (handed off or finished); their last outputs by id."""
    last = {}
    for _ in range(200):
        for out in engine.step():
            if out.next_stage is not None or out.finished:
                last[out.request_id] = out
        if set(rids) <= set(last):
            return last
    raise AssertionError(f"requests {set(rids) - set(last)} did not leave the engine")


def test_streamed_groups_equal_the_export_after_prefill(model_dir):
    with engines(model_dir) as build:
        engine = build(roles=EP, token_budget=48, prefix_caching=False)
        layers = engine.kv_spec.num_layers
        group = max(1, layers // 2)
        sink = Sink(refuse={"q-2"})
        engine.handoff.stream_kv(sink, group)
        rids = []
        for i in range(5):  # prompts of different lengths, some with images the chunks cut through
            prompt = engine.chat_prompt(f"Question {i}: " + "describe this " * (3 * i), i % 3)
            imgs = [make_image(7 * i + k) for k in range(i % 3)]
            params = SamplingParams(max_tokens=1 if i == 4 else 8)  # q-4 ends with its first token
            engine.add_request(prompt, imgs, params, request_id=f"q-{i}")
            rids.append(f"q-{i}")
        last = run_to_hand_off(engine, rids)
        assert set(sink.streams) == set(rids) - {"q-2"}  # the one the sink refused runs as before
        ngroups = -(-layers // group)
        for rid, stream in sink.streams.items():
            assert [i for i, _ in stream.buffers] == list(range(ngroups)), "groups out of order"
            if rid == "q-4":  # finished at its first token: nothing to export after it
                assert last[rid].finished
                continue
            assert last[rid].next_stage == Role.DECODE and engine.requests[rid].status == Status.HANDED_OFF
            exported = engine.handoff.export_kv(rid, group)
            assert [tuple(b.shape) for _, b in stream.buffers] == stream.shapes
            for (_, got), want in zip(stream.buffers, exported, strict=True):
                assert got.shape == want.shape and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        for rid in rids:
            engine.abort(rid)
        engine.handoff.stream_kv(None, group)
        assert not any(
            h for layer in engine.model.language_model.layers for h in layer._forward_hooks.values()
        )


def test_an_instance_that_also_decodes_streams_nothing(tiny_model_dir):
    with engines(tiny_model_dir) as build:
        engine = build(token_budget=48)  # every role: decode runs here, nothing leaves
        sink = Sink()
        engine.handoff.stream_kv(sink, 1)
        prompts = [engine.chat_prompt(f"Question {i}", 1) for i in range(2)]
        engine.generate(prompts, [[make_image(i)] for i in range(2)], SamplingParams(max_tokens=4))
        assert sink.streams == {}
