"""Bad input gets a 4xx with an OpenAI error body, and the cluster stays ready."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.helpers.chat import body, user_message
from tests.helpers.images import png_header


def big_png_url(megabytes: int) -> str:
    side = int((megabytes * 1024 * 1024 / 3) ** 0.5) + 1  # side * side * 3 bytes of pixels
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=0)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def png_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


CASES = [
    ("malformed json", b"{not json", 400),
    ("unknown model", body(model="gpt-9"), 404),
    ("no messages", body(messages=[]), 400),
    (
        "not an image",
        body(messages=user_message(["data:image/png;base64," + base64.b64encode(b"hello").decode()], "x")),
        400,
    ),
    ("loopback url", body(messages=user_message(["http://127.0.0.1:1/cat.png"], "x")), 400),
    ("private url", body(messages=user_message(["http://10.0.0.8/cat.png"], "x")), 400),
    ("too many images", body(messages=user_message(["data:image/png;base64,AAAA"] * 9, "x")), 400),
    ("beyond context", body(max_tokens=2047), 400),
    ("max_tokens zero", body(max_tokens=0), 400),
    ("n=2", body(n=2), 400),
    ("bad role", body(messages=[{"role": "robot", "content": "x"}]), 400),
    ("body not utf-8", b"\xff\xfe{}", 400),
    ("body not an object", b"[1, 2]", 400),
    ("port out of range", body(messages=user_message(["http://h:99999/x.png"], "x")), 400),
    ("broken ipv6 url", body(messages=user_message(["http://[::1/x.png"], "x")), 400),
    ("64-byte dns label", body(messages=user_message(["http://" + "a" * 64 + ".example.com/x"], "x")), 400),
    (
        "carrier-grade nat url",
        body(messages=user_message(["http://100.100.100.200/latest/meta-data"], "x")),
        400,
    ),
    ("seed past 64 bits", body(seed=2**64), 400),
    ("top_k past 64 bits", body(top_k=2**64), 400),
    ("max_tokens past 64 bits", body(max_tokens=2**64), 400),
    ("20000x20000 png", body(messages=user_message([png_url(png_header(20000, 20000))], "x")), 413),
]


@pytest.mark.parametrize(("name", "payload", "status"), CASES, ids=[c[0] for c in CASES])
def test_bad_requests_get_openai_errors(epd, name, payload, status):
    url = epd.url + "/v1/chat/completions"
    if isinstance(payload, bytes):
        resp = httpx.post(url, content=payload, headers={"content-type": "application/json"}, timeout=30)
    else:
        resp = httpx.post(url, json=payload, timeout=30)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["message"] and error["type"] and set(error) == {"message", "type", "param", "code"}
    assert httpx.get(epd.url + "/ready", timeout=5).status_code == 200


def test_a_50_mb_image_is_413(epd):
    url = big_png_url(50)
    assert len(url) * 3 // 4 > 50 * 1024 * 1024
    resp = httpx.post(
        epd.url + "/v1/chat/completions", json=body(messages=user_message([url], "x")), timeout=60
    )
    assert resp.status_code == 413 and "larger than" in resp.json()["error"]["message"]
    assert httpx.get(epd.url + "/ready", timeout=5).status_code == 200


def test_the_cluster_still_answers_after_bad_input(epd):
    resp = httpx.post(epd.url + "/v1/chat/completions", json=body(), timeout=30)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4


BAD = "a\ud800b"  # a lone UTF-16 surrogate: JSON can write it ("\ud800"), UTF-8 cannot encode it


def parts(*content: dict) -> dict:
    return body(messages=[{"role": "user", "content": list(content)}])


def image(url: str | None = "data:x", **more) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **more}}


SURROGATES = [  # (endpoint, body, the param the 400 names)
    ("chat", body(messages=[{"role": "user", "content": BAD}]), "messages.0.content"),
    ("chat", parts({"type": "text", "text": BAD}), "messages.0.content.0.text"),
    ("chat", parts(image(BAD)), "messages.0.content.0.image_url.url"),
    ("chat", parts(image(detail=BAD)), "messages.0.content.0.image_url.detail"),
    ("chat", parts({"type": BAD, "text": "hi"}), "messages.0.content.0.type"),
    ("chat", body(messages=[{"role": BAD, "content": "hi"}]), "messages.0.role"),
    ("chat", body(messages=[{"role": "user", "content": "hi", "name": BAD}]), "messages.0.name"),
    ("chat", body(model=BAD), "model"),
    ("chat", body(user=BAD), "user"),
    ("chat", body(stop=BAD), "stop"),
    ("chat", body(stop=["ok", BAD]), "stop.1"),
    ("chat", body(metadata={"note": BAD}), "metadata.note"),
    ("chat", body(response_format={"type": BAD}), "response_format.type"),
    ("chat", body(**{BAD: 1}), "a\\ud800b (the key)"),
    ("text", {"model": "tiny-llava", "prompt": BAD}, "prompt"),
    ("text", {"model": "tiny-llava", "prompt": ["hi", BAD]}, "prompt.1"),
    ("text", {"model": "tiny-llava", "prompt": "hi", "suffix": BAD}, "suffix"),
]


def post_raw(epd, raw: bytes, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(epd.url + path, content=raw, headers={"content-type": "application/json"}, timeout=30)


@pytest.mark.parametrize(("endpoint", "payload", "param"), SURROGATES, ids=[c[2] for c in SURROGATES])
def test_a_lone_surrogate_in_any_string_is_a_400_naming_the_field(epd, endpoint, payload, param):
    """Regression: a lone surrogate in a chat message was a 500 `internal error (TypeError)`."""
    raw = json.dumps(payload).encode()  # ensure_ascii: the surrogate travels as the escape \ud800
    assert b"\\ud800" in raw
    resp = post_raw(epd, raw, "/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, "invalid_unicode")
    assert "surrogate" in error["message"] and error["message"].startswith(param)


def test_errors_name_the_field_and_the_real_reason(epd):
    """Regression: `image_url.url: null` was "content.str should be a valid string", a NaN
    temperature "should be ≤ 2", and invalid JSON came with `param: "70"`."""
    error = post_raw(epd, json.dumps(parts(image(None))).encode()).json()["error"]
    assert error["param"] == "messages.0.content.0.image_url.url" and "is null" in error["message"], error
    nan = json.dumps(body(temperature=float("nan"))).encode()
    assert b"NaN" in nan
    error = post_raw(epd, nan).json()["error"]
    assert error["param"] == "temperature" and "finite number" in error["message"], error
    error = post_raw(epd, b'{"model": "tiny-llava",\n "messages": [}').json()["error"]
    assert error["param"] is None and error["code"] == "json_invalid", error
    assert error["message"].startswith("request body is not valid JSON")
    assert "line 2, column 15" in error["message"], error
    error = post_raw(epd, json.dumps(parts({"type": "text"})).encode()).json()["error"]
    assert error["param"] == "messages.0.content.0.text"
    assert error["message"] == "messages.0.content.0.text: Field required"


UNHONOURED = [
    ("min_p", 0.1),
    ("min_tokens", 3),
    ("top_logprobs", 2),
    ("best_of", 2),
    ("use_beam_search", True),
    ("response_format", {"type": "json_object"}),
    ("tools", [{"type": "function"}]),
]


def test_a_sampling_field_the_engine_does_not_honour_is_refused_not_ignored(epd):
    """Regression: `logit_bias` (100k entries) was accepted and silently ignored."""
    url = epd.url + "/v1/chat/completions"
    huge = httpx.post(url, json=body(logit_bias={str(i): 100 for i in range(100_000)}), timeout=60)
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "logit_bias", huge.text
    for field, value in UNHONOURED:
        resp = httpx.post(url, json=body(**{field: value}), timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == field, (field, resp.text)
    neutral = body(logit_bias=None, min_p=0, top_logprobs=None, response_format={"type": "text"})
    assert httpx.post(url, json=neutral, timeout=30).status_code == 200
