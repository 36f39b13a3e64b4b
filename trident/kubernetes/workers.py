"""The instances: for every kind (E, P, D, EP, ED, EPD, whatever the method deployed first), a
Deployment labelled with its roles, a headless Service for its metrics, a disruption budget and a
KEDA ScaledObject that sets its replicas from the planner's `trident_planner_desired_instances{kind}`.

Every kind is rendered so that the planner can move a running deployment to another method by the
counts it publishes alone (EP+D to E+P+D: ep to 0, e and p up), each from 0 to its maximum. The
Deployments carry no `spec.replicas`: KEDA owns the count, and an apply must not reset it. A missing
metric (the planner or Prometheus away) is an error to KEDA (`ignoreNullValues: false`), and the
fallback then keeps the replicas that run (`behavior: currentReplicas`, KEDA 2.17 or later).
"""

from __future__ import annotations

from common.roles import InstanceKind, in_path_order
from trident import gpu_deploy
from trident.kubernetes.flows import WORKER_HTTP, WORKER_TRANSFER, role_labels
from trident.kubernetes.objects import (
    disruption_budget,
    env,
    exec_probe,
    http_probe,
    labels,
    meta,
    port,
    service,
)
from trident.kubernetes.options import Options
from trident.kubernetes.pods import common_env, deployment, pod

DRAIN_TIMEOUT = 30  # seconds a worker finishes what it holds after SIGTERM (TRIDENT_DRAIN_TIMEOUT)
POLLING = 15  # seconds between KEDA's reads of the metric
FALLBACK_AFTER = 3  # failed reads before the fallback holds the count


def gpu_worker() -> dict:
    """What a worker on a GPU differs in (the GPU component patches exactly this): the settings the
    GPU check proved, from trident/gpu_deploy.py (device, memory share, GPUs per instance), and the
    toleration GPU nodes are tainted with. Transfers stay on TCP here (TRIDENT_TRANSFER, above):
    UCX listens on ports it picks, which no NetworkPolicy can name (flows.py)."""
    worker = {k: v for k, v in gpu_deploy.worker_env().items() if k != "TRIDENT_TRANSFER"}
    return {
        "env": worker,
        "resources": {"nvidia.com/gpu": str(gpu_deploy.GPUS_PER_INSTANCE)},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    }


def resources(o: Options) -> dict:
    requests = {"cpu": o.cpu, "memory": o.memory}
    limits = {"cpu": o.cpu, "memory": o.memory}
    if o.gpu:
        requests |= gpu_worker()["resources"]
        limits |= gpu_worker()["resources"]
    return {"requests": requests, "limits": limits}


def instance(o: Options, kind: InstanceKind) -> list[dict]:
    """An instance kind's Deployment, metrics Service, disruption budget and scaler."""
    name = f"trident-{kind.scale_name}"
    roles = [r.value for r in in_path_order(kind.roles)]
    select = labels("worker", **{"trident.dev/kind": kind.value})
    worker_env = env(
        TRIDENT_ROLES=",".join(roles),
        TRIDENT_HTTP_PORT=WORKER_HTTP.number,
        TRIDENT_TRANSFER=WORKER_TRANSFER.protocol.lower(),  # a port a policy can name (flows.py)
        TRIDENT_TRANSFER_PORT=WORKER_TRANSFER.number,
        TRIDENT_DRAIN_TIMEOUT=DRAIN_TIMEOUT,
    )
    if o.gpu:
        worker_env += env(**gpu_worker()["env"])
    container = {
        "name": "worker",
        "image": o.image,
        "command": ["python", "-m", "services.worker"],
        "env": common_env(o) + worker_env,
        "ports": [{"name": p.name, "containerPort": p.number} for p in (WORKER_HTTP, WORKER_TRANSFER)],
        **worker_probes(o.tls),
        # SIGTERM drains: stop pulling, finish what is held (up to the drain timeout), deregister.
        # The hook starts it and waits for the process to end, inside the grace period below.
        "lifecycle": {
            "preStop": {"exec": {"command": ["sh", "-c", "kill -TERM 1; while kill -0 1; do sleep 1; done"]}}
        },
        "resources": resources(o),
    }
    template = pod(o, select, container, grace=DRAIN_TIMEOUT + 30)
    template["metadata"]["labels"] = {
        **select,
        "trident.dev/roles": "-".join(roles),
        **role_labels(kind.roles),
    }
    if o.gpu:
        template["spec"]["tolerations"] = gpu_worker()["tolerations"]
    return [
        deployment(o, name, "worker", select, None, template),
        service(
            name,
            o.namespace,
            "worker",
            select,
            [port(WORKER_HTTP.name, WORKER_HTTP.number)],
            headless=True,
            metrics=True,
            metrics_tls=o.tls,
        ),
        disruption_budget(name, o.namespace, "worker", select, max_unavailable=1),
        scaler(o, kind, name),
    ]


def scaler(o: Options, kind: InstanceKind, name: str) -> dict:
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": meta(name, o.namespace, "worker", **{"trident.dev/kind": kind.value}),
        "spec": {
            "scaleTargetRef": {"name": name},
            "minReplicaCount": 0,  # a kind the planner's method does not run: none
            "maxReplicaCount": o.max_replicas,
            "pollingInterval": POLLING,
            "cooldownPeriod": 120,
            # Keep what runs while the metric cannot be read (`replicas` is the static fallback's
            # count, unused with this behavior).
            "fallback": {"failureThreshold": FALLBACK_AFTER, "replicas": 1, "behavior": "currentReplicas"},
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
                    "ignoreNullValues": "false",  # no series is an error, not 0
                },
            }],
        },
    }  # fmt: skip


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
