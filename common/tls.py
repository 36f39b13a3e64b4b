"""TLS between a deployment's processes: every channel (NATS, Redis, bulk transfer, the workers'
HTTP) encrypted, and both ends shown a certificate the deployment's CA signed.

One folder (TRIDENT_TLS_DIR; a Kubernetes Secret mounted as files) holds three PEM files:

    ca.pem     the deployment's CA: the only issuer either end trusts
    cert.pem   this process's certificate, good for serving and for connecting
    key.pem    its private key (0600)

The CA is the deployment's own (`common/certs.py` issues one): holding a certificate it signed is
what makes a process a member, so peers check the chain and not the name a certificate carries.
One certificate then serves every host, however its address was reached (a pod IP, a
namespace's veth, a compose hostname). A CA shared with anything else must not be used.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

FILES = ("ca.pem", "cert.pem", "key.pem")


@dataclass(frozen=True)
class Tls:
    folder: Path

    @property
    def ca(self) -> str:
        return str(self.folder / "ca.pem")

    @property
    def cert(self) -> str:
        return str(self.folder / "cert.pem")

    @property
    def key(self) -> str:
        return str(self.folder / "key.pem")

    @classmethod
    def at(cls, folder: str | os.PathLike[str]) -> Tls:
        """The folder's files, each checked readable now (an error naming the file) rather than
        at the first connection."""
        folder = Path(folder).resolve()  # servers read the files from working directories of their own
        for name in FILES:
            path = folder / name
            if not os.access(path, os.R_OK) or not path.is_file():
                needs = ", ".join(FILES)
                raise ValueError(f"TLS: {path} is missing or unreadable (the folder needs {needs})")
        tls = cls(folder)
        tls.server_context()  # a key that does not match its certificate fails here, by name
        return tls

    def client_context(self) -> ssl.SSLContext:
        """For dialling a member: its certificate must chain to the CA; ours goes with the hello."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.check_hostname = False  # membership is the CA's signature (module docstring)
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(self.ca)
        ctx.load_cert_chain(self.cert, self.key)
        return ctx

    def server_context(self) -> ssl.SSLContext:
        """For accepting members only: a client without a certificate the CA signed is refused in
        the handshake, before it can send a byte of the protocol."""
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.verify_mode = ssl.CERT_REQUIRED
        try:
            ctx.load_cert_chain(self.cert, self.key)
            ctx.load_verify_locations(self.ca)
        except (ssl.SSLError, OSError) as exc:
            problem = f"TLS: {self.folder} does not hold a usable certificate and key: {exc}"
            raise ValueError(problem) from None
        return ctx

    def redis_options(self) -> dict[str, object]:
        """What redis-py's SSL connections take (its own context from the same files)."""
        return {
            "ssl_certfile": self.cert,
            "ssl_keyfile": self.key,
            "ssl_ca_certs": self.ca,
            "ssl_cert_reqs": "required",
            "ssl_check_hostname": False,
            "ssl_min_version": ssl.TLSVersion.TLSv1_2,
        }


def redis_tls(tls: Tls | None, *, flag: bool = False) -> dict[str, object]:
    """redis-py's TLS keyword arguments for `tls` (none without it). `flag` adds `ssl=True`, which a
    client built from a host and port needs; one built from a rediss:// URL takes the rest alone."""
    if tls is None:
        return {}
    return {"ssl": True, **tls.redis_options()} if flag else tls.redis_options()


def tls_from_env() -> Tls | None:
    """The deployment's TLS from TRIDENT_TLS_DIR, for code that has no settings object (tools)."""
    folder = os.environ.get("TRIDENT_TLS_DIR", "")
    return Tls.at(folder) if folder else None
