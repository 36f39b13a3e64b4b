"""Trident's Kubernetes manifests, written from the code that defines what they deploy.

`trident kubernetes --method ep+d [--gpu]` renders them (docs/running.md, "Kubernetes"). They are
generated rather than kept as a kustomize base with overlays because what differs between methods
is not a patch: the instance kinds, their roles, replica bounds and KEDA scalers all come from
`METHOD_KINDS` and the roles, the environment from the settings, and the drain grace from the
worker's drain timeout. Written by one function from those, they cannot drift from the services;
tests render every method, with and without GPUs, and validate the result.

Per instance kind of the method: a Deployment (labelled with its roles), a headless Service for its
metrics, a PodDisruptionBudget and a KEDA ScaledObject that sets its replicas from the planner's
`trident_planner_desired_instances{kind}` — the only thing that scales it. Besides: the gateway (the
only Service reachable from outside the namespace), the planner and its what-if jobs worker, NATS
and Redis (substrate.py), NetworkPolicies, a ServiceMonitor and the Grafana dashboard.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from common.certs import MEMBER_NAME, issue
from common.planner.types import METHOD_KINDS
from common.roles import InstanceKind, in_path_order
from common.secrets import NAMES, new_secret
from common.tls import FILES as TLS_FILES
from trident import gpu_deploy
from trident.kubernetes.objects import (
    SECRET,
    TLS_DIR,
    TLS_SECRET,
    container_security,
    disruption_budget,
    env,
    exec_probe,
    field_env,
    from_trident,
    http_probe,
    labels,
    meta,
    network_policy,
    pod_security,
    port,
    service,
    spread,
    tcp,
    tls_volume,
)
from trident.kubernetes.redis_ha import redis_url
from trident.kubernetes.substrate import nats, redis

# The what-if jobs worker answers a ping over its broker once it consumes jobs.
PING = "python -m celery --app=services.planner.jobs inspect ping --timeout=5 -d celery@$HOSTNAME"
DRAIN_TIMEOUT = 30  # seconds a worker finishes what it holds after SIGTERM (TRIDENT_DRAIN_TIMEOUT)
DASHBOARD = Path(__file__).resolve().parents[2] / "monitoring" / "grafana" / "dashboards" / "trident.json"


@dataclass(frozen=True)
class Options:
    method: str = "e+p+d"
    gpu: bool = False
    namespace: str = "trident"
    image: str = "trident:cpu"
    model: str = "tiny-llava"  # a checkpoint directory in the models volume
    models_claim: str = "trident-models"  # a PersistentVolumeClaim holding /models (ReadOnlyMany)
    cpu: str = "2"  # per instance (the GPU overlay adds one GPU)
    memory: str = "8Gi"
    max_replicas: int = 8  # per kind
    budget: int = 16  # cores (GPUs with gpu) the planner may recommend in all
    prometheus: str = "http://prometheus-operated.monitoring.svc:9090"
    monitoring_namespace: str = "monitoring"
    storage: str = "10Gi"
    ttft_slo: float = 2.0
    tbt_slo: float = 0.2
    # Mutual TLS on every channel between Trident's pods (NATS, Redis, transfers, the workers' HTTP)
    # from the Secret trident-tls; the gateway's API stays HTTP for an ingress to terminate.
    tls: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHOD_KINDS:
            raise ValueError(f"unknown method {self.method!r}; one of {', '.join(METHOD_KINDS)}")
        if self.max_replicas < 1 or self.budget < 1:
            raise ValueError("max replicas and the budget must be at least 1")


def render(o: Options) -> list[dict]:
    """Every object of a deployment, in the order `kubectl apply` should create them."""
    objects = [namespace(o), *nats(o.namespace, o.storage, o.tls), *redis(o.namespace, o.storage, tls=o.tls)]
    objects += gateway(o) + planner(o)
    for kind in METHOD_KINDS[o.method]:
        objects += instance(o, InstanceKind(kind))
    objects += [*policies(o), *service_monitors(o), dashboard(o)]
    return objects


def secret(namespace: str) -> dict:
    """The deployment's secrets, fresh: NATS token, Redis password, transfer secret, planner key."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta(SECRET, namespace, "secrets"),
        "type": "Opaque",
        "stringData": {name: new_secret() for name in NAMES},
    }


def cluster_names(namespace: str) -> list[str]:
    """The names peers dial inside the cluster, for the certificate: NATS routes check the name they
    dial (Trident's own processes check only the CA's signature)."""
    return [
        "nats", f"nats.{namespace}.svc", f"*.nats-cluster.{namespace}.svc", f"*.redis.{namespace}.svc",
        f"*.redis-sentinel.{namespace}.svc",
    ]  # fmt: skip


