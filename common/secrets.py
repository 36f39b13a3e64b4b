"""Per-deployment secrets: the NATS token, the Redis password, the transfer secret and the key the
planner's write endpoints ask for.

One directory holds one file per secret (mode 0600). Whoever starts a deployment creates them
once (`ensure`: compose's `secrets-init` service, `trident up`); every service is pointed at the
directory (TRIDENT_SECRETS_DIR) and `apply` puts them where its clients need them. A secret given
outright (credentials in TRIDENT_NATS_URL or TRIDENT_REDIS_URL, TRIDENT_TRANSFER_SECRET) wins.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

NAMES = ("nats-token", "redis-password", "transfer-secret", "planner-key")


@dataclass(frozen=True)
class DeploymentSecrets:
    nats_token: str
    redis_password: str
    transfer_secret: str
    planner_key: str  # POST /plan/replan and /plan/jobs ask for it (or one of TRIDENT_API_KEYS)

    @classmethod
    def ensure(cls, folder: Path) -> DeploymentSecrets:
        """The secrets in `folder`, each created (random, 0600) if it is not there yet."""
        folder.mkdir(parents=True, exist_ok=True)
        for name in NAMES:
            path = folder / name
            if not path.exists():
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(new_secret())
        return cls.read(folder)

    @classmethod
    def read(cls, folder: Path) -> DeploymentSecrets:
        """The secrets in `folder`; a missing or empty file is an error naming it."""
        values = []
        for name in NAMES:
            path = folder / name
            try:
                value = path.read_text().strip()
            except OSError as exc:
                raise ValueError(f"secret {path} cannot be read: {exc.strerror}") from None
            if not value:
                raise ValueError(f"secret {path} is empty")
            values.append(value)
        return cls(*values)


def operator_header(folder: Path) -> dict[str, str]:
    """The Authorization header that carries a deployment's operator key (its `planner-key`): the
    planner's writes take it, and the gateway's /v1/cluster shows the instances' addresses to it."""
    return {"Authorization": f"Bearer {DeploymentSecrets.read(folder).planner_key}"}


def new_secret() -> str:
    """192 random bits as a letter and 48 hex digits. nats-server reads the token from its
    environment into its config and parses it as a value: a token_urlsafe that began with digits and
    a dash ("2025-...") was taken for a date, and NATS refused to start. A letter first makes any
    secret a plain string wherever it is read (none is a boolean word: all are 49 characters)."""
    return "s" + secrets.token_hex(24)


def with_credentials(url: str, user: str, password: str) -> str:
    """`url` with `user[:password]@` added, unless it carries credentials already. A list of URLs
    (a NATS cluster's nodes, comma-separated) gets them in each."""
    if "," in url and "://" in url.partition(",")[2]:
        return ",".join(with_credentials(part.strip(), user, password) for part in url.split(","))
    parts = urlsplit(url)
    if "@" in parts.netloc:
        return url
    auth = quote(user, safe="") + (":" + quote(password, safe="") if password else "")
    return urlunsplit(parts._replace(netloc=f"{auth}@{parts.netloc}"))
