"""Fuzzing the gateway from its own OpenAPI schema: bodies that follow the schema, bodies that
break it in one place (a wrong type, an extreme number, a huge string, a missing field), and raw
bytes. No case may get a 5xx, every 4xx has the OpenAI error shape, and the deployment is still
ready and answering afterwards.

CI runs FUZZ_CASES (default 150) per endpoint; `TRIDENT_FUZZ_CASES=3000 pytest tests/services/test_fuzz.py`
runs the long version."""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers.chat import body

FUZZ_CASES = int(os.environ.get("TRIDENT_FUZZ_CASES", "150"))
ENDPOINTS = {"/v1/chat/completions": "ChatCompletionRequest", "/v1/completions": "CompletionRequest"}
SMALL_OUTPUT = ("max_tokens", "max_completion_tokens")  # kept small, so valid cases stay quick
BIG_INTS = [0, -1, 1, 2**31, 2**63, 2**64, -(2**64), 10**30]
EXTREMES = [*BIG_INTS, 1e308, -1e308, 0.5, float("inf")]
TINY_PNG = (  # one pixel
    "data:image/png;base64,"
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
)
URLS = [
    TINY_PNG, "data:image/png;base64,@@", "data:text/plain,hello", "http://127.0.0.1:1/x.png",
    "http://[::1/x", "http://h:99999/x", "http://100.100.100.200/x", "file:///etc/passwd", "", "ftp://x/y",
]  # fmt: skip
JUNK = st.recursive(
    st.none() | st.booleans() | st.sampled_from(EXTREMES) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def schema(epd) -> dict:
    return httpx.get(epd.url + "/openapi.json", timeout=10).json()


class SchemaStrategies:
    """Hypothesis strategies for bodies a schema describes: valid ones, and ones broken in one place."""

    def __init__(self, document: dict) -> None:
        self.defs = document["components"]["schemas"]

    def body(self, schema: dict) -> st.SearchStrategy:
        return st.one_of(self._valid(schema), self._broken(schema))

    def _broken(self, schema: dict) -> st.SearchStrategy:
        """A valid body with one field replaced by junk, or one required field taken out."""

        @st.composite
        def build(draw) -> dict:
            out = draw(self._valid(schema))
            key = draw(st.sampled_from(sorted(schema["properties"])))
            if key in schema.get("required", ()) and draw(st.booleans()):
                out.pop(key, None)
            else:
                out[key] = draw(JUNK)
            return out

        return build()

    def _valid(self, schema: dict, name: str = "") -> st.SearchStrategy:
        if "$ref" in schema:
            return st.deferred(lambda: self._valid(self.defs[schema["$ref"].rsplit("/", 1)[1]]))
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return st.one_of([self._valid(s, name) for s in schema[key]])
        if "const" in schema:
            return st.just(schema["const"])
        if "enum" in schema:
            return st.sampled_from(schema["enum"])
        kind = schema.get("type")
        if kind == "object":
            return self._object(schema)
        if kind == "array":
            return st.lists(
                self._valid(schema.get("items", {})), min_size=schema.get("minItems", 0), max_size=3
            )
        if kind == "integer":
            if name in SMALL_OUTPUT:
                return st.integers(1, 4)
            return st.integers(schema.get("minimum"), schema.get("maximum")) | st.sampled_from(BIG_INTS)
        if kind == "number":
            return st.floats(schema.get("minimum"), schema.get("maximum"), allow_nan=False) | st.sampled_from(
                EXTREMES
            )
        if kind == "string" and name == "model":
            return st.just("tiny-llava") | st.text(max_size=10)
        if kind == "string":
            return (
                st.sampled_from(URLS)
                if name == "url"
                else st.text(max_size=30) | st.text(min_size=3000, max_size=3000)
            )
        if kind == "boolean":
            return st.booleans()
        return JUNK

    def _object(self, schema: dict) -> st.SearchStrategy:
        required = set(schema.get("required", ()))
        fields = {k: self._valid(v, k) for k, v in schema.get("properties", {}).items()}
        optional = st.fixed_dictionaries({}, optional={k: v for k, v in fields.items() if k not in required})
        return st.builds(
            lambda r, o: {**r, **o}, st.fixed_dictionaries({k: fields[k] for k in required}), optional
        )


def check(resp: httpx.Response, what: str) -> None:
    assert resp.status_code < 500, f"{what} -> {resp.status_code}: {resp.text[:500]}"
    if resp.status_code >= 400:
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"], resp.text


@pytest.mark.parametrize("path", list(ENDPOINTS))
def test_no_fuzzed_body_gets_a_server_error(epd, schema, path):
    component = schema["components"]["schemas"][ENDPOINTS[path]]
    bodies = SchemaStrategies(schema).body(component) | st.binary(max_size=200)
    url = epd.url + path
    with httpx.Client(timeout=60) as http:

        @settings(max_examples=FUZZ_CASES, deadline=None, suppress_health_check=list(HealthCheck))
        @given(bodies)
        def case(payload) -> None:
            if isinstance(payload, bytes):
                check(
                    http.post(url, content=payload, headers={"content-type": "application/json"}),
                    repr(payload),
                )
                return
            try:
                data = json.dumps(payload, allow_nan=False).encode()
            except ValueError:
                data = json.dumps(payload).encode()  # Infinity and NaN: not JSON, as clients may send
            check(http.post(url, content=data, headers={"content-type": "application/json"}), data[:300])

        case()
        assert httpx.get(epd.url + "/ready", timeout=5).status_code == 200
        answer = http.post(epd.url + "/v1/chat/completions", json=body(max_tokens=3))
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
