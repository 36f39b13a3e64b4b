"""Wire encoding: msgpack (what common/protocol uses) against JSON, on the messages that matter.

    python bench/wire.py

Both encodings carry the same envelope `[kind, version, payload]` and go through the same pydantic
validation on decode, so the difference is the serialiser and the size. JSON has no bytes type:
the inline-pixel encode task would need base64 (4/3 the size), shown in its size column only.
The last line is one JSON object with the figures.
"""

from __future__ import annotations

import base64
import json
import time

import torch

from common.protocol import (
    DecodeTask,
    EncodeTask,
    Heartbeat,
    ImageSpec,
    InlineTensor,
    KvGroup,
    KvLocation,
    Message,
    PrefillTask,
    RequestSpec,
    SamplingParams,
    TokenDelta,
    decode,
)


def samples() -> dict[str, Message]:
    # A LLaVA-1.5 chat turn: ~600 prompt tokens of which 576 are the image's placeholders.
    prompt = tuple(range(32000, 32000 + 640))
    pixels = InlineTensor.from_tensor(torch.zeros(3, 336, 336))
    image = ImageSpec(content_hash="ab" * 32, num_tokens=576, pixels=pixels)
    request = RequestSpec(
        request_id="chatcmpl-7f3a",
        prompt_token_ids=prompt,
        images=(image,),
        sampling=SamplingParams(max_tokens=256),
        arrival_time=time.time(),
    )
    group = KvGroup(layer_start=0, layer_end=32, handle="kv-0", shape=(32, 2, 40, 16, 32, 128))
    address = "ucx://" + "A" * 240  # a worker address is ~180 bytes, base64
    kv = KvLocation(
        owner="prefill-0", address=address, num_tokens=640, block_size=16, dtype="float16", groups=(group,)
    )
    first_token = request.without_pixels().model_copy(update={"images": (), "output_token_ids": (29871,)})
    decode_task = DecodeTask(request=first_token, kv=kv)
    heartbeat = Heartbeat(
        instance_id="decode-3",
        roles=("decode",),
        transfer_address=address,
        queue_depth=4,
        running=31,
        free_kv_blocks=812,
        total_kv_blocks=4096,
        time=time.time(),
    )
    return {
        "encode task (pixels inline)": EncodeTask(request=request),
        "prefill task": PrefillTask(request=request.without_pixels()),
        "decode task": decode_task,
        "token delta": TokenDelta(request_id=request.request_id, index=17, token_ids=(1576,)),
        "heartbeat": heartbeat,
    }


def json_encode(message: Message) -> bytes:
    payload = message.model_dump(mode="python", exclude_defaults=True)
    return json.dumps(
        [message.KIND, message.VERSION, payload],
        separators=(",", ":"),
        default=lambda b: base64.b64encode(b).decode(),
    ).encode()


def json_decode(data: bytes, cls: type[Message]) -> Message:
    _kind, _version, payload = json.loads(data)
    return cls.model_validate(payload)


def timed(fn, repeat: int) -> float:  # type: ignore[no-untyped-def]
    fn()
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat * 1e6


def main() -> None:
    rows, figures = [], {}
    for name, msg in samples().items():
        cls = type(msg)
        mp_bytes, js_bytes = msg.to_bytes(), json_encode(msg)
        repeat = 200 if "pixels" in name else 2000
        row = {
            "msgpack_bytes": len(mp_bytes),
            "json_bytes": len(js_bytes),
            "msgpack_encode_us": timed(msg.to_bytes, repeat),
            "json_encode_us": timed(lambda m=msg: json_encode(m), repeat),
            "msgpack_decode_us": timed(lambda b=mp_bytes, c=cls: decode(b, expect=c), repeat),
        }
        if "pixels" not in name:  # base64 strings would not validate as bytes without a custom step
            row["json_decode_us"] = timed(lambda b=js_bytes, c=cls: json_decode(b, c), repeat)
        rows.append((name, row))
        figures[name] = {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}
    print("| message | msgpack B | JSON B | msgpack enc/dec µs | JSON enc/dec µs |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, r in rows:
        jd = f"{r['json_decode_us']:.0f}" if "json_decode_us" in r else "n/a"
        msgpack_us = f"{r['msgpack_encode_us']:.0f} / {r['msgpack_decode_us']:.0f}"
        json_us = f"{r['json_encode_us']:.0f} / {jd}"
        print(f"| {name} | {r['msgpack_bytes']} | {r['json_bytes']} | {msgpack_us} | {json_us} |")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
