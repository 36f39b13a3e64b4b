"""What every Trident pod shares: its environment, its volumes (secrets, TLS, scratch, the model)
and its security settings, and the Deployment around it."""

from __future__ import annotations

from common.infra.settings import NATS
from trident.kubernetes.certificates import pod_tls
from trident.kubernetes.flows import NATS_CLIENT
from trident.kubernetes.models import MOUNT, init_container, volume
from trident.kubernetes.objects import (
    SECRET,
    TLS_DIR,
    container_security,
    env,
    field_env,
    meta,
    pod_security,
    spread,
)
from trident.kubernetes.options import Options
from trident.kubernetes.redis_ha import redis_url


def common_env(o: Options) -> list[dict]:
    values = env(
        TRIDENT_MODEL=f"{MOUNT}/{o.model}",
        TRIDENT_NATS_URL=f"nats://nats:{NATS_CLIENT.number}",
        TRIDENT_REDIS_URL=redis_url(o.namespace),
        TRIDENT_SECRETS_DIR="/secrets",
        TRIDENT_BIND_HOST="0.0.0.0",
        TRIDENT_NATS_STREAM_REPLICAS=NATS.stream_replicas,
        TRIDENT_TTFT_SLO=o.ttft_slo,
        TRIDENT_TBT_SLO=o.tbt_slo,
        HOME="/tmp",
        **({"TRIDENT_TLS_DIR": TLS_DIR} if o.tls else {}),
    )
    return [
        *values,
        field_env("TRIDENT_ADVERTISE_HOST", "status.podIP"),
    ]  # what peers dial: the pod's address


def mounts(o: Options, models: bool) -> tuple[list[dict], list[dict]]:
    """The secrets (read-only, the run-as group may read them), the TLS files, a writable /tmp on a
    read-only root filesystem and, for those that load the model, the models volume."""
    volume_mounts = [{"name": "secrets", "mountPath": "/secrets", "readOnly": True},
                     {"name": "tmp", "mountPath": "/tmp"}]  # fmt: skip
    volumes = [{"name": "secrets", "secret": {"secretName": SECRET, "defaultMode": 0o440}},
               {"name": "tmp", "emptyDir": {}}]  # fmt: skip
    if o.tls:
        tls_volume, mount = pod_tls()
        volumes.append(tls_volume)
        volume_mounts.append(mount)
    if models:
        volume_mounts.append({"name": "models", "mountPath": MOUNT, "readOnly": True})
        volumes.append(volume(o.source, o.models_claim))
    return volume_mounts, volumes


def pod(o: Options, select: dict, container: dict, grace: int, models: bool = True) -> dict:
    volume_mounts, volumes = mounts(o, models)
    container = {
        "imagePullPolicy": "IfNotPresent",  # the tag is exact (options.py): what a node has is it
        **container,
        "securityContext": container_security(),
        "volumeMounts": volume_mounts,
    }
    spec = {
        "automountServiceAccountToken": False,
        "securityContext": pod_security(),
        "terminationGracePeriodSeconds": grace,
        "topologySpreadConstraints": [spread(select)],
        **({"initContainers": [init_container(o.source, o.model, o.image)]} if models else {}),
        "containers": [container],
        "volumes": volumes,
    }
    return {"metadata": {"labels": select}, "spec": spec}


def deployment(
    o: Options, name: str, component: str, select: dict, replicas: int | None, template: dict
) -> dict:
    """`replicas` None: the count is another's to set (KEDA's), and an apply leaves it alone."""
    spec = {
        "selector": {"matchLabels": select},
        "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
        "template": template,
    }
    if replicas is not None:
        spec = {"replicas": replicas, **spec}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(
            name, o.namespace, component, **{k: v for k, v in select.items() if k.startswith("trident.")}
        ),
        "spec": spec,
    }
