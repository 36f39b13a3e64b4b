"""Every answer the gateway's door gives a malformed request is one a person can act on: a property
test over the real app in process (request models, door middleware, image fetch and decode, the
processor; real NATS and Redis, no worker), with bodies built from a valid request with any of the
image URLs below (bad base64, 10 MB URLs, not an image) by breaking it in up to three places —
wrong JSON types, strings and integers of every size, lone surrogates — and raw bytes that are not
JSON at all.

Each answer must be a 4xx OpenAI error body of at most MAX_ERROR_BYTES that quotes no internals, or
the 503 `no_instance` a request gets once it has passed every check (no worker runs here, and the
gateway holds none: TRIDENT_MAX_HELD=0). `TRIDENT_FUZZ_CASES=3000` runs the long version."""

from __future__ import annotations

import base64
import io
import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from common.infra import NatsServer, RedisServer, free_port
from services.gateway.app import create_app
from services.settings import GatewaySettings
from tests.gateway.in_process import gateway

CASES = int(os.environ.get("TRIDENT_FUZZ_CASES", "250"))
MAX_ERROR_BYTES = 4096  # the gateway cuts a message at 500 characters, however many bytes each
INTERNALS = (
    "object at 0x",
    "Traceback",
    "set_int_max_str_digits",
    'File "',
    "pydantic",
    "errors.pydantic.dev",
)


def png(side: int = 8) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), "red").save(buf, "PNG")
    return buf.getvalue()


PNG = png()
IMAGE_URLS = [
    "data:image/png;base64," + base64.b64encode(PNG).decode(),
    "data:image/png;base64," + base64.encodebytes(PNG).decode(),  # wrapped at 76 columns
    "data:image/png;base64," + base64.b64encode(b"not an image at all").decode(),
    "data:image/png;base64," + base64.urlsafe_b64encode(PNG).decode().replace("=", ""),
    "data:image/png;base64,@@@@",
    "data:image/png;base64,\u00e9\u00e9",
    "data:text/plain,hello",
    "data:image/png;base64," + base64.b64encode(PNG[:40]).decode(),  # cut short
    "http://h:" + "9" * 100_000 + "/x.png",
    "http://h:" + "x" * 100_000 + "/x.png",
    "http://[" + "1" * 100_000 + "/x",
    "http://" + "a" * 100_000 + "/x.png",
    "http://127.0.0.1:1/x.png",  # loopback: refused before any connection
    "http://192.0.2.7/x.png",  # documentation range: refused likewise
    "file:///etc/passwd",
    "ftp://x/y",
    "",
]
INTEGERS = [0, 1, -1, 12, 2**31, 2**63, 2**64, -(2**64), 10**30, 10**4000]
NUMBERS = [12.0, 0.5, -0.0, 1e308, -1e308, float("inf"), float("nan")]
TEXTS = ["12", "true", "", "\ud800", "a" * 3000, "<image>", "é" * 50]


def big_text() -> st.SearchStrategy[str]:
    """Strings up to 1 MB, made cheaply (hypothesis draws the size, not every character)."""
    return st.builds(
        lambda c, n: c * n, st.sampled_from(["x", "é", "\ud83d\ude00", " "]), st.integers(1, 1 << 20)
    )


SCALARS = (
    st.none()
    | st.booleans()
    | st.sampled_from(INTEGERS)
    | st.sampled_from(NUMBERS)
    | st.integers()
    | st.floats()
    | st.sampled_from(TEXTS)
    | st.text(max_size=20)
    | big_text()
    | st.sampled_from(IMAGE_URLS)
)
JUNK = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8) | big_text(), inner, max_size=4)
    ),
    max_leaves=8,
)
CHAT_FIELDS = [
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
    "stop", "stop_token_ids", "n", "stream", "stream_options", "logprobs", "top_logprobs", "logit_bias",
    "min_p", "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty", "response_format",
    "tools", "mm_processor_kwargs", "ignore_eos", "best_of", "user",
]  # fmt: skip


