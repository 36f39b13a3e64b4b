"""One deployment of bench/gpu_serve.py's plan, started, driven and read: a method's processes as
`trident up` starts them (compose.yaml's specs, through the launcher's cluster; planner included),
or `transformers serve`, the baseline, on one checkpoint, then, as its `Run` asks, greedy answers
through the OpenAI API held against HF `generate` on the same device, an open-loop TextCaps-shaped
sweep with images and the multi-turn workload through the gateway, and what the deployment shows of
itself afterwards (trident/bench/observe.py). Every request is bounded by the client's timeout: a
stream that stalls past it is counted as hung.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from common.infra import free_port
from common.stats import SLO
from trident.bench import client, deployments, observe
from trident.bench.metrics import goodput, summarise
from trident.bench.oracle import Chat, hf_greedy
from trident.bench.sweep import LoadSpec
from trident.launcher.cluster import Cluster, running_cluster
from trident.launcher.specs import service_spec
from trident.launcher.warm import WarmStarter

# One warm parent for every deployment of a check: each service forks from it instead of importing
# torch and transformers anew (trident/launcher/warm.py, what `trident up` does by default).
WARM = WarmStarter()

RATE_FIELDS = ("rate", "sent", "completed", "failed", "attainment", "ttft_p50", "ttft_p90", "tbt_p50",
               "tbt_p90", "throughput", "output_tokens_per_s", "errors")  # fmt: skip


@dataclass(frozen=True)
class Run:
    """A deployment and what to do with it."""

    name: str
    preset: str
    method: str | None  # None: the baseline, `transformers serve`
    dtype: str  # the engine's (TRIDENT_DTYPE)
    parity: bool = False  # API answers against HF's
    sweep: bool = False  # the TextCaps-shaped sweep
    turns: bool = False  # the multi-turn workload
    profile: bool = True  # the workers profile their budgets at start-up (off: as configured)
    need: float = 60.0  # seconds it takes, about: with less left before the deadline it is skipped


@dataclass(frozen=True)
class Config:
    """How every run is driven."""

    device: str  # cuda | cpu
    env: dict[str, str]  # every process's environment beside compose.yaml's (device, shares, SLOs)
    slo: SLO
    sweep: LoadSpec
    turns: LoadSpec
    chats: tuple[Chat, ...]
    answer_tokens: int
    image_size: tuple[int, int] | None  # every image's size; None: the workload's
    timeout: float  # one request's bound, seconds


def run(r: Run, model: Path, cfg: Config, log_dir: Path, left: float) -> dict:
    """Start `r`'s deployment on `model`, do what it asks, stop it; `left`: seconds it may take."""
    began = time.monotonic()
    out: dict = {"preset": r.preset, "method": r.method, "dtype": r.dtype, "failures": []}
    with _started(r, model, cfg, log_dir, left) as (served, cluster):
        out["startup_s"] = round(time.monotonic() - began, 1)
        if r.parity:
            out["parity"] = parity(served, model, cfg)
            if not out["parity"]["equal"]:
                out["failures"].append("API answers differ from HF's")
        for wanted, key, load in ((r.sweep, "sweep", cfg.sweep), (r.turns, "turns", cfg.turns)):
            if wanted:
                out[key] = drive(served, load, cfg)
                if out[key]["errors"] or out[key]["hung"]:
                    out["failures"].append(f"{key}: {out[key]['errors']} errors, {out[key]['hung']} hung")
        if cluster is not None:
            out["observed"] = observe.observe(observe.View.of(cluster))
    return out


@contextlib.contextmanager
def _started(
    r: Run, model: Path, cfg: Config, log_dir: Path, left: float
) -> Iterator[tuple[deployments.Served, Cluster | None]]:
    """The deployment, ready: a Trident method's as the launcher starts `trident up`'s processes (its
    services forked from one warm parent that every run of the check shares), or the baseline."""
    ready = max(30.0, left - 30.0)  # what start-up may take of the time left
    if r.method is None:
        with deployments.transformers_serve(
            model, port=free_port(), log_dir=log_dir, device=cfg.device, ready_timeout=ready
        ) as served:
            yield served, None
        return
    env = {**cfg.env, "TRIDENT_DTYPE": r.dtype}
    if not r.profile:
        env["TRIDENT_PROFILE"] = "off"
    with running_cluster(model, log_dir, r.method, env=env, ready_timeout=ready, starter=WARM) as cluster:
        for name in cluster.compose.always:  # the planner and its what-if jobs worker, as `trident up` runs
            cluster.start_spec(service_spec(cluster.compose, name, 1, cluster.setup))
        served_as = httpx.get(f"{cluster.url}/v1/models", timeout=10).json()["data"][0]["id"]
        gateway = cluster.procs[cluster.name_of(cluster.compose.gateway)].pid
        served = deployments.Served(
            f"trident {r.method}", deployments.TRIDENT, cluster.url, served_as, gateway, log_dir
        )
        yield served, cluster


def parity(served: deployments.Served, model: Path, cfg: Config) -> dict:
    """Each chat's greedy answer through the API against HF `generate` on the same device."""
    answers = [ask(served, chat, cfg.answer_tokens, cfg.timeout) for chat in cfg.chats]
    expected = hf_greedy(model, list(cfg.chats), cfg.answer_tokens, device=cfg.device)
    if cfg.device == "cuda":
        import torch

        torch.cuda.empty_cache()  # HF's model is gone; its memory goes back to the deployments
    same = [a == e for a, e in zip(answers, expected, strict=True)]
    return {"equal": all(same), "chats": len(same), "same": same, "answers": answers, "hf": expected}


def ask(served: deployments.Served, chat: Chat, max_tokens: int, timeout: float) -> str:
    """A greedy answer of exactly `max_tokens` tokens, unstreamed."""
    body = {"model": served.model, "messages": chat.messages(), "max_tokens": max_tokens, "temperature": 0}
    answer = httpx.post(
        f"{served.url}/v1/chat/completions", json=served.ignoring_eos(body), timeout=timeout, trust_env=False
    )
    if answer.status_code != 200:
        raise RuntimeError(f"the API answered {answer.status_code}: {answer.text[:300]}")
    return answer.json()["choices"][0]["message"]["content"]


def drive(served: deployments.Served, load: LoadSpec, cfg: Config) -> dict:
    """`load`'s rates in turn, open loop, until one misses the SLO's attainment; goodput over them."""
    opts = client.RequestOptions(
        model=served.model, image_size=cfg.image_size, seed=load.seed, fix_length=served.ignoring_eos,
        repeats=load.repeats,
    )  # fmt: skip
    rates, errors, hung = [], 0, 0
    for k, rate in enumerate(sorted(load.rates)):
        entries = load.entries(rate)
        content = dataclasses.replace(opts, seed=opts.seed * 1009 + k)
        measured = asyncio.run(client.run(served.url, entries, content, timeout=cfg.timeout))
        summary = summarise(rate, measured, cfg.slo)
        rates.append({f: getattr(summary, f) for f in RATE_FIELDS})
        errors += summary.failed
        hung += sum("Timeout" in r.error for r in measured)
        if summary.attainment < cfg.slo.attainment:
            break
    return {
        "goodput": goodput([(r["rate"], r["attainment"]) for r in rates], cfg.slo.attainment),
        "errors": errors,
        "hung": hung,
        "rates": rates,
        "load": load.describe(),
    }
