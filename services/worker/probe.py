"""A probe of this container's worker, for orchestrators whose HTTP probes cannot show a client
certificate (Kubernetes' httpGet): with TRIDENT_TLS_DIR the worker's HTTP answers only clients
that show the deployment's certificate, so the probe is a command that does.

    python -m services.worker.probe /ready     # exit 0 on 200, 1 otherwise (the reason on stderr)

Standard library only, besides common.tls: it runs every few seconds.
"""

from __future__ import annotations

import http.client
import os
import sys

from common.tls import tls_from_env


def main(path: str) -> int:
    port = int(os.environ.get("TRIDENT_HTTP_PORT", "9000"))
    tls = tls_from_env()
    if tls is None:
        conn: http.client.HTTPConnection = http.client.HTTPConnection("127.0.0.1", port, timeout=3)
    else:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=3, context=tls.client_context())
    try:
        conn.request("GET", path)
        reply = conn.getresponse()
        body = reply.read(200).decode(errors="replace")
    except OSError as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return 1
    finally:
        conn.close()
    if reply.status != 200:
        print(f"{path}: {reply.status} {body}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "/health"))
