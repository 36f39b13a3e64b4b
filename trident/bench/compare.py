"""Several deployments on one checkpoint, one after another, under the same sweep from the same
client: each is started, measured at every rate, and stopped before the next starts, so they never
share the machine. Also the ablations' engine (bench/ablations.py).

A system named `planner` is the planner's pick: the deployment the planner service of an earlier
Trident system (the first one run) recommends for the traffic that system just served, at the same
SLOs and instance count. Its recommendation is recorded with the results.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from common.infra import free_port
from common.roles import InstanceKind
from common.stats import SLO
from trident.bench import deployments, llamacpp, plots
from trident.bench.sweep import Hooks, LoadSpec, SweepResult, Target, run_sweep
from trident.launcher.local_up import UpCommand

PEER = "transformers-serve"
PEERS = (PEER, PEER + "-cb", llamacpp.LLAMACPP)
PLANNER = "planner"
METHODS = ("e+p+d", "ep+d", "ed+p", "epd")
NO_CACHE = "-nocache"  # a method's suffix: the same deployment with prefix caching off
NO_ROUTING = "-norouting"  # ...with routing by cached prefix off (requests pulled from shared queues)
TURNS = "-turns"  # ...with decode instances that continue conversations (decoder-side reuse)
VARIANTS = {  # suffix -> the environment it sets
    "": {},
    NO_CACHE: {"TRIDENT_PREFIX_CACHING": "false"},
    NO_ROUTING: {"TRIDENT_KV_ROUTING": "false"},
    TURNS: {"TRIDENT_DECODE_PREFILL_TOKENS": "256"},
}


@dataclass(frozen=True)
class System:
    """One deployment to measure: a Trident method (with replica counts and environment), the
    planner's pick, or a peer server (`transformers serve`, llama.cpp's `llama-server`)."""

    name: str
    method: str = ""  # e+p+d | ep+d | ed+p | epd; empty for the peer and the planner's pick
    scale: dict[str, int] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    peer: bool = False
    continuous_batching: bool = False  # the peer's option

    @classmethod
    def parse(cls, spec: str) -> System:
        """`e+p+d`, `ep+d`, `ed+p`, `epd` (any of them `-nocache`: with prefix caching off,
        `-norouting`: with routing by cached prefix off, or `-turns`: with decode instances that
        prefill the next turns of their conversations; and `:SERVICE=N` as often as needed, N
        replicas of a compose service, e.g. `e+p+d:prefill=2`), `planner`, `transformers-serve`,
        `transformers-serve-cb` (that peer with continuous batching) or `llama.cpp`."""
        base, *scales = spec.split(":")
        for suffix, env in VARIANTS.items():
            method = base.removesuffix(suffix)
            if method in METHODS and (method == base) == (suffix == ""):
                return cls(spec, method=method, env=dict(env), scale=_scale(spec, scales))
        if scales:
            raise ValueError(f"{spec!r}: only a Trident method takes replica counts")
        if spec == PLANNER:
            return cls(PLANNER)
        if spec in PEERS:
            return cls(spec, peer=True, continuous_batching=spec.endswith("-cb"))
        raise ValueError(
            f"unknown system {spec!r}; known: e+p+d, ep+d, ed+p, epd (each also with {NO_CACHE}, "
            f"{NO_ROUTING} or {TURNS}, and :SERVICE=N), planner, {', '.join(PEERS)}"
        )


def _scale(spec: str, scales: list[str]) -> dict[str, int]:
    counts = {}
    for item in scales:
        service, _, n = item.partition("=")
        if not service or not n.isdigit() or int(n) < 1:
            raise ValueError(f"{spec!r}: {item!r} is not SERVICE=N (N replicas, at least 1)")
        counts[service] = int(n)
    return counts


@dataclass
class Comparison:
    slo: SLO
    load: dict
    results: list[SweepResult] = field(default_factory=list)
    notes: dict[str, str] = field(default_factory=dict)  # system -> why it has no result, or what it was

    def goodputs(self) -> dict[str, float]:
        return {r.name: r.goodput for r in self.results}

    def headline(self) -> dict:
        """Trident's best goodput against the strongest peer's (`ratio`) and each peer's (`ratios`),
        for the peers that ran."""
        ours = {r.name: r.goodput for r in self.results if r.name not in PEERS}
        peers = {r.name: r.goodput for r in self.results if r.name in PEERS}
        best = max(ours, key=ours.get) if ours else None
        peer = max(peers, key=peers.get) if peers else None

        def ratio(name: str) -> float:
            return round(ours[best] / peers[name], 3) if peers[name] > 0 else float("inf")

        ratios = {name: ratio(name) for name in peers} if best else {}
        return {
            "prefix_cache": self.cache_effect(),
            "kv_routing": self.routing_effect(),
            "decoder_turns": self.turns_effect(),
            "reuse": self.reuse(),
            "best": best,
            "best_goodput": ours.get(best),
            "peer": peer,
            "peer_goodput": peers.get(peer),
            "ratio": ratios.get(peer),
            "ratios": ratios,
        }

    def reuse(self) -> dict[str, dict]:
        """Each system's reuse over its sweep: new images against encoder runs, prompt tokens
        computed against an unbounded cache's (trident/bench/reuse.py)."""
        from trident.bench.reuse import total

        return {
            r.name: total(s.reuse for s in r.summaries)
            for r in self.results
            if r.summaries and all(s.reuse is not None for s in r.summaries)
        }

    def cache_effect(self) -> dict[str, dict]:
        """For each method run with prefix caching on and off: goodput on / off, and the TTFT p50 at
        the lowest rate (and of later turns, for a multi-turn workload) off / on."""
        return self._variant_effect(NO_CACHE)

    def routing_effect(self) -> dict[str, dict]:
        """The same ratios for each method run with routing by cached prefix on and off."""
        return self._variant_effect(NO_ROUTING)

    def turns_effect(self) -> dict[str, dict]:
        """The same ratios for each method run with decoders that continue turns (`-turns`, the
        key) against the method as it is."""
        return self._variant_effect(TURNS, suffixed_is_on=True)

    def _variant_effect(self, suffix: str, suffixed_is_on: bool = False) -> dict[str, dict]:
        def ratio(a: float | None, b: float | None) -> float | None:
            return round(a / b, 3) if a and b else None

        runs = {r.name: r for r in self.results}
        effect = {}
        for name, off in runs.items():
            base, colon, scale = name.partition(":")
            on = runs.get(base.removesuffix(suffix) + colon + scale) if base.endswith(suffix) else None
            if on is not None and suffixed_is_on:
                on, off = off, on
            if on is None or not on.summaries or not off.summaries:
                continue
            low_on, low_off = on.summaries[0], off.summaries[0]
            effect[on.name] = {
                "goodput_ratio": ratio(on.goodput, off.goodput),
                "ttft_p50_ratio": ratio(low_off.ttft_p50, low_on.ttft_p50),
                "later_turns_ttft_p50_ratio": ratio(
                    low_off.ttft_p50_later_turns, low_on.ttft_p50_later_turns
                ),
                "cached_share": [
                    ratio(low.cached_tokens, low.prompt_tokens) if low.prompt_tokens else None
                    for low in (low_on, low_off)
                ],
            }
        return effect

    def to_dict(self) -> dict:
        return {
            "slo": {"ttft": self.slo.ttft, "tbt": self.slo.tbt, "attainment": self.slo.attainment},
            "load": self.load,
            "goodput": self.goodputs(),
            **self.headline(),
            "notes": self.notes,
            "systems": [r.to_dict() for r in self.results],
        }


