"""What a rendered deployment is made of: `trident kubernetes`'s options, checked once."""

from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from common.planner.types import METHOD_KINDS
from trident.kubernetes.models import ModelSource


def release() -> str:
    try:
        return version("trident")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0.1.0"


def default_image(gpu: bool) -> str:
    """Trident's image, by the exact release it was built from (`docker build -t trident:0.1.0-cpu .`):
    a moving tag would run, after a restart, whatever it names that day."""
    return f"trident:{release()}-{'gpu' if gpu else 'cpu'}"


@dataclass(frozen=True)
class Options:
    method: str = "e+p+d"  # what runs first; the planner moves it (every kind is rendered)
    gpu: bool = False
    namespace: str = "trident"
    image: str = ""  # default: default_image(gpu)
    model: str = "tiny-llava"  # a checkpoint directory in the models volume
    model_source: str = "make:tiny-llava"  # models.py: make:PRESET | image:REF | hub:REPO
    models_claim: str = "trident-models"  # the claim a hub: checkpoint is written to
    models_size: str = "50Gi"
    cpu: str = "2"  # per instance (the GPU variant adds one GPU)
    memory: str = "8Gi"
    max_replicas: int = 8  # per kind
    budget: int = 16  # cores (GPUs with gpu) the planner may recommend in all
    prometheus: str = "http://prometheus-operated.monitoring.svc:9090"
    monitoring_namespace: str = "monitoring"
    # The label kube-prometheus-stack's Prometheus selects ServiceMonitors by: its Helm release.
    prometheus_release: str = "kube-prometheus-stack"
    storage: str = "10Gi"  # per NATS node (JetStream's store)
    ttft_slo: float = 2.0
    tbt_slo: float = 0.2
    # A request for a stage no live instance runs (scaled to 0, or starting) waits this long at the
    # gateway for one, at most max_held at once; KEDA's reaction, a pod's start and loading fit in it.
    hold_timeout: float = 240.0
    max_held: int = 512
    # Mutual TLS on every channel between Trident's pods (NATS, Redis, transfers, the workers' HTTP)
    # from cert-manager (certificates.py); the gateway's API stays HTTP for an ingress to terminate.
    tls: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHOD_KINDS:
            raise ValueError(f"unknown method {self.method!r}; one of {', '.join(METHOD_KINDS)}")
        if self.max_replicas < 1 or self.budget < 1:
            raise ValueError("max replicas and the budget must be at least 1")
        ModelSource.parse(self.model_source)
        if not self.image:
            object.__setattr__(self, "image", default_image(self.gpu))

    @property
    def source(self) -> ModelSource:
        return ModelSource.parse(self.model_source)
