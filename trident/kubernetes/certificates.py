"""Mutual TLS on Kubernetes from cert-manager: the deployment's CA (made once by a self-signed
issuer), a key and certificate of its own for every pod (cert-manager's csi-driver writes them into
the pod's /tls when it starts and renews them in place), and a client certificate of Prometheus's
own for scraping the workers' HTTPS.

Rotation: a pod's certificate lasts POD_CERT_DAYS and is renewed RENEW_DAYS before it ends; Trident's
processes, nats-server and redis-server read theirs at start, so every pod must restart within
POD_CERT_DAYS - RENEW_DAYS of its start (docs/running.md, "Kubernetes": a rolling restart, which
a pod's ordinary life (scaling, updates, node drains) usually brings sooner). Prometheus's is a
Secret cert-manager renews, which the Prometheus operator reloads. The CA lasts CA_DAYS; replacing
it is deleting the Secret `trident-ca` (cert-manager issues a new one) and restarting every pod.
"""

from __future__ import annotations

from common.certs import MEMBER_NAME
from common.tls import FILES
from trident.kubernetes.objects import RUN_AS, TLS_DIR, meta

CA_ISSUER = "trident-ca"
CA_SECRET = "trident-ca"
PROMETHEUS_SECRET = "trident-prometheus-tls"  # tls.crt, tls.key, ca.crt (cert-manager's names)
CA_DAYS = 5 * 365
POD_CERT_DAYS = 90
RENEW_DAYS = 30
USAGES = "digital signature,key encipherment,server auth,client auth"  # one certificate, both ends


def hours(days: int) -> str:
    return f"{days * 24}h"


def issuers(namespace: str) -> list[dict]:
    """The self-signed issuer that makes the CA, the CA's Certificate, the issuer that signs with it,
    and Prometheus's client certificate."""
    key = {"algorithm": "ECDSA", "size": 256}
    selfsigned = _object("Issuer", "trident-selfsigned", namespace, {"selfSigned": {}})
    ca = _object("Certificate", "trident-ca", namespace, {
        "isCA": True, "commonName": "trident deployment CA", "secretName": CA_SECRET,
        "duration": hours(CA_DAYS), "privateKey": {**key, "rotationPolicy": "Always"},
        "issuerRef": {"name": "trident-selfsigned", "kind": "Issuer"},
    })  # fmt: skip
    signer = _object("Issuer", CA_ISSUER, namespace, {"ca": {"secretName": CA_SECRET}})
    prometheus = _object("Certificate", "trident-prometheus", namespace, {
        "commonName": "prometheus", "secretName": PROMETHEUS_SECRET,
        "duration": hours(POD_CERT_DAYS), "renewBefore": hours(RENEW_DAYS),
        "privateKey": {**key, "rotationPolicy": "Always"}, "usages": ["digital signature", "client auth"],
        "issuerRef": {"name": CA_ISSUER, "kind": "Issuer"},
    })  # fmt: skip
    return [selfsigned, ca, signer, prometheus]


def _object(kind: str, name: str, namespace: str, spec: dict) -> dict:
    return {
        "apiVersion": "cert-manager.io/v1",
        "kind": kind,
        "metadata": meta(name, namespace, "tls"),
        "spec": spec,
    }


def pod_tls(headless: str | None = None) -> tuple[dict, dict]:
    """The pod's own key and certificate as files in TLS_DIR (the names common/tls.py reads), and
    where they are mounted. `headless`: the Service whose per-pod DNS name it carries (NATS's routes
    check the name they dial); every certificate carries MEMBER_NAME, which Prometheus checks."""
    names = [MEMBER_NAME]
    if headless is not None:
        names.insert(0, f"${{POD_NAME}}.{headless}.${{POD_NAMESPACE}}.svc")
    ca, cert, key = FILES
    volume = {
        "name": "tls",
        "csi": {
            "driver": "csi.cert-manager.io",
            "readOnly": True,
            "volumeAttributes": {
                "csi.cert-manager.io/issuer-name": CA_ISSUER,
                "csi.cert-manager.io/issuer-kind": "Issuer",
                "csi.cert-manager.io/dns-names": ",".join(names),
                "csi.cert-manager.io/key-usages": USAGES,
                "csi.cert-manager.io/duration": hours(POD_CERT_DAYS),
                "csi.cert-manager.io/renew-before": hours(RENEW_DAYS),
                "csi.cert-manager.io/ca-file": ca,
                "csi.cert-manager.io/certificate-file": cert,
                "csi.cert-manager.io/privatekey-file": key,
                "csi.cert-manager.io/fs-group": str(RUN_AS),
            },
        },
    }
    return volume, {"name": "tls", "mountPath": TLS_DIR, "readOnly": True}


def prometheus_tls() -> dict:
    """The ServiceMonitor's tlsConfig for the workers' HTTPS: Prometheus's own certificate, and theirs
    checked by the CA and MEMBER_NAME."""
    secret = {"name": PROMETHEUS_SECRET}
    return {
        "ca": {"secret": {**secret, "key": "ca.crt"}},
        "cert": {"secret": {**secret, "key": "tls.crt"}},
        "keySecret": {**secret, "key": "tls.key"},
        "serverName": MEMBER_NAME,
    }
