"""How an outsider tries a deployment's port when TLS is on, and what counts as reading nothing."""

from __future__ import annotations

import socket
import ssl

from common.tls import Tls


def probes(stranger: Tls) -> dict[str, ssl.SSLContext | None]:
    """How an outsider may try the port: plain bytes, TLS with no certificate, TLS with a
    certificate of its own. None of them checks the server (it wants the data, not safety)."""

    def anyone(cert: Tls | None) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        if cert is not None:
            ctx.load_cert_chain(cert.cert, cert.key)
        return ctx

    return {
        "plain": None,
        "tls without a certificate": anyone(None),
        "another CA's certificate": anyone(stranger),
    }


def probe(host: str, port: int, ctx: ssl.SSLContext | None, request: bytes) -> bytes:
    """What the port answers `request` with; b"" when the connection fails or closes first."""
    got = b""
    try:
        with socket.create_connection((host, port), timeout=3) as raw:
            sock = ctx.wrap_socket(raw) if ctx is not None else raw
            sock.sendall(request)
            while chunk := sock.recv(4096):
                got += chunk
    except (OSError, TimeoutError):  # refused handshakes (ssl.SSLError) and resets alike
        pass
    return got


def only_alerts(answer: bytes) -> bool:
    """Nothing of the protocol came back: nothing at all, or TLS alert records (content type 21)."""
    while answer:
        if answer[0] != 21 or len(answer) < 5:
            return False
        answer = answer[5 + int.from_bytes(answer[3:5], "big") :]
    return True