def tls_secret(namespace: str) -> dict:
    """A fresh CA and the certificate every pod shows (common/certs.py; the CA's key is not kept)."""
    with tempfile.TemporaryDirectory() as folder:
        issue(folder, cluster_names(namespace))
        files = {name: (Path(folder) / name).read_text() for name in TLS_FILES}
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": meta(TLS_SECRET, namespace, "secrets"),
        "type": "Opaque",
        "stringData": files,
    }


def namespace(o: Options) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": o.namespace, "labels": labels("namespace")},
    }


def common_env(o: Options) -> list[dict]:
    values = env(
        TRIDENT_MODEL=f"/models/{o.model}",
        TRIDENT_NATS_URL="nats://nats:4222",
        TRIDENT_REDIS_URL=redis_url(o.namespace),
        TRIDENT_SECRETS_DIR="/secrets",
        TRIDENT_BIND_HOST="0.0.0.0",
        TRIDENT_NATS_STREAM_REPLICAS="3",
        TRIDENT_TTFT_SLO=o.ttft_slo,
        TRIDENT_TBT_SLO=o.tbt_slo,
        HOME="/tmp",
        **({"TRIDENT_TLS_DIR": TLS_DIR} if o.tls else {}),
    )
    return [
        *values,
        field_env("TRIDENT_ADVERTISE_HOST", "status.podIP"),
    ]  # what peers dial: the pod's address


def mounts(models_claim: str | None, tls: bool) -> tuple[list[dict], list[dict]]:
    """The secrets (read-only, the run-as group may read them), the TLS files, a writable /tmp on a
    read-only root filesystem and, for those that load the model, the models volume (`models_claim`)."""
    volume_mounts = [{"name": "secrets", "mountPath": "/secrets", "readOnly": True},
                     {"name": "tmp", "mountPath": "/tmp"}]  # fmt: skip
    volumes = [{"name": "secrets", "secret": {"secretName": SECRET, "defaultMode": 0o440}},
               {"name": "tmp", "emptyDir": {}}]  # fmt: skip
    if tls:
        volume, mount = tls_volume()
        volumes.append(volume)
        volume_mounts.append(mount)
    if models_claim is not None:
        volume_mounts.append({"name": "models", "mountPath": "/models", "readOnly": True})
        volumes.append(
            {"name": "models", "persistentVolumeClaim": {"claimName": models_claim, "readOnly": True}}
        )
    return volume_mounts, volumes


def pod(o: Options, select: dict, container: dict, grace: int, models: bool = True) -> dict:
    volume_mounts, volumes = mounts(o.models_claim if models else None, o.tls)
    container = {
        "imagePullPolicy": "Always",  # tags move: a restarted pod runs what the tag names now
        **container,
        "securityContext": container_security(),
        "volumeMounts": volume_mounts,
    }
    spec = {
        "automountServiceAccountToken": False,
        "securityContext": pod_security(),
        "terminationGracePeriodSeconds": grace,
        "topologySpreadConstraints": [spread(select)],
        "containers": [container],
        "volumes": volumes,
    }
    return {"metadata": {"labels": select}, "spec": spec}


def deployment(o: Options, name: str, component: str, select: dict, replicas: int, template: dict) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": meta(
            name, o.namespace, component, **{k: v for k, v in select.items() if k.startswith("trident.")}
        ),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": select},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
            "template": template,
        },
    }


def resources(o: Options, gpu: bool) -> dict:
    requests = {"cpu": o.cpu, "memory": o.memory}
    limits = {"cpu": o.cpu, "memory": o.memory}
    if gpu:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(gpu_deploy.GPUS_PER_INSTANCE)
    return {"requests": requests, "limits": limits}