def chat_body(url: str) -> dict:
    parts = [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": url}}]
    return {"model": "tiny-llava", "max_tokens": 2, "messages": [{"role": "user", "content": parts}]}


def completion_body() -> dict:
    return {"model": "tiny-llava", "max_tokens": 2, "prompt": "hello"}


def paths(value, prefix=()) -> Iterator[tuple]:
    """Every place in a JSON value a mutation may land: each key and each list index."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield (*prefix, key)
            yield from paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield (*prefix, i)
            yield from paths(item, (*prefix, i))


@st.composite
def broken(draw, base: st.SearchStrategy[dict], fields: list[str]) -> dict:
    """A body drawn from `base` with up to three places replaced by junk, removed, or a new field set."""
    body = json.loads(json.dumps(draw(base)))
    for _ in range(draw(st.integers(0, 3))):
        places = list(paths(body))
        action = draw(st.sampled_from(["replace", "remove", "add"]))
        if action == "add" or not places:
            body[draw(st.sampled_from(fields))] = draw(JUNK)
            continue
        *parent, last = draw(st.sampled_from(places))
        holder = body
        for key in parent:
            holder = holder[key]
        if action == "remove":
            del holder[last]
        else:
            holder[last] = draw(JUNK)
    return body


def encode(body) -> bytes:
    """JSON as a client would send it: NaN and Infinity included (Python's json writes them), and
    lone surrogates escaped."""
    return json.dumps(body).encode()


RAW = st.binary(max_size=300) | st.sampled_from(
    [
        b"",
        b"{",
        b"null",
        b"[1, 2]",
        b'"text"',
        b"\xff\xfe{}",
        b'{"model": "tiny-llava", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",
        b"[" * 50_000 + b"]" * 50_000,
        b'{"model": "tiny-llava", "prompt": "' + b"x" * 1_000_000,
    ]
)


@pytest.fixture(scope="module")
def door_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The gateway, serving from a thread of its own, on its own NATS and Redis."""
    with (
        NatsServer(workdir=tmp_path_factory.mktemp("nats")) as nats,
        RedisServer(workdir=tmp_path_factory.mktemp("redis")) as redis,
    ):
        port = free_port()
        settings = GatewaySettings(
            model=tiny_model_dir, model_name="tiny-llava", nats_url=nats.url, redis_url=redis.url,
            port=port, http_port=port, max_held=0, max_image_bytes=1 << 20,
        )  # fmt: skip
        config = uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="warning")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.started, "the gateway did not start"
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            server.should_exit = True
            thread.join(30)


def check(resp: httpx.Response, sent: bytes) -> None:
    what = f"{sent[:200]!r}… -> {resp.status_code} {resp.text[:300]}"
    if resp.status_code == 503:
        assert resp.json()["error"]["code"] == "no_instance", what  # passed every check
        return
    assert 400 <= resp.status_code < 500, what
    assert len(resp.content) <= MAX_ERROR_BYTES, f"{len(resp.content):,} bytes: {what}"
    assert resp.headers["content-type"] == "application/json", what
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], what
    assert not any(leak in resp.text for leak in INTERNALS), what


def test_every_malformed_request_gets_a_short_4xx_a_person_can_act_on(door_url):
    bodies = (
        broken(st.sampled_from(IMAGE_URLS).map(chat_body), CHAT_FIELDS).map(
            lambda b: ("/v1/chat/completions", encode(b))
        )
        | broken(st.just(completion_body()), CHAT_FIELDS).map(lambda b: ("/v1/completions", encode(b)))
        | st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions"]), RAW)
    )
    answered: dict[int, int] = {}
    with httpx.Client(base_url=door_url, timeout=60) as http:

        @settings(max_examples=CASES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(bodies)
        def case(sent: tuple[str, bytes]) -> None:
            path, data = sent
            resp = http.post(path, content=data, headers={"content-type": "application/json"})
            answered[resp.status_code] = answered.get(resp.status_code, 0) + 1
            check(resp, data)

        case()
        # The issue's own case: a 10 MB image_url came back as a 10 MB 400.
        huge = chat_body("http://h:" + "9" * (10 << 20) + "/x.png")
        reply = http.post("/v1/chat/completions", json=huge)
        assert reply.status_code == 400 and len(reply.content) < 300, reply.text[:300]
        # Afterwards a good request, its image inline or wrapped at 76 columns, still passes every check.
        for url in IMAGE_URLS[:2]:
            reply = http.post("/v1/chat/completions", json=chat_body(url))
            assert reply.status_code == 503 and reply.json()["error"]["code"] == "no_instance", reply.text
    print(f"answers by status: {dict(sorted(answered.items()))}")
    assert sum(n for status, n in answered.items() if 400 <= status < 500) > CASES // 2, answered


REFUSING = (
    "{%- if messages[0]['role'] == 'assistant' %}"
    "{{ raise_exception('Conversation roles must start with user or system') }}{%- endif %}"
)


async def test_messages_the_chat_template_refuses_are_a_400_naming_them(
    tiny_model_dir: Path, tmp_path: Path, nats_server, redis_server
) -> None:
    """A release's template may refuse a conversation (Qwen's raise when there is no user turn):
    that is the client's to change, not a 500."""
    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "tiny-llava"))
    template = model / "chat_template.jinja"
    template.write_text(REFUSING + template.read_text())
    settings = GatewaySettings(
        model=model, model_name="tiny-llava", nats_url=nats_server.url, redis_url=redis_server.url, max_held=0
    )
    async with gateway(settings) as (url, _), httpx.AsyncClient(base_url=url, timeout=30) as http:
        refused = await http.post("/v1/chat/completions", json={
            "model": "tiny-llava", "messages": [{"role": "assistant", "content": "hi"}],
        })  # fmt: skip
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert (error["param"], error["code"]) == ("messages", "chat_template")
        assert error["message"].endswith("refuses them: Conversation roles must start with user or system")
        taken = await http.post("/v1/chat/completions", json=completion_body() | {"messages": [
            {"role": "user", "content": "hi"}]})  # fmt: skip
        assert taken.json()["error"]["code"] == "no_instance", taken.text  # it passed every check
