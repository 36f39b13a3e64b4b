"""Every message kind round-trips through the wire format; anything unreadable is a ProtocolError."""

from __future__ import annotations

from typing import ClassVar

import msgpack
import pytest
import torch

from common.protocol import (
    Budgets,
    Cancel,
    DeadLetter,
    DecodeTask,
    EncodeTask,
    ErrorOutput,
    FeatureEntry,
    Fence,
    FinalOutput,
    Heartbeat,
    ImageSpec,
    InlineTensor,
    KvGroup,
    KvLocation,
    Message,
    Plan,
    PrefillTask,
    PrefixBlocks,
    ProtocolError,
    Release,
    RequestSpec,
    Resend,
    SamplingParams,
    StageProfile,
    StepStats,
    TensorRef,
    TokenDelta,
    TraceRecord,
    Usage,
    decode,
    message_kinds,
)

REF = TensorRef(
    owner="enc-1", address="tcp://10.0.0.2:7000", handle="h1", shape=(576, 4096), dtype="bfloat16"
)
PIXELS = InlineTensor.from_tensor(torch.arange(3 * 4 * 4, dtype=torch.float32).reshape(3, 4, 4))
REQUEST = RequestSpec(
    request_id="chatcmpl-1",
    prompt_token_ids=tuple(range(1, 700)),
    images=(ImageSpec(content_hash="ab" * 32, num_tokens=576, pixels=PIXELS),),
    sampling=SamplingParams(max_tokens=64, temperature=0.7, top_p=0.9, top_k=40, seed=7, stop=("\n\n",)),
    arrival_time=1700000000.25,
)
GROUP_SHAPE = (16, 2, 44, 16, 8, 128)
KV = KvLocation(
    owner="pre-1",
    address="ucx://AAAA",
    num_tokens=700,
    block_size=16,
    dtype="bfloat16",
    groups=(
        KvGroup(layer_start=0, layer_end=16, handle="kv0", shape=GROUP_SHAPE),
        KvGroup(layer_start=16, layer_end=32, handle="kv1", shape=GROUP_SHAPE),
    ),
)
USAGE = Usage(prompt_tokens=700, completion_tokens=64)
BUDGETS = Budgets(image_budget=4, token_budget=2048)
STAGES = {"arrival": 1.0, "first_token": 1.2, "end": 2.0}

EXAMPLES: list[Message] = [
    EncodeTask(request=REQUEST),
    PrefillTask(request=REQUEST.without_pixels()),
    PrefillTask(request=RequestSpec(request_id="t", prompt_token_ids=(5,), arrival_time=1.0)),
    DecodeTask(request=REQUEST.without_pixels().model_copy(update={"output_token_ids": (42,)}), kv=KV),
    TokenDelta(request_id="chatcmpl-1", index=3, token_ids=(11, 12)),
    FinalOutput(request_id="chatcmpl-1", finish_reason="length", usage=USAGE, num_outputs=64),
    ErrorOutput(request_id="chatcmpl-1", code="server_error", message="encoder lost"),
    Cancel(request_id="chatcmpl-1", reason="client went away"),
    Release(request_id="chatcmpl-1", owner="pre-1", handles=("kv0", "kv1")),
    Resend(request_id="chatcmpl-1", index=7),
    Fence(instance_id="d-host-42", reason="no heartbeat for 1.5s"),
    EncodeTask(request=REQUEST, prefill_to="p-host-7"),
    PrefixBlocks(instance_id="p", seq=3, block_size=16, gained=(b"\x01" * 32,), dropped=(b"\x02" * 32,)),
    PrefixBlocks(instance_id="p-host-7", seq=4, block_size=16, snapshot=True, part=1, parts=2),
    Heartbeat(
        instance_id="pre-1",
        roles=("encode", "prefill"),
        http_address="http://10.0.0.3:8000",
        transfer_address="ucx://AAAA",
        queue_depth=3,
        running=5,
        free_kv_blocks=900,
        total_kv_blocks=1024,
        budgets=BUDGETS,
        profile_id="prof-1",
        started_at=1.0,
        time=2.0,
        held=(17, 42),
    ),
    Heartbeat(instance_id="gateway-1", kind="gateway", time=3.0, leaving=True),
    Plan(
        decision_id=7, method="ep+d", replicas={"ep": 2, "d": 3}, time=3.0, goodput=12.5, reason="image-heavy"
    ),
    FeatureEntry(content_hash="ab" * 32, ref=REF, created=4.0),
    TraceRecord(
        request_id="r",
        arrival=1.0,
        prompt_tokens=700,
        image_tokens=576,
        num_images=1,
        output_tokens=64,
        encoded_images=1,
        cached_tokens=640,
        stages=STAGES,
    ),
    StageProfile(
        profile_id="prof-1",
        roles=("prefill",),
        latency_limit=0.25,
        image_budget=0,
        token_budget=2048,
        prefill=((512, 0.05), (1024, 0.09)),
    ),
    StepStats(
        instance_id="p-1",
        roles=("prefill",),
        time=5.0,
        image_budget=0,
        token_budget=512,
        budget_scale=0.75,
        steps=(
            ("prefill", 0.0, 300, 0, 0.0, 0.04),
            ("mixed", 1.0, 120, 3, 410.5, 0.09, 1.5, 0.5),
        ),  # old, new
    ),
    DeadLetter(
        stream="S",
        subject="t.task.prefill",
        stream_seq=9,
        deliveries=5,
        reason="failed",
        data=b"\x00",
        time=5,
    ),
]