def instance(o: Options, kind: InstanceKind) -> list[dict]:
    """An instance kind's Deployment, metrics Service, disruption budget and scaler."""
    name = f"trident-{kind.scale_name}"
    roles = [r.value for r in in_path_order(kind.roles)]
    select = labels("worker", **{"trident.dev/kind": kind.value})
    worker_env = env(
        TRIDENT_ROLES=",".join(roles), TRIDENT_HTTP_PORT="9000", TRIDENT_DRAIN_TIMEOUT=DRAIN_TIMEOUT
    )
    if o.gpu:  # what bench/gpu_serve.py runs on a GPU (trident/gpu_deploy.py)
        worker_env += env(**gpu_deploy.worker_env())
    container = {
        "name": "worker",
        "image": o.image,
        "command": ["python", "-m", "services.worker"],
        "env": common_env(o) + worker_env,
        "ports": [{"name": "http", "containerPort": 9000}],
        **worker_probes(o.tls),
        # SIGTERM drains: stop pulling, finish what is held (up to the drain timeout), deregister.
        # The hook starts it and waits for the process to end, inside the grace period below.
        "lifecycle": {
            "preStop": {"exec": {"command": ["sh", "-c", "kill -TERM 1; while kill -0 1; do sleep 1; done"]}}
        },
        "resources": resources(o, o.gpu),
    }
    template = pod(o, select, container, grace=DRAIN_TIMEOUT + 30)
    template["metadata"]["labels"] = {**select, "trident.dev/roles": "-".join(roles)}
    if o.gpu:
        template["spec"]["tolerations"] = [
            {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        ]
    scaler = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": meta(name, o.namespace, "worker", **{"trident.dev/kind": kind.value}),
        "spec": {
            "scaleTargetRef": {"name": name},
            "minReplicaCount": 1,
            "maxReplicaCount": o.max_replicas,
            "pollingInterval": 15,
            "cooldownPeriod": 120,
            "advanced": {
                "horizontalPodAutoscalerConfig": {
                    "behavior": {"scaleDown": {"stabilizationWindowSeconds": 120}}
                }
            },
            "triggers": [{
                "type": "prometheus",
                "metricType": "AverageValue",  # replicas = ceil(desired / 1): the planner's count
                "metadata": {
                    "serverAddress": o.prometheus,
                    "query": f'max(trident_planner_desired_instances{{kind="{kind.value}"}})',
                    "threshold": "1",
                },
            }],
        },
    }  # fmt: skip
    return [
        deployment(o, name, "worker", select, 1, template),
        service(
            name,
            o.namespace,
            "worker",
            select,
            [port("http", 9000)],
            headless=True,
            metrics=True,
            metrics_tls=o.tls,
        ),
        disruption_budget(name, o.namespace, "worker", select, max_unavailable=1),
        scaler,
    ]


def worker_probes(tls: bool) -> dict:
    """Readiness, liveness and start-up (loading and profiling: up to 10 min). With TLS the worker's
    HTTP answers only the deployment's certificate, which the kubelet's httpGet cannot show: the
    probes are a command in the container that does (services/worker/probe.py)."""
    if not tls:
        return {
            "readinessProbe": http_probe("/ready", "http", 5, 2),
            "livenessProbe": http_probe("/health", "http", 10, 3),
            "startupProbe": http_probe("/health", "http", 5, 120),
        }
    probe = ["python", "-m", "services.worker.probe"]
    return {
        "readinessProbe": exec_probe([*probe, "/ready"], 5, 2),
        "livenessProbe": exec_probe([*probe, "/health"], 10, 3),
        "startupProbe": exec_probe([*probe, "/health"], 5, 120),
    }


def gateway(o: Options) -> list[dict]:
    select = labels("gateway")
    container = {
        "name": "gateway",
        "image": o.image,
        "command": ["python", "-m", "services.gateway"],
        "env": common_env(o) + env(TRIDENT_PORT="8000", TRIDENT_HTTP_PORT="8000")
        + [{"name": "TRIDENT_API_KEYS",
            "valueFrom": {"secretKeyRef": {"name": "trident-api-keys", "key": "keys", "optional": True}}}],
        "ports": [{"name": "http", "containerPort": 8000}],
        "readinessProbe": http_probe("/ready", "http", 5, 2),
        "livenessProbe": http_probe("/health", "http", 10, 3),
        "startupProbe": http_probe("/health", "http", 2, 60),
        # Out of the Service's endpoints before it stops taking requests; SIGTERM then lets the
        # streams in flight finish.
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", "5"]}}},
        "resources": {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "2", "memory": "2Gi"}},
    }  # fmt: skip
    return [
        deployment(o, "trident-gateway", "gateway", select, 2, pod(o, select, container, grace=45)),
        service("trident-gateway", o.namespace, "gateway", select, [port("http", 8000)], metrics=True),
        disruption_budget("trident-gateway", o.namespace, "gateway", select, min_available=1),
    ]