def planner_pick(planner_url: str, key: str, timeout: float = 300.0) -> dict:
    """The planner service's recommendation now (POST /plan/replan?wait=true, a write: `key`)."""
    response = httpx.post(
        planner_url.rstrip("/") + "/plan/replan",
        params={"wait": "true"},
        timeout=timeout,
        headers={"Authorization": f"Bearer {key}"},
    )
    if response.status_code != 200:
        raise RuntimeError(f"the planner gave no plan ({response.status_code}): {response.text[:300]}")
    return response.json()


def picked_system(plan: dict) -> System:
    scale = {InstanceKind(kind).scale_name: n for kind, n in plan["replicas"].items()}
    return System(PLANNER, method=plan["method"], scale=scale)


@contextlib.contextmanager
def started(system: System, model: Path, slo: SLO, log_dir: Path) -> Iterator[deployments.Served]:
    port = free_port()
    if system.name == llamacpp.LLAMACPP:
        with llamacpp.llama_server(model, port=port, log_dir=log_dir) as served:
            yield served
        return
    if system.peer:
        with deployments.transformers_serve(
            model, port=port, continuous_batching=system.continuous_batching, log_dir=log_dir
        ) as served:
            yield served
        return
    # The deployment's planner and profiles work to the same SLOs as the bench judges by.
    # It plans as soon as a short sweep's first rate has finished enough requests.
    env = {
        "TRIDENT_TTFT_SLO": str(slo.ttft),
        "TRIDENT_TBT_SLO": str(slo.tbt),
        "TRIDENT_PLANNER_MIN_REQUESTS": "20",
        **system.env,
    }
    up = UpCommand(model, log_dir, system.method, scale=system.scale, env=env, port=port)
    with deployments.trident(up) as served:
        yield served


@dataclass(frozen=True)
class Bench:
    """What every system is measured under, and where the results go."""

    load: LoadSpec
    slo: SLO
    out: Path
    image_size: tuple[int, int] | None = None  # WxH for every image; None: the workload's sizes
    ignore_eos: bool = True


