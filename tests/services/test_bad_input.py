"""Bad input gets a 4xx with an OpenAI error body, and the cluster stays ready."""

from __future__ import annotations

import base64
import io

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.engine.test_loader import png_header
from tests.services.test_e2e import user_message


def big_png_url(megabytes: int) -> str:
    side = int((megabytes * 1024 * 1024 / 3) ** 0.5) + 1  # side * side * 3 bytes of pixels
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=0)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def png_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def body(**over):
    b = {"model": "tiny-llava", "messages": user_message([], "hi"), "max_tokens": 4}
    b.update(over)
    return b


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
