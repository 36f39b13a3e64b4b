"""Fetching a message's images: data: URLs, and http(s) URLs with a size cap, one deadline for the
whole fetch (a server that sends a byte every few seconds cannot hold it), and an address policy
that refuses every address that is not globally routable (loopback, private, link-local, shared
carrier-grade NAT 100.64.0.0/10, documentation, reserved) unless configured.

The host is resolved once, its addresses checked, and the connection made to the checked address
(the Host header and TLS SNI keep the name), so a name that resolves to a public address for the
check and to an internal one for the fetch (DNS rebinding) cannot slip through."""

from __future__ import annotations

import asyncio
import base64
import binascii
import ipaddress
import re
import socket
from dataclasses import dataclass
from urllib.parse import SplitResult, urlsplit

import httpx

from common.errors import APIError, clip

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class ImagePolicy:
    max_bytes: int = 20 << 20
    timeout_s: float = 10.0  # for the whole fetch: resolving, connecting and every byte
    allow_private: bool = False  # any address that is not globally routable
    max_images: int = 8
    max_pixels: int = 50_000_000  # checked from the image's header, before decoding
    part: str = "image_url"  # the content part fetched, as errors name it ("video_url" for clips)


async def fetch_image(url: str, policy: ImagePolicy) -> bytes:
    """The raw bytes of an image part's URL; every failure is a 4xx APIError naming the cause."""
    if url.startswith("data:"):
        return _decode_data_url(url, policy)
    parts, host, port = _split(url, policy)
    if parts.scheme == "file":
        raise APIError(
            400,
            f"{policy.part}: file:// URLs are not read from the server's disk; send it inline as a "
            "base64 data: URL (vllm bench serve: --custom-ensure-client-side-data) or by http(s)",
            param=policy.part,
            code=f"{policy.part}_forbidden",
        )
    if parts.scheme not in ("http", "https") or not host:
        raise APIError(400, f"{policy.part} must be a data: URL or an http(s) URL", param=policy.part)
    port = port or (443 if parts.scheme == "https" else 80)
    try:
        async with asyncio.timeout(policy.timeout_s):
            return await _fetch(parts, host, port, policy)
    except TimeoutError:
        raise _too_slow(policy) from None


async def _fetch(parts, host: str, port: int, policy: ImagePolicy) -> bytes:
    addr = await _resolve_checked(host, port, policy)
    pinned = parts._replace(netloc=f"[{addr}]:{port}" if addr.version == 6 else f"{addr}:{port}").geturl()
    default_port = port == (443 if parts.scheme == "https" else 80)
    headers = {"Host": host if default_port else f"{host}:{port}"}
    extensions = {"sni_hostname": host} if parts.scheme == "https" else {}
    try:
        async with (
            httpx.AsyncClient(timeout=policy.timeout_s, follow_redirects=False) as client,
            client.stream("GET", pinned, headers=headers, extensions=extensions) as resp,
        ):
            if resp.status_code != 200:
                raise APIError(
                    400, f"fetching {policy.part} returned HTTP {resp.status_code}", param=policy.part
                )
            declared = int(resp.headers.get("content-length") or 0)
            if declared > policy.max_bytes:
                raise _too_large(policy)
            data = bytearray()
            async for chunk in resp.aiter_bytes():
                data += chunk
                if len(data) > policy.max_bytes:
                    raise _too_large(policy)
            return bytes(data)
    except httpx.TimeoutException as exc:
        raise _too_slow(policy) from exc
    except httpx.HTTPError as exc:
        raise APIError(400, f"cannot fetch {policy.part}: {clip(str(exc), 200)}", param=policy.part) from exc


