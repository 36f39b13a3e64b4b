"""`trident kubernetes`: write a deployment's Kubernetes manifests (trident/kubernetes/render.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from common.planner.types import METHOD_KINDS


def kubernetes(
    method: Annotated[str, typer.Option(help=f"The method to deploy: {', '.join(METHOD_KINDS)}.")] = "e+p+d",
    gpu: Annotated[
        bool, typer.Option("--gpu", help="One NVIDIA GPU per instance (the trident:gpu image).")
    ] = False,
    namespace: Annotated[
        str, typer.Option(help="Namespace of every object (created by the manifests).")
    ] = "trident",
    image: Annotated[
        str | None,
        typer.Option(
            help="Trident's image; default trident:<version>-cpu, or trident:<version>-gpu with --gpu."
        ),
    ] = None,
    model: Annotated[str, typer.Option(help="Checkpoint directory inside the models volume.")] = "tiny-llava",
    model_source: Annotated[
        str,
        typer.Option(
            help="What fills the models volume: make:PRESET (the tiny random-weight checkpoint, written in "
            "each pod), image:REF (copied from /model of an image of yours), hub:REPO (downloaded once by a "
            "Job into --models-claim)."
        ),
    ] = "make:tiny-llava",
    models_claim: Annotated[
        str, typer.Option(help="PersistentVolumeClaim (ReadWriteMany) a hub: checkpoint is written to.")
    ] = "trident-models",
    cpu: Annotated[str, typer.Option(help="CPU request and limit of each instance.")] = "2",
    memory: Annotated[str, typer.Option(help="Memory request and limit of each instance.")] = "8Gi",
    max_replicas: Annotated[int, typer.Option(min=1, help="Most replicas of each instance kind.")] = 8,
    budget: Annotated[
        int, typer.Option(min=1, help="Cores (GPUs with --gpu) the planner may recommend for all instances.")
    ] = 16,
    prometheus: Annotated[
        str, typer.Option(help="Prometheus that KEDA asks for the planner's desired instances.")
    ] = "http://prometheus-operated.monitoring.svc:9090",
    monitoring_namespace: Annotated[
        str, typer.Option(help="Namespace Prometheus scrapes from.")
    ] = "monitoring",
    prometheus_release: Annotated[
        str,
        typer.Option(
            help="The `release` label on the ServiceMonitors (kube-prometheus-stack's Helm release)."
        ),
    ] = "kube-prometheus-stack",
    tls: Annotated[
        bool,
        typer.Option(
            "--tls/--no-tls",
            help="Mutual TLS between Trident's pods (NATS, Redis, transfers, the workers' HTTP): a key and "
            "certificate per pod from cert-manager's csi-driver, signed by the deployment's own CA.",
        ),
    ] = True,
    secrets: Annotated[
        bool,
        typer.Option(
            "--secrets",
            help="Add the Secret trident-secrets with fresh random values (keep the output private).",
        ),
    ] = False,
    out: Annotated[
        Path | None, typer.Option(help="Write DIR/trident.yaml and DIR/kustomization.yaml instead of stdout.")
    ] = None,
    kustomize: Annotated[
        Path | None,
        typer.Option(
            help="Write the kustomize tree (base, components/gpu, an overlay per method, on CPUs and GPUs) "
            "under DIR, as committed in deploy/kubernetes; the other options are not used.",
        ),
    ] = None,
) -> None:
    """Render the Kubernetes manifests of a deployment: for every instance kind a Deployment, Service,
    PodDisruptionBudget and KEDA ScaledObject; the gateway, planner, NATS cluster and Redis;
    NetworkPolicies, cert-manager's CA, ServiceMonitors and the Grafana dashboard (docs/running.md,
    "Kubernetes")."""
    from trident.kubernetes.render import Options, render, secret, to_yaml

    if kustomize is not None:
        from trident.kubernetes.kustomize import write

        written = write(kustomize)
        typer.echo(f"wrote {len(written)} files under {kustomize}")
        return
    try:
        options = Options(
            method=method, gpu=gpu, namespace=namespace, image=image or "", model=model,
            model_source=model_source, models_claim=models_claim, cpu=cpu, memory=memory,
            max_replicas=max_replicas, budget=budget, prometheus=prometheus,
            monitoring_namespace=monitoring_namespace, prometheus_release=prometheus_release, tls=tls,
        )  # fmt: skip
        objects = render(options)
    except (ValueError, OSError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if secrets:
        objects[1:1] = [secret(namespace)]
    text = to_yaml(objects)
    flags = f"--method {method}{' --gpu' if gpu else ''}{'' if tls else ' --no-tls'}"
    header = f"# trident kubernetes {flags}: generated, edit the options instead\n"
    if out is None:
        typer.echo(header + text, nl=False)
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "trident.yaml").write_text(header + text)
    (out / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - trident.yaml\n"
    )
    typer.echo(f"wrote {out / 'trident.yaml'} ({len(objects)} objects) and {out / 'kustomization.yaml'}")
