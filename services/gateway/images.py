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
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from common.errors import APIError

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
    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError as exc:  # a bad IPv6 literal, a port out of range
        raise APIError(400, f"{policy.part} is not a valid URL: {exc}", param=policy.part) from None
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
        raise APIError(400, f"cannot fetch {policy.part}: {exc}", param=policy.part) from exc


def _decode_data_url(url: str, policy: ImagePolicy) -> bytes:
    header, _, payload = url.partition(",")
    if ";base64" not in header:
        raise APIError(400, f"data: URLs in {policy.part} must be base64-encoded", param=policy.part)
    if len(payload) * 3 // 4 > policy.max_bytes:
        raise _too_large(policy)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise APIError(400, f"the data: URL in {policy.part} is not valid base64", param=policy.part) from exc


async def _resolve_checked(host: str, port: int, policy: ImagePolicy) -> IPAddress:
    """Resolve the host once; refuse it if any address is internal (unless allowed); return the
    address to connect to."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, ValueError) as exc:  # UnicodeError: a label over 63 bytes
        raise APIError(
            400, f"cannot resolve {policy.part} host {host[:80]!r}: {exc}", param=policy.part
        ) from None
    addresses = [ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos]
    if not addresses:
        raise APIError(400, f"cannot resolve {policy.part} host {host!r}", param=policy.part)
    if not policy.allow_private:
        for addr in addresses:
            if not public(addr):
                raise APIError(
                    400,
                    f"{policy.part} host {host!r} resolves to a non-public address ({addr}); "
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
