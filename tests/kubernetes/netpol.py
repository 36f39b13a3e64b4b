"""What Kubernetes NetworkPolicies (networking.k8s.io/v1) let through, evaluated as the API defines it,
for tests: a connection from one pod (or outside address) to another on a port is allowed when the
source's egress and the destination's ingress both allow it.

- A pod is isolated in a direction when some policy of its namespace selects it (podSelector) and
  lists that direction in policyTypes (absent: Ingress, plus Egress when it has egress rules);
  an isolated pod takes a connection only if a rule of one of those policies matches it.
- A rule matches when one of its peers matches (no `from`/`to`: every peer) and one of its ports
  does (no `ports`: every port). A peer is a podSelector (pods of the policy's namespace), a
  namespaceSelector (every pod of the namespaces it selects), both (those pods of those
  namespaces), or an ipBlock (addresses in its CIDR but none of its exceptions).
- A port is a number, a range (endPort) or a name, which is looked up among the destination pod's
  container ports; the protocol defaults to TCP.
- Selectors: matchLabels and matchExpressions (In, NotIn, Exists, DoesNotExist); an empty one selects
  everything.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Endpoint:
    """A pod (its namespace, labels, address and named container ports), or an outside address."""

    name: str
    namespace: str | None  # None: outside the cluster
    labels: dict = field(default_factory=dict)
    ip: str = "10.0.0.1"
    ports: dict = field(default_factory=dict)  # container port name -> number


def matches(selector: dict | None, labels: dict) -> bool:
    if selector is None:
        return False
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": key not in labels or labels[key] not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


class Policies:
    def __init__(self, policies: list[dict], namespaces: dict[str, dict]) -> None:
        self.policies = policies
        self.namespaces = namespaces  # namespace -> its labels

    def allowed(self, src: Endpoint, dst: Endpoint, port: int, protocol: str = "TCP") -> bool:
        return self._side(src, dst, "Egress", port, protocol) and self._side(
            dst, src, "Ingress", port, protocol
        )

    def _side(self, pod: Endpoint, peer: Endpoint, direction: str, port: int, protocol: str) -> bool:
        if pod.namespace is None:
            return True  # outside the cluster: no policy applies to it
        applying = [p for p in self.policies if self._selects(p, pod) and direction in _types(p["spec"])]
        if not applying:
            return True
        target = pod if direction == "Ingress" else peer  # whose named ports a rule's ports mean
        for policy in applying:
            for rule in policy["spec"].get(direction.lower()) or []:
                peers = rule.get("from" if direction == "Ingress" else "to")
                if peers and not any(self._peer(policy, p, peer) for p in peers):
                    continue
                if _port(rule.get("ports"), target, port, protocol):
                    return True
        return False

    def _selects(self, policy: dict, pod: Endpoint) -> bool:
        return policy["metadata"]["namespace"] == pod.namespace and matches(
            policy["spec"]["podSelector"], pod.labels
        )

    def _peer(self, policy: dict, selector: dict, peer: Endpoint) -> bool:
        if "ipBlock" in selector:
            block, address = selector["ipBlock"], ipaddress.ip_address(peer.ip)
            inside = address in ipaddress.ip_network(block["cidr"])
            return inside and not any(address in ipaddress.ip_network(e) for e in block.get("except") or [])
        if peer.namespace is None:
            return False  # pod and namespace selectors name pods only
        if "namespaceSelector" in selector:
            if not matches(selector["namespaceSelector"], self.namespaces.get(peer.namespace, {})):
                return False
        elif peer.namespace != policy["metadata"]["namespace"]:
            return False
        return "podSelector" not in selector or matches(selector["podSelector"], peer.labels)


def _types(spec: dict) -> list[str]:
    return spec.get("policyTypes") or ["Ingress", *(["Egress"] if "egress" in spec else [])]


def _port(ports: list[dict] | None, target: Endpoint, port: int, protocol: str) -> bool:
    if not ports:
        return True
    for entry in ports:
        if entry.get("protocol", "TCP") != protocol:
            continue
        number = entry.get("port")
        if number is None:
            return True  # every port of that protocol
        if isinstance(number, str):
            number = target.ports.get(number)
            if number is None:
                continue
        if number <= port <= entry.get("endPort", number):
            return True
    return False