def test_every_kind_has_an_example() -> None:
    """A new message kind must be added to EXAMPLES, so its round trip is tested."""
    kinds = {k for k in message_kinds() if not k.startswith("test.")}
    assert {type(m).KIND for m in EXAMPLES} == kinds


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).KIND)
def test_round_trip(message: Message) -> None:
    data = message.to_bytes()
    again = decode(data, expect=type(message))
    assert again == message
    assert again.to_bytes() == data


def test_inline_tensor_keeps_every_dtype_exact() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8):
        t = (torch.randn(5, 7) * 100).to(dtype)
        back = InlineTensor.from_tensor(t).to_tensor()
        assert back.dtype == dtype and torch.equal(back, t)


def test_full_request_travels_once() -> None:
    """Pixels ride only in the encode task; later tasks are much smaller than the first."""
    encode = EncodeTask(request=REQUEST).to_bytes()
    prefill = PrefillTask(request=REQUEST.without_pixels()).to_bytes()
    assert len(prefill) < len(encode) - len(PIXELS.data)
    with pytest.raises(ValueError):
        PrefillTask(request=REQUEST)  # pixels in a prefill task are a bug, caught at construction
    with pytest.raises(ValueError):
        EncodeTask(request=REQUEST.without_pixels())


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xff\xfe garbage",
        msgpack.packb({"k": "task.prefill"}),
        msgpack.packb(["task.prefill", 1]),
        msgpack.packb(["task.prefill", "1", {}]),
        msgpack.packb(["no.such.kind", 1, {}]),
        msgpack.packb(["task.prefill", 99, {"request": {}}]),
        msgpack.packb(["task.prefill", 1, {"request": {"request_id": "x"}}]),
        msgpack.packb(["out.delta", 1, {"request_id": "x", "index": -1, "token_ids": [1]}]),
        msgpack.packb(["out.delta", 1, {"request_id": "x", "index": 0, "token_ids": [1], "surprise": 1}]),
        msgpack.packb(
            [
                "rec.feature",
                1,
                {"content_hash": "h", "created": 0, "ref": {**REF.model_dump(), "dtype": "complex128"}},
            ]
        ),
        EXAMPLES[0].to_bytes()[:-3],
    ],
)
def test_malformed_bytes_are_rejected_cleanly(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode(data)


def test_a_kind_unexpected_on_a_subject_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="unexpected"):
        decode(Cancel(request_id="r").to_bytes(), expect=(TokenDelta, FinalOutput))


def test_inline_tensor_size_must_match_shape() -> None:
    with pytest.raises(ValueError):
        InlineTensor(shape=(4, 4), dtype="float32", data=b"\x00" * 10)


