"""Small builders for the Kubernetes objects Trident's manifests are made of (plain dicts, as
`kubectl apply` reads them once written as YAML)."""

from __future__ import annotations

PART_OF = "trident"
RUN_AS = 10001  # the image's `trident` user (Dockerfile)
SECRET = "trident-secrets"  # the deployment's Secret: NATS token, Redis password, transfer secret
TLS_DIR = "/tls"  # where every pod finds its key, certificate and the CA (TRIDENT_TLS_DIR)


def labels(component: str, **extra: str) -> dict[str, str]:
    return {"app.kubernetes.io/part-of": PART_OF, "app.kubernetes.io/component": component, **extra}


def meta(name: str, namespace: str, component: str, **extra: str) -> dict:
    return {"name": name, "namespace": namespace, "labels": labels(component, **extra)}


def pod_security(user: int = RUN_AS) -> dict:
    """Non-root, with a group that may read the mounted Secret and write the mounted volumes."""
    return {
        "runAsNonRoot": True,
        "runAsUser": user,
        "runAsGroup": user,
        "fsGroup": user,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security() -> dict:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
    }


def http_probe(path: str, port: str, period: int, failures: int, timeout: int = 3) -> dict:
    return {
        "httpGet": {"path": path, "port": port},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def exec_probe(command: list[str], period: int, failures: int, timeout: int = 3) -> dict:
    return {
        "exec": {"command": command},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def env(**values: str) -> list[dict]:
    return [{"name": k, "value": str(v)} for k, v in values.items()]


def secret_env(name: str, secret: str, key: str) -> dict:
    return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}}


def field_env(name: str, path: str) -> dict:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def service(name: str, namespace: str, component: str, selector: dict, ports: list[dict], *,
            headless: bool = False, metrics: bool = False, metrics_tls: bool = False) -> dict:  # fmt: skip
    """`metrics`: scraped by the ServiceMonitor; `metrics_tls`: by the one that shows the deployment's
    certificate (a worker's HTTP with TLS on)."""
    extra = {"trident.dev/metrics": "tls" if metrics_tls else "true"} if metrics else {}
    spec: dict = {"selector": selector, "ports": ports}
    if headless:
        spec |= {"clusterIP": "None", "publishNotReadyAddresses": True}
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": meta(name, namespace, component, **extra),
        "spec": spec,
    }


def port(name: str, number: int) -> dict:
    return {"name": name, "port": number, "targetPort": number, "protocol": "TCP"}


def disruption_budget(
    name: str, namespace: str, component: str, selector: dict, *,
    max_unavailable: int | None = None, min_available: int | None = None,
) -> dict:  # fmt: skip
    spec: dict = {"selector": {"matchLabels": selector}}
    if max_unavailable is not None:
        spec["maxUnavailable"] = max_unavailable
    if min_available is not None:
        spec["minAvailable"] = min_available
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": meta(name, namespace, component),
        "spec": spec,
    }


def stateful_set(
    name: str, namespace: str, service_name: str, replicas: int, container: dict, storage: str | None, *,
    parallel: bool = False, **pod: object,
) -> dict:  # fmt: skip
    """A server's StatefulSet: non-root, no service-account token, its `data` on a volume of its own
    per replica of `storage` (None: none; `pod` then names a `data` volume); `pod` adds to the
    pod's spec; `parallel` starts the replicas all at once."""
    select = labels(name)
    spec = {
        "serviceName": service_name,
        "replicas": replicas,
        "selector": {"matchLabels": select},
        "template": {
            "metadata": {"labels": select},
            "spec": {
                "automountServiceAccountToken": False,
                "securityContext": pod_security(),
                "containers": [container],
                **pod,
            },
        },
    }
    if storage is not None:
        spec["volumeClaimTemplates"] = [claim("data", storage, name)]
    if parallel:
        spec["podManagementPolicy"] = "Parallel"
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta(name, namespace, name),
        "spec": spec,
    }


def claim(name: str, size: str, component: str) -> dict:
    return {
        "metadata": {"name": name, "labels": labels(component)},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}},
    }


def apart(select: dict) -> dict:
    """Never two of these pods on one node: losing a node loses one NATS node or one Redis server, and
    a cluster that cannot place them says so (Pending) rather than put two on one node."""
    return {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": select}, "topologyKey": "kubernetes.io/hostname"}
            ]
        }
    }


def spread(select: dict) -> dict:
    """One of each per node where the nodes allow: losing a node loses one NATS node, not two."""
    return {
        "maxSkew": 1,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": select},
    }