def planner(o: Options) -> list[dict]:
    select = labels("planner")
    unit = "gpus" if o.gpu else "cores"
    cost = 1 if o.gpu else o.cpu
    container = {
        "name": "planner",
        "image": o.image,
        "command": ["python", "-m", "services.planner"],
        "env": common_env(o)
        + env(
            TRIDENT_HTTP_PORT="8100",
            TRIDENT_PLANNER_BUDGET=o.budget,
            TRIDENT_PLANNER_BUDGET_UNIT=unit,
            TRIDENT_PLANNER_INSTANCE_COST=cost,
            TRIDENT_PLANNER_MAX_REPLICAS=",".join(f"{k}={o.max_replicas}" for k in METHOD_KINDS[o.method]),
            TRIDENT_PLANNER_ACTUATOR="advisory",  # KEDA acts on trident_planner_desired_instances
        ),
        "ports": [{"name": "http", "containerPort": 8100}],
        "readinessProbe": http_probe("/ready", "http", 5, 3),
        "livenessProbe": http_probe("/health", "http", 10, 3),
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "2Gi"}},
    }
    jobs_select = labels("planner-jobs")
    jobs = {
        "name": "planner-jobs",
        "image": o.image,
        "command": ["python", "-m", "celery", "--app=services.planner.jobs", "worker", "--pool=solo",
                    "--concurrency=1"],
        "env": common_env(o),
        "readinessProbe": {"exec": {"command": ["sh", "-c", PING]},
                           "periodSeconds": 30, "timeoutSeconds": 20},
        "livenessProbe": {"exec": {"command": ["sh", "-c", PING]},
                          "periodSeconds": 60, "timeoutSeconds": 20, "failureThreshold": 3},
        "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"cpu": "2", "memory": "2Gi"}},
    }  # fmt: skip
    return [
        deployment(
            o, "trident-planner", "planner", select, 1, pod(o, select, container, grace=10, models=False)
        ),
        service("trident-planner", o.namespace, "planner", select, [port("http", 8100)], metrics=True),
        disruption_budget("trident-planner", o.namespace, "planner", select, max_unavailable=1),
        deployment(
            o,
            "trident-planner-jobs",
            "planner-jobs",
            jobs_select,
            1,
            pod(o, jobs_select, jobs, grace=30, models=False),
        ),
        disruption_budget(
            "trident-planner-jobs", o.namespace, "planner-jobs", jobs_select, max_unavailable=1
        ),
    ]


def policies(o: Options) -> list[dict]:
    """Nothing reaches a pod in the namespace unless a policy lets it: the gateway from anywhere;
    Trident's own pods from each other (transfers listen on ports chosen at start); metrics from
    the monitoring namespace. NATS and Redis: substrate.py."""
    monitoring = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": o.monitoring_namespace}}
    }
    return [
        network_policy("default-deny", o.namespace, {}, []),
        network_policy("trident-gateway", o.namespace, labels("gateway"), [{"ports": [tcp(8000)]}]),
        *[
            network_policy(f"trident-{component}", o.namespace, labels(component), [
                {"from": [from_trident()]},
                {"from": [monitoring], "ports": [tcp(metrics)]},
            ])
            for component, metrics in (("worker", 9000), ("planner", 8100))
        ],
        network_policy("trident-planner-jobs", o.namespace, labels("planner-jobs"), []),
    ]  # fmt: skip


def service_monitors(o: Options) -> list[dict]:
    """The gateway's and planner's metrics over HTTP; with TLS, the workers' over HTTPS by a
    monitor that shows the deployment's certificate (and checks theirs by the CA and a fixed name)."""

    def monitor(name: str, label: str, endpoint: dict) -> dict:
        return {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "ServiceMonitor",
            "metadata": meta(name, o.namespace, "monitoring"),
            "spec": {
                "selector": {"matchLabels": {"trident.dev/metrics": label}},
                "namespaceSelector": {"matchNames": [o.namespace]},
                "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s", **endpoint}],
            },
        }

    monitors = [monitor("trident", "true", {})]
    if o.tls:
        key = {"name": TLS_SECRET}
        tls_config = {
            "ca": {"secret": {**key, "key": "ca.pem"}},
            "cert": {"secret": {**key, "key": "cert.pem"}},
            "keySecret": {**key, "key": "key.pem"},
            "serverName": MEMBER_NAME,
        }
        monitors.append(monitor("trident-workers", "tls", {"scheme": "https", "tlsConfig": tls_config}))
    return monitors


def dashboard(o: Options) -> dict:
    """The Grafana dashboard of monitoring/, for a Grafana that loads ConfigMaps labelled so."""
    text = json.dumps(json.loads(DASHBOARD.read_text()), indent=1, sort_keys=True)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": meta("trident-dashboard", o.namespace, "monitoring", grafana_dashboard="1"),
        "data": {"trident.json": text},
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the NATS config, the dashboard) as literal blocks, as a person writes them;
    a selector used twice written out twice, not as a YAML alias."""

    def ignore_aliases(self, data: object) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text)


def to_yaml(objects: list[dict]) -> str:
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=120)
