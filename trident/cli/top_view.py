"""`trident top`: a live terminal view of a running deployment, read from its gateway alone, so it
works wherever the gateway answers (under Docker Compose the workers publish no ports).

Each refresh reads `GET /v1/cluster` (the instances' heartbeats and the current plan) and the
gateway's `/metrics` (each stage's queue, TTFT and TBT histograms). Latencies are quantiles of what
finished since the previous refresh, computed from the histogram buckets as Prometheus'
`histogram_quantile` does; the first frame covers everything since the gateway started.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Group
from rich.table import Table
from rich.text import Text

from common.protocol import Plan
from trident.launcher.compose_follow import FollowError, GatewayView

STAGES = ("encode", "prefill", "decode")


class TopError(RuntimeError):
    """The gateway could not be read."""


@dataclass
class Buckets:
    """A Prometheus histogram: cumulative counts at each upper bound, +Inf last."""

    bounds: list[float] = field(default_factory=list)
    counts: list[float] = field(default_factory=list)

    @property
    def total(self) -> float:
        return self.counts[-1] if self.counts else 0.0

    def since(self, earlier: Buckets | None) -> Buckets:
        """What was observed after `earlier` (the same histogram, read before)."""
        if earlier is None or earlier.bounds != self.bounds or earlier.total > self.total:
            return self  # nothing earlier, or the gateway restarted: all of it is new
        return Buckets(self.bounds, [c - e for c, e in zip(self.counts, earlier.counts, strict=True)])

    def quantile(self, q: float) -> float | None:
        """Linear within the bucket the rank falls in; the top finite bound when it falls past it.
        None with no observations."""
        if self.total <= 0:
            return None
        rank = q * self.total
        lower, below = 0.0, 0.0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            if count >= rank:
                if math.isinf(bound):
                    return lower
                inside = count - below
                return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
            lower, below = bound, count
        return lower


@dataclass
class Frame:
    """One look at the deployment."""

    at: float
    instances: list[dict]
    plan: Plan | None
    queued: dict[str, float]
    ttft: Buckets
    tbt: Buckets
    requests: float  # answered since the gateway started
    routes: dict[str, float] = field(default_factory=dict)  # prefill routing decisions by reason, since start


def read_frame(url: str, api_key: str = "") -> Frame:
    try:
        plan, instances = GatewayView(url, api_key).read()
        reply = httpx.get(url.rstrip("/") + "/metrics", timeout=5)
        reply.raise_for_status()
    except (FollowError, httpx.HTTPError) as exc:
        raise TopError(str(exc)) from None
    queued: dict[str, float] = {}
    hist = {name: Buckets() for name in ("trident_gateway_ttft_seconds", "trident_gateway_tbt_seconds")}
    requests, routes = 0.0, {}
    for family in text_string_to_metric_families(reply.text):
        for s in family.samples:
            if s.name == "trident_gateway_queued_tasks":
                queued[s.labels.get("stage", "")] = s.value
            elif s.name == "trident_gateway_requests_total":
                requests += s.value
            elif s.name == "trident_gateway_prefix_routes_total":
                routes[s.labels.get("reason", "")] = s.value
            elif s.name.endswith("_bucket") and s.name[: -len("_bucket")] in hist:
                into = hist[s.name[: -len("_bucket")]]
                into.bounds.append(float(s.labels["le"]))
                into.counts.append(s.value)
    return Frame(
        time.time(),
        instances,
        plan,
        queued,
        hist["trident_gateway_ttft_seconds"],
        hist["trident_gateway_tbt_seconds"],
        requests,
        routes,
    )


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def render(url: str, frame: Frame, earlier: Frame | None) -> Group:
    """The view of `frame`; latencies over what finished since `earlier`."""
    span = f"last {frame.at - earlier.at:.0f} s" if earlier else "since start"
    ttft, tbt = frame.ttft.since(earlier and earlier.ttft), frame.tbt.since(earlier and earlier.tbt)
    rate = (frame.requests - earlier.requests) / max(frame.at - earlier.at, 1e-9) if earlier else None
    head = Text.assemble(
        ("trident top ", "bold"),
        url,
        f"   {time.strftime('%H:%M:%S', time.localtime(frame.at))}\n",
        f"TTFT p50/p90 {_ms(ttft.quantile(0.5))} / {_ms(ttft.quantile(0.9))}   ",
        f"TBT p50/p90 {_ms(tbt.quantile(0.5))} / {_ms(tbt.quantile(0.9))}   ",
        f"({span}, {int(ttft.total)} requests)\n",
        f"requests/s {'-' if rate is None else f'{rate:.2f}'}   queued: "
        + "  ".join(f"{s} {int(frame.queued.get(s, 0))}" for s in STAGES),
        f"\n{routing_line(frame, earlier)}",
    )
    table = Table(title="instances", title_justify="left", expand=False)
    columns = (
        "instance",
        "roles",
        "running",
        "queued",
        "τe",
        "τt",
        "KV used",
        "cached",
        "prefix hit",
        "state",
    )
    for column in columns:
        table.add_column(column, justify="left" if column in ("instance", "roles", "state") else "right")
    workers = sorted((i for i in frame.instances if i.get("kind", "worker") == "worker"), key=_order)
    before = {i["instance_id"]: i for i in earlier.instances} if earlier else {}
    for i in workers:
        total = i.get("total_kv_blocks") or 0
        used = f"{100 * (1 - i.get('free_kv_blocks', 0) / total):.0f} %" if total else "-"
        budgets = i.get("budgets") or {}
        state = "leaving" if i.get("leaving") else "draining" if i.get("draining") else "up"
        table.add_row(
            i["instance_id"],
            ",".join(i.get("roles", ())),
            str(i.get("running", 0)),
            str(i.get("queue_depth", 0)),
            str(budgets.get("image_budget", "-")),
            str(budgets.get("token_budget", "-")),
            used,
            str(i.get("cached_kv_blocks", 0)),
            prefix_hit(i, before.get(i["instance_id"])),
            state,
        )
    if not workers:
        table.add_row("(no worker has a heartbeat)", *[""] * (len(columns) - 1))
    return Group(head, table, _plan_line(frame.plan))


def prefix_hit(now: dict, earlier: dict | None) -> str:
    """The share of prompt tokens the instance found in its prefix cache since `earlier` (its
    heartbeat at the last refresh; since it started without one, or if it restarted since)."""
    queried, hit = now.get("prefix_queried_tokens", 0), now.get("prefix_hit_tokens", 0)
    if earlier and earlier.get("prefix_queried_tokens", 0) <= queried:
        queried -= earlier.get("prefix_queried_tokens", 0)
        hit -= earlier.get("prefix_hit_tokens", 0)
    return f"{100 * hit / queried:.0f} %" if queried > 0 else "-"


def routing_line(frame: Frame, earlier: Frame | None) -> str:
    """Prefill routing decisions by reason (docs/architecture.md, routing by cached prefix), since
    `earlier` (since the gateway started without one)."""
    before = earlier.routes if earlier else {}
    reasons = ("prefix", "decoder", "load", "none", "fallback")  # services/gateway/kv_routing.py REASONS
    counts = {r: frame.routes.get(r, 0) - before.get(r, 0) for r in reasons}
    if not frame.routes:
        return "routed by prefix: off"
    return "routed: " + "  ".join(f"{reason} {int(n)}" for reason, n in counts.items())


def _order(instance: dict) -> tuple:
    roles = instance.get("roles", ())
    return (min((STAGES.index(r) for r in roles if r in STAGES), default=3), instance["instance_id"])


def _plan_line(plan: Plan | None) -> Text:
    if plan is None:
        return Text("plan: none yet (the planner plans once enough requests have finished)")
    kinds = ", ".join(f"{n} {k.upper()}" for k, n in sorted(plan.replicas.items()) if n)
    goodput = "-" if plan.goodput is None else f"{plan.goodput:.2f} req/s"
    return Text(f"plan #{plan.decision_id}: {plan.method} with {kinds}; predicted goodput {goodput}")