Reporter = Callable[[str], contextlib.AbstractContextManager[Hooks]]


def compare(systems: list[System], model: Path, bench: Bench, reporter: Reporter | None = None) -> Comparison:
    """Each system in turn under `bench.load`; results, a table and plots in `bench.out` (module
    docstring)."""
    result = Comparison(bench.slo, bench.load.describe())
    plan: dict | None = None
    wants_plan = any(s.name == PLANNER for s in systems)
    for system in systems:
        if system.name == PLANNER:
            if plan is None:
                result.notes.setdefault(PLANNER, "no plan: run a Trident method before `planner`")
                continue
            system = picked_system(plan)
        try:
            with started(system, model, bench.slo, bench.out / "logs" / system.name) as served:
                if system.name == llamacpp.LLAMACPP:  # that it serves the same model as we do
                    agreements = llamacpp.greedy_parity(served.url, model, llamacpp.PARITY_PROMPTS)
                    result.notes[system.name] = llamacpp.parity_note(agreements)
                result.results.append(measure(system, served, model, bench, reporter))
                if wants_plan and plan is None and not system.peer and served.planner_url:
                    plan = _ask_the_planner(served, result.notes)
        except (RuntimeError, TimeoutError, OSError) as exc:
            result.notes[system.name] = f"did not run: {exc}"
        save(result, bench.out)
    return result


def measure(
    system: System, served: deployments.Served, model: Path, bench: Bench, reporter: Reporter | None
) -> SweepResult:
    """One started system under the sweep."""
    from trident.bench.client import RequestOptions

    opts = RequestOptions(
        model=served.model,
        ignore_eos=bench.ignore_eos,
        image_size=bench.image_size,
        seed=bench.load.seed,
        fix_length=served.ignoring_eos,
    )
    meter = reuse_meter(system, served, model)
    target = Target(system.name, served.url, served.model, bench.out / system.name, options=opts, meter=meter)
    with reporter(system.name) if reporter else contextlib.nullcontext(Hooks()) as hooks:
        return run_sweep(target, bench.load, bench.slo, hooks)


def _ask_the_planner(served: deployments.Served, notes: dict[str, str]) -> dict | None:
    """The pick of the deployment's planner for the traffic it just served, noted; None if it had none."""
    try:
        plan = planner_pick(served.planner_url or "", served.planner_key)
    except (RuntimeError, httpx.HTTPError) as exc:
        notes[PLANNER] = f"no plan: {exc}"
        return None
    notes[PLANNER] = f"{plan['label']} (predicted goodput {plan['goodput']:.3g} req/s)"
    return plan


def reuse_meter(system: System, served: deployments.Served, model: Path):
    """What measures a system's reuse: for Trident, its encoder runs and evictions and the ideal
    prompt tokens at its block size; for a peer, what the client sees (trident/bench/reuse.py)."""
    from services.settings import WorkerSettings
    from trident.bench.reuse import IdealCache, ReuseMeter

    if system.peer:
        return ReuseMeter()
    size = int(system.env.get("TRIDENT_BLOCK_SIZE", WorkerSettings.model_fields["block_size"].default))
    return ReuseMeter(served.url, ideal=IdealCache(model, size))


def table(result: Comparison) -> str:
    """A Markdown table: goodput and, at each rate, attainment and TTFT/TBT p50/p90."""
    rows = [
        "| system | goodput (req/s) | rate | attainment | TTFT p50 / p90 (ms) | TBT p50 / p90 (ms) |",
        "|---|---|---|---|---|---|",
    ]

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    for r in result.results:
        for i, s in enumerate(r.summaries):
            name, good = (r.name, f"{r.goodput:g}") if i == 0 else ("", "")
            rows.append(
                f"| {name} | {good} | {s.rate:g} | {100 * s.attainment:.0f} % | "
                f"{ms(s.ttft_p50)} / {ms(s.ttft_p90)} | {ms(s.tbt_p50)} / {ms(s.tbt_p90)} |"
            )
    for name, note in result.notes.items():
        rows.append(f"\n{name}: {note}")
    return "\n".join(rows) + "\n"


def save(result: Comparison, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    (out / "compare.md").write_text(table(result))
    if not result.results:
        return
    series = {r.name: [(s.rate, s.attainment) for s in r.summaries] for r in result.results}
    plots.attainment_plot(series, result.slo, out / "attainment.png")
    rates = sorted({rate for r in result.results for rate in r.requests})
    middle = rates[len(rates) // 2]
    runs = {r.name: r.requests[middle] for r in result.results if middle in r.requests}
    plots.cdf_plot(runs, result.slo, out / f"latency_cdf-{middle:g}.png")