def _split(url: str, policy: ImagePolicy) -> tuple[SplitResult, str | None, int | None]:
    """The URL's parts, host and port; a 400 that says what is wrong with it, quoting none of it
    (urllib's own messages quote the port, however long)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
    except ValueError:  # urllib's only complaint here: an IPv6 literal's brackets
        raise _bad_url(policy, "its host's [ ] brackets (an IPv6 address) do not match") from None
    try:
        port = parts.port
    except ValueError:
        raise _bad_url(policy, "its port is not a number from 0 to 65535") from None
    return parts, host, port


def _bad_url(policy: ImagePolicy, why: str) -> APIError:
    return APIError(400, f"{policy.part} is not a valid URL: {why}", param=policy.part)


# What RFC 2045 decoders (base64 -d, browsers' atob) skip: `base64.encodebytes` and the `base64`
# command break their output into lines of 76 characters, and such a payload is valid base64.
BASE64_SPACE = b" \t\r\n\f\v"


def _decode_data_url(url: str, policy: ImagePolicy) -> bytes:
    """A data: URL's bytes. Its base64 may be broken into lines (whitespace is skipped); anything
    else outside the alphabet, or a wrong length, is refused saying which."""
    header, _, payload = url.partition(",")
    if ";base64" not in header:
        raise APIError(400, f"data: URLs in {policy.part} must be base64-encoded", param=policy.part)
    try:
        packed = payload.encode("ascii").translate(None, BASE64_SPACE)
    except UnicodeEncodeError as exc:
        raise _not_base64(policy, f"it holds {payload[exc.start]!a} at character {exc.start}") from None
    if len(packed) * 3 // 4 > policy.max_bytes:
        raise _too_large(policy)
    try:
        return base64.b64decode(packed, validate=True)
    except (binascii.Error, ValueError):
        raise _not_base64(policy, _base64_fault(packed)) from None


def _base64_fault(packed: bytes) -> str:
    """What is wrong with base64 that did not decode (whitespace already taken out)."""
    stray = re.search(rb"[^A-Za-z0-9+/=]", packed)
    if stray is not None:
        char = chr(packed[stray.start()])
        hint = "; URL-safe base64 (- and _) is not taken: use + and /" if char in "-_" else ""
        return f"it holds {char!a} at character {stray.start()}, outside the base64 alphabet{hint}"
    if len(packed) % 4:
        return (
            f"its length, {len(packed):,} characters without whitespace, is not a multiple of 4 (is '=' "
            "padding missing?)"
        )
    return "'=' padding appears before its end"


def _not_base64(policy: ImagePolicy, why: str) -> APIError:
    return APIError(
        400, f"the data: URL in {policy.part} is not valid base64: {why} (line breaks and spaces are fine)",
        param=policy.part,
    )  # fmt: skip


async def _resolve_checked(host: str, port: int, policy: ImagePolicy) -> IPAddress:
    """Resolve the host once; refuse it if any address is internal (unless allowed); return the
    address to connect to."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, ValueError) as exc:
        # UnicodeError: IDNA refuses a label that is empty or over 63 characters.
        why = "a part of the name is empty or over 63 characters" if isinstance(exc, UnicodeError) else exc
        raise APIError(
            400, f"cannot resolve {policy.part} host {clip(host)!r}: {clip(str(why), 200)}", param=policy.part
        ) from None
    addresses = [ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos]
    if not addresses:
        raise APIError(400, f"cannot resolve {policy.part} host {clip(host)!r}", param=policy.part)
    if not policy.allow_private:
        for addr in addresses:
            if not public(addr):
                raise APIError(
                    400,
                    f"{policy.part} host {clip(host)!r} resolves to a non-public address ({addr}); "
                    "set TRIDENT_ALLOW_PRIVATE_IMAGE_URLS=1 to allow it",
                    param=policy.part,
                    code=f"{policy.part}_forbidden",
                )
    return addresses[0]


def public(addr: IPAddress) -> bool:
    """Globally routable and unicast: not loopback, private, link-local, shared (100.64.0.0/10, where
    some clouds put their metadata service), documentation, benchmarking or reserved; an IPv4
    address written as IPv6 is judged as itself."""
    mapped = getattr(addr, "ipv4_mapped", None) or getattr(addr, "sixtofour", None)
    if mapped is not None:
        return public(mapped)
    return addr.is_global and not addr.is_multicast


def _too_slow(policy: ImagePolicy) -> APIError:
    message = f"fetching {policy.part} timed out: it took over {policy.timeout_s:g}s in all"
    return APIError(400, message, param=policy.part, code=f"{policy.part}_timeout")


def _too_large(policy: ImagePolicy) -> APIError:
    return APIError(
        413,
        f"{policy.part}: the file is larger than the {policy.max_bytes >> 20} MB limit",
        param=policy.part,
    )
