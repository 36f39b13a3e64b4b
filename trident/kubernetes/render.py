"""Trident's Kubernetes manifests, written from the code that defines what they deploy.

`trident kubernetes` renders them (docs/running.md, "Kubernetes"), and `trident kubernetes
--kustomize deploy/kubernetes` writes the committed base and overlays from the same objects
(kustomize.py). Per instance kind, every kind (workers.py): a Deployment, a metrics Service, a
disruption budget and a KEDA ScaledObject that follows the planner. Besides: the gateway (the only
Service reachable from outside), the planner and its what-if jobs worker, NATS and Redis
(substrate.py, redis_ha.py), the NetworkPolicies drawn from the flows (flows.py, network.py),
cert-manager's CA and certificates (certificates.py), what fills the model volume (models.py),
ServiceMonitors and the Grafana dashboard.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from common.planner.types import METHOD_KINDS
from common.roles import InstanceKind
from common.secrets import NAMES, new_secret
from trident.kubernetes.certificates import issuers, prometheus_tls
from trident.kubernetes.flows import GATEWAY_HTTP, GATEWAY_TRANSFER, PLANNER_HTTP, flows
from trident.kubernetes.models import hub_objects
from trident.kubernetes.network import network_policies
from trident.kubernetes.objects import SECRET, disruption_budget, env, http_probe, labels, meta, port, service
from trident.kubernetes.options import Options
from trident.kubernetes.pods import common_env, deployment, pod
from trident.kubernetes.substrate import nats, redis
from trident.kubernetes.workers import DRAIN_TIMEOUT, gpu_worker, instance

__all__ = ["DRAIN_TIMEOUT", "Options", "render", "secret", "to_yaml"]

# The what-if jobs worker answers a ping over its broker once it consumes jobs.
PING = "python -m celery --app=services.planner.jobs inspect ping --timeout=5 -d celery@$HOSTNAME"
DASHBOARD = Path(__file__).resolve().parents[2] / "monitoring" / "grafana" / "dashboards" / "trident.json"


def render(o: Options) -> list[dict]:
    """Every object of a deployment, in the order `kubectl apply` should create them."""
    objects = [namespace(o)]
    if o.tls:
        objects += issuers(o.namespace)
    objects += hub_objects(o.source, o.model, o.image, o.namespace, o.models_claim, o.models_size)
    objects += [*nats(o.namespace, o.storage, o.tls), *redis(o.namespace, tls=o.tls)]
    objects += gateway(o) + planner(o)
    for kind in InstanceKind:
        objects += instance(o, kind)
    objects += network_policies(o.namespace, flows(o.monitoring_namespace, hub=o.source.shared))
    objects += [*service_monitors(o), dashboard(o)]
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


def namespace(o: Options) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": o.namespace, "labels": labels("namespace")},
    }


def gateway(o: Options) -> list[dict]:
    select = labels("gateway")
    container = {
        "name": "gateway",
        "image": o.image,
        "command": ["python", "-m", "services.gateway"],
        "env": common_env(o) + env(
            TRIDENT_PORT=GATEWAY_HTTP.number, TRIDENT_HTTP_PORT=GATEWAY_HTTP.number,
            TRIDENT_TRANSFER_PORT=GATEWAY_TRANSFER.number,  # pixels, pulled by encoders (flows.py)
            TRIDENT_HOLD_TIMEOUT=o.hold_timeout, TRIDENT_MAX_HELD=o.max_held,
        )
        + [{"name": "TRIDENT_API_KEYS",
            "valueFrom": {"secretKeyRef": {"name": "trident-api-keys", "key": "keys", "optional": True}}}],
        "ports": [{"name": p.name, "containerPort": p.number} for p in (GATEWAY_HTTP, GATEWAY_TRANSFER)],
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
        service(
            "trident-gateway",
            o.namespace,
            "gateway",
            select,
            [port("http", GATEWAY_HTTP.number)],
            metrics=True,
        ),
        disruption_budget("trident-gateway", o.namespace, "gateway", select, min_available=1),
    ]


def planner_env(o: Options) -> list[dict]:
    """The planner's limits in the deployment's unit (cores, or GPUs), every kind's maximum, and the
    method it starts from (TRIDENT_PLANNER_START: published until its first sizing)."""
    unit = "gpus" if o.gpu else "cores"
    cost = gpu_worker()["resources"]["nvidia.com/gpu"] if o.gpu else o.cpu
    return env(
        TRIDENT_HTTP_PORT=PLANNER_HTTP.number,
        TRIDENT_PLANNER_BUDGET=o.budget,
        TRIDENT_PLANNER_BUDGET_UNIT=unit,
        TRIDENT_PLANNER_INSTANCE_COST=cost,
        TRIDENT_PLANNER_MAX_REPLICAS=",".join(f"{k.value}={o.max_replicas}" for k in InstanceKind),
        TRIDENT_PLANNER_START=",".join(f"{k.value}=1" for k in METHOD_KINDS[o.method]),
        TRIDENT_PLANNER_ACTUATOR="advisory",  # KEDA acts on trident_planner_desired_instances
    )


def planner(o: Options) -> list[dict]:
    select = labels("planner")
    container = {
        "name": "planner",
        "image": o.image,
        "command": ["python", "-m", "services.planner"],
        "env": common_env(o) + planner_env(o),
        "ports": [{"name": "http", "containerPort": PLANNER_HTTP.number}],
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
        service(
            "trident-planner",
            o.namespace,
            "planner",
            select,
            [port("http", PLANNER_HTTP.number)],
            metrics=True,
        ),
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


def service_monitors(o: Options) -> list[dict]:
    """The gateway's and planner's metrics over HTTP; with TLS, the workers' over HTTPS by a monitor
    that shows Prometheus's own certificate (and checks theirs by the CA and a fixed name). Labelled
    `release` as kube-prometheus-stack's Prometheus selects monitors by default."""

    def monitor(name: str, label: str, endpoint: dict) -> dict:
        return {
            "apiVersion": "monitoring.coreos.com/v1",
            "kind": "ServiceMonitor",
            "metadata": meta(name, o.namespace, "monitoring", release=o.prometheus_release),
            "spec": {
                "selector": {"matchLabels": {"trident.dev/metrics": label}},
                "namespaceSelector": {"matchNames": [o.namespace]},
                "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s", **endpoint}],
            },
        }

    monitors = [monitor("trident", "true", {})]
    if o.tls:
        monitors.append(monitor("trident-workers", "tls", {"scheme": "https", "tlsConfig": prometheus_tls()}))
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
