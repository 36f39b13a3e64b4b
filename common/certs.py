"""A private CA for one deployment, and the one certificate its processes share (common/tls.py).

    issue(folder, hosts=["gateway.example"])   # writes ca.pem, cert.pem, key.pem

The CA's own key is never written: once the certificate is signed nothing more can be, so a
stolen copy of the folder cannot mint members of this or any other deployment. Adding a host is
issuing a new folder and rolling it out. Keys are ECDSA P-256; the certificate is good for both
ends of a connection (serverAuth and clientAuth) and carries `hosts` (and loopback) as names for
clients outside the deployment that do check them.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from common.tls import Tls

VALID_DAYS = 825
MEMBER_NAME = "trident-member"  # a name every certificate carries, for clients that check one (Prometheus)
_NO_USE = dict.fromkeys(
    ["digital_signature", "content_commitment", "key_encipherment", "data_encipherment", "key_agreement",
     "key_cert_sign", "crl_sign", "encipher_only", "decipher_only"],
    False,
)  # fmt: skip  # the most a leaf may carry for clients that enforce it


def issue(folder: str | os.PathLike[str], hosts: Iterable[str] = (), name: str = "trident") -> Tls:
    """Write a fresh CA and certificate into `folder` (created 0700; files 0600 for the key)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} deployment CA")])
    ca = (
        _builder(ca_name, ca_name, ca_key, now)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(**{**_NO_USE, "key_cert_sign": True, "crl_sign": True}),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    member = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} member")])
    leaf = (
        _builder(member, ca_name, key, now)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(_names(hosts)), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    _write(folder / "ca.pem", ca.public_bytes(pem), 0o644)
    _write(folder / "cert.pem", leaf.public_bytes(pem), 0o644)
    key_pem = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    _write(folder / "key.pem", key_pem, 0o600)
    return Tls.at(folder)


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey, now: datetime.datetime
) -> x509.CertificateBuilder:
    """A certificate of `key`'s, valid from a few minutes ago (clocks drift) for VALID_DAYS."""
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
    )


def _names(hosts: Iterable[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys([MEMBER_NAME, "localhost", "127.0.0.1", "::1", *hosts]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _write(path: Path, data: bytes, mode: int) -> None:
    """Replace `path` with `data`, created with `mode` (never readable by others, even briefly)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)
