"""Image fetching: data URLs, size caps, timeouts and the address policy, against a real local server."""

from __future__ import annotations

import base64
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from common.errors import APIError
from services.gateway.images import ImagePolicy, fetch_image

PAYLOAD = b"\x89PNG fake image bytes" * 100


class Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/slow":
            time.sleep(2)
        if self.path == "/trickle":  # a byte every 0.3 s, each one inside any per-read timeout
            self.send_response(200)
            self.end_headers()
            for _ in range(20):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.3)
            return
        if self.path == "/missing":
            self.send_response(404)
            self.end_headers()
            return
        body = PAYLOAD * (1000 if self.path == "/big" else 1)
        self.send_response(200)
        if self.path != "/big":  # /big hides its length, so the cap must hold while streaming
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


OPEN = ImagePolicy(allow_private=True, max_bytes=1 << 20, timeout_s=0.5)


async def test_data_url_round_trips():
    url = "data:image/png;base64," + base64.b64encode(PAYLOAD).decode()
    assert await fetch_image(url, ImagePolicy()) == PAYLOAD


@pytest.mark.parametrize("url", ["data:image/png,rawbytes", "data:image/png;base64,@@@not-base64"])
async def test_bad_data_urls_are_400(url):
    with pytest.raises(APIError) as err:
        await fetch_image(url, ImagePolicy())
    assert err.value.status == 400


async def test_loopback_is_refused_by_default(server):
    with pytest.raises(APIError) as err:
        await fetch_image(server + "/img", ImagePolicy())
    assert err.value.status == 400 and "non-public address" in err.value.message


@pytest.mark.parametrize("host", ["10.1.2.3", "192.168.0.7", "169.254.169.254", "[::1]"])
async def test_private_and_link_local_hosts_are_refused(host):
    with pytest.raises(APIError, match="non-public"):
        await fetch_image(f"http://{host}/x.png", ImagePolicy())


async def test_allowed_private_fetch_works(server):
    assert await fetch_image(server + "/img", OPEN) == PAYLOAD


async def test_size_cap_holds_while_streaming(server):
    with pytest.raises(APIError) as err:
        await fetch_image(server + "/big", ImagePolicy(allow_private=True, max_bytes=64 << 10))
    assert err.value.status == 413


async def test_timeout_and_http_errors_are_400(server):
    with pytest.raises(APIError, match="timed out"):
        await fetch_image(server + "/slow", OPEN)
    with pytest.raises(APIError, match="HTTP 404"):
        await fetch_image(server + "/missing", OPEN)
    with pytest.raises(APIError, match="data: URL or an http"):
        await fetch_image("ftp://example.com/x.png", OPEN)


async def test_the_fetch_goes_to_the_address_that_was_checked(server, monkeypatch):
    # A name only this test's resolver knows: were the fetch to resolve it again (the step DNS
    # rebinding exploits), it would fail; it succeeds because it connects to the checked address.
    import asyncio

    loop = asyncio.get_running_loop()
    real = loop.getaddrinfo
    port = int(server.rsplit(":", 1)[1])

    async def fake(host, *args, **kwargs):
        return await real("127.0.0.1" if host == "images.rebind.test" else host, *args, **kwargs)

    monkeypatch.setattr(loop, "getaddrinfo", fake)
    assert await fetch_image(f"http://images.rebind.test:{port}/img", OPEN) == PAYLOAD
    with pytest.raises(APIError, match="non-public"):
        await fetch_image(f"http://images.rebind.test:{port}/img", ImagePolicy())


async def test_a_trickling_server_cannot_hold_a_fetch_past_its_deadline(server):
    """Each byte comes within any per-read timeout; the whole fetch still ends at the deadline."""
    started = time.monotonic()
    with pytest.raises(APIError, match="timed out") as err:
        await fetch_image(server + "/trickle", ImagePolicy(allow_private=True, timeout_s=1.0))
    assert err.value.status == 400 and time.monotonic() - started < 2.0


@pytest.mark.parametrize(
    "url",
    [
        "http://h:99999/x.png",  # a port out of range
        "http://[::1/x.png",  # an unclosed IPv6 literal
        "http://" + "a" * 64 + ".example.com/x.png",  # a DNS label over 63 bytes
        "http:///x.png",  # no host
    ],
)
async def test_urls_that_do_not_parse_are_400(url):
    with pytest.raises(APIError) as err:
        await fetch_image(url, ImagePolicy())
    assert err.value.status == 400


@pytest.mark.parametrize(
    "host",
    [
        "100.100.100.200",
        "100.64.0.1",
        "192.0.2.10",
        "198.18.0.1",
        "0.0.0.0",
        "[::ffff:127.0.0.1]",
        "[fd00::1]",
    ],
)
async def test_every_non_global_address_is_refused(host):
    """Carrier-grade NAT (a cloud metadata address among them), documentation, benchmarking and
    IPv4-mapped loopback, beside the private ranges."""
    with pytest.raises(APIError, match="non-public"):
        await fetch_image(f"http://{host}/x.png", ImagePolicy())


async def test_base64_broken_into_lines_decodes_as_rfc_2045_decoders_read_it():
    """`base64.encodebytes` and the `base64` command wrap at 76 columns; CRLF and spaces likewise."""
    for encoded in (
        base64.encodebytes(PAYLOAD).decode(),
        base64.encodebytes(PAYLOAD).decode().replace("\n", "\r\n"),
        " ".join(base64.b64encode(PAYLOAD).decode()[i : i + 64] for i in range(0, 3000, 64)),
    ):
        assert "\n" in encoded or " " in encoded
        assert await fetch_image("data:image/png;base64," + encoded, ImagePolicy()) == PAYLOAD


@pytest.mark.parametrize(
    ("payload", "said"),
    [
        ("iVBORw0KGgo*AAA", "holds '*' at character 11, outside the base64 alphabet"),
        ("iVBORw0KGgo_AAA", "URL-safe base64 (- and _) is not taken: use + and /"),
        ("iVBORw0KGgoAAA", "its length, 14 characters without whitespace, is not a multiple of 4"),
        ("iVBO\nRw0K\u00e9Ggo", "holds '\\xe9' at character 9"),
        ("iV==Rw0KGgoA", "'=' padding appears before its end"),
    ],
)
async def test_base64_that_does_not_decode_says_what_is_wrong(payload, said):
    with pytest.raises(APIError) as err:
        await fetch_image("data:image/png;base64," + payload, ImagePolicy())
    assert err.value.status == 400 and said in err.value.message, err.value.message
    assert "line breaks and spaces are fine" in err.value.message


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("http://h:" + "9" * 10_000_000 + "/x.png", "its port is not a number from 0 to 65535"),
        ("http://h:" + "x" * 10_000_000 + "/x.png", "its port is not a number from 0 to 65535"),
        ("http://[" + "1" * 10_000_000 + "/x", "brackets (an IPv6 address) do not match"),
        ("http://" + "a" * 10_000_000 + "/x.png", "a part of the name is empty or over 63 characters"),
        ("ftp://" + "a" * 10_000_000, "must be a data: URL or an http(s) URL"),
    ],
)
async def test_a_10_mb_url_gets_a_short_400_that_says_what_is_wrong(url, said):
    """Regression: urllib's error quoted the whole port (and Python's integer-digits limit leaked)."""
    with pytest.raises(APIError) as err:
        await fetch_image(url, ImagePolicy())
    assert err.value.status == 400 and said in err.value.message, err.value.message[:300]
    assert len(err.value.message) < 300 and "set_int_max_str_digits" not in err.value.message