class _PayloadV2(Message):
    """A kind at version 2 that still reads version-1 payloads (where `n` was called `count`)."""

    KIND: ClassVar[str] = "test.versioned"
    VERSION: ClassVar[int] = 2
    n: int

    @classmethod
    def upgrade(cls, version: int, payload: dict) -> dict:
        return {"n": payload["count"]} if version == 1 else payload


def test_older_versions_are_upgraded_and_newer_ones_refused() -> None:
    assert decode(msgpack.packb(["test.versioned", 1, {"count": 3}])) == _PayloadV2(n=3)
    assert decode(_PayloadV2(n=4).to_bytes()) == _PayloadV2(n=4)
    with pytest.raises(ProtocolError, match="version 3"):
        decode(msgpack.packb(["test.versioned", 3, {"n": 1}]))


def test_a_version_1_decode_task_is_read_as_the_request_it_carried() -> None:
    """v1 spread the request's fields over the decode task; a v2 reader takes them as its request."""
    v2 = EXAMPLES[3]
    assert isinstance(v2, DecodeTask)
    flat = {**v2.request.model_dump(mode="python", exclude_defaults=True), "kv": KV.model_dump(mode="python")}
    again = decode(msgpack.packb(["task.decode", 1, flat], use_bin_type=True), expect=DecodeTask)
    assert again == v2


def test_a_decode_task_needs_its_first_token() -> None:
    with pytest.raises(ValueError, match="first output token"):
        DecodeTask(request=REQUEST.without_pixels(), kv=KV)


def test_a_step_record_is_named_and_its_wire_form_unchanged() -> None:
    """StepStats carried steps as positional 8-tuples (6 before threads and overlap were kept): the
    named Step is the same array on the wire, roles and kinds are the same strings, and an old
    six-field step reads with both unknown."""
    import msgpack

    from common.protocol.records import Step
    from common.roles import Role, StepKind

    steps = [["mixed", 1.0, 5, 3, 10.0, 0.01, 2.0, 0.5], ["decode", 0.0, 0, 3, 12.0, 0.02]]
    raw = ["rec.steps", 1, {"instance_id": "i", "roles": ["decode", "encode"], "time": 1.0, "steps": steps}]
    stats = decode(msgpack.packb(raw, use_bin_type=True), expect=StepStats)
    assert stats.roles == (Role.DECODE, Role.ENCODE)
    new, old = stats.steps
    assert new == Step(StepKind.MIXED, 1.0, 5, 3, 10.0, 0.01, 2.0, 0.5) and new.overlap == 0.5
    assert old.kind is StepKind.DECODE and (old.threads, old.overlap) == (0.0, -1.0)
    again = msgpack.unpackb(stats.to_bytes(), raw=False)[2]
    assert again["roles"] == ["decode", "encode"] and again["steps"][0] == raw[2]["steps"][0]


def test_prefix_blocks_carry_whole_keys_and_a_part_in_range() -> None:
    """Keys are full SHA-256 digests: a truncated one is refused, as is a part past the count."""
    with pytest.raises(ValueError, match="32"):
        PrefixBlocks(instance_id="p", seq=1, block_size=16, gained=(b"\x01" * 8,))
    with pytest.raises(ValueError, match="part 2 of 2"):
        PrefixBlocks(instance_id="p", seq=1, block_size=16, snapshot=True, part=2, parts=2)


def test_a_trace_context_travels_with_the_request_and_an_untraced_one_is_sent_as_before() -> None:
    from common.protocol import TraceContext

    plain = RequestSpec(request_id="r", prompt_token_ids=(1, 2), arrival_time=1.0)
    assert "trace" not in msgpack.unpackb(PrefillTask(request=plain).to_bytes())[2]["request"]
    context = TraceContext(traceparent="00-" + "ab" * 16 + "-" + "cd" * 8 + "-01", tracestate="k=v")
    traced = plain.model_copy(update={"trace": context})
    assert decode(PrefillTask(request=traced).to_bytes()).request.trace == context
    with pytest.raises(ValueError, match="traceparent"):
        TraceContext(traceparent="00-zz-not-a-trace-01")
