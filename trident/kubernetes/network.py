"""The NetworkPolicies, rendered from the flows (flows.py): nothing in or out of a Trident pod unless a
flow names it. One policy denies everything; then, per component, one admits what dials it and one
lets it dial what it needs, port by port."""

from __future__ import annotations

from trident.kubernetes.flows import ANYONE, Flow, Peer, Port
from trident.kubernetes.objects import meta


def network_policies(namespace: str, flows: list[Flow]) -> list[dict]:
    deny = policy("default-deny", namespace, {}, ["Ingress", "Egress"], {})
    ingress: dict[str, tuple[Peer, dict[str, tuple[Peer, list]]]] = {}
    egress: dict[str, tuple[Peer, dict[str, tuple[Peer, list]]]] = {}
    for f in flows:
        if f.target.ours:
            _add(ingress, f.target, f.source, f.port)
        if f.source.ours:
            _add(egress, f.source, f.target, f.port)
    out = [deny]
    for name, (pods, peers) in ingress.items():
        rules = [_rule("from", peer, ports) for peer, ports in peers.values()]
        out.append(policy(f"{name}-ingress", namespace, pods.pods, ["Ingress"], {"ingress": rules}))
    for name, (pods, peers) in egress.items():
        rules = [_rule("to", peer, ports) for peer, ports in peers.values()]
        out.append(policy(f"{name}-egress", namespace, pods.pods, ["Egress"], {"egress": rules}))
    return out


def _add(table: dict, pods: Peer, peer: Peer, port: Port) -> None:
    _, peers = table.setdefault(pods.name, (pods, {}))
    _, ports = peers.setdefault(peer.name, (peer, []))
    if port not in ports:
        ports.append(port)


def _rule(direction: str, peer: Peer, ports: list[Port]) -> dict:
    listed = [{"port": p.number, "protocol": p.protocol} for p in ports]
    if peer is ANYONE:
        return {"ports": listed}  # no `from`: every source, in the cluster or not
    return {direction: [peer.selector()], "ports": listed}


def policy(name: str, namespace: str, pods: dict, types: list[str], rules: dict) -> dict:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": meta(name, namespace, "network"),
        "spec": {"podSelector": {"matchLabels": pods} if pods else {}, "policyTypes": types, **rules},
    }
