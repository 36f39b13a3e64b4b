"""Start-up profiling: find this instance's budgets under the SLOs (or reuse a profile another
instance of the same kind measured), apply them, and publish the profile for the planner.

A profile is reused only between instances with the same fingerprint (the `profile_id`): the same
model config, hardware, role set, SLOs, policy and engine limits. Instances with one fingerprint
that start together measure once: the first takes a claim in Redis, the others wait for its
result (or measure themselves if the claim lapses because its owner died).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import platform
import time
from typing import TYPE_CHECKING

import torch

from common.engine.profiler import BudgetProfiler, StageProfile
from common.roles import letters

if TYPE_CHECKING:
    from services.worker.worker import StageWorker

log = logging.getLogger(__name__)
# Bump when the profiler measures differently, so profiles cached by an older build are not reused.
PROFILER_VERSION = 3
CLAIM_TTL = 30.0  # seconds a measuring instance's claim lasts without renewal
POLL = 0.25  # seconds between looks for a profile another instance is measuring


def hardware(device: torch.device) -> str:
    """What the latencies were measured on: `cuda:<device name>` or `cpu:<model name>:<threads>`."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{_cpu_model()}:{torch.get_num_threads()}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def profile_id(w: StageWorker, hw: str) -> str:
    """`<model>-<role initials>-<hash>`: the hash covers everything that changes what is measured."""
    s = w.settings
    config = (s.model / "config.json").read_bytes()
    facts = {
        "version": PROFILER_VERSION,
        "model": s.model.name,
        "config": hashlib.sha256(config).hexdigest(),
        "hardware": hw,
        "roles": sorted(r.value for r in w.roles),
        "slo": [s.ttft_slo, s.tbt_slo],
        "policy": s.policy,
        "limits": [s.token_budget, s.image_budget, s.kv_cache_bytes, s.block_size, s.max_num_seqs],
    }
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    return f"{s.model.name}-{letters(w.roles)}-{digest}"


async def establish(w: StageWorker) -> str:
    """Measure or reuse this instance's profile as `settings.profile` says, apply its budgets and
    publish it; returns the profile id ("" with profiling off)."""
    if w.settings.profile == "off":
        return ""
    hw = hardware(w.engine.device)
    pid = profile_id(w, hw)
    started = time.monotonic()
    if w.settings.profile == "measure":
        profile, how = await _measure_and_publish(w, pid, hw), "measured"
    else:
        profile, how = await _reuse_or_measure(w, pid, hw)
    w.engine.apply_profile(profile)
    log.info(
        "%s profile %s %s in %.1fs: image budget %d, token budget %d (iteration limit %.3fs)",
        w.instance_id, pid, how, time.monotonic() - started, profile.image_budget,
        profile.token_budget, profile.latency_limit,
    )  # fmt: skip
    return pid


async def _reuse_or_measure(w: StageWorker, pid: str, hw: str) -> tuple[StageProfile, str]:
    planning = w.store.planning
    while True:
        cached = await planning.get_profile(pid)
        if cached is not None:
            return StageProfile.from_record(cached), "reused"
        if await planning.claim_profile(pid, w.instance_id, CLAIM_TTL):
            try:
                return await _measure_and_publish(w, pid, hw), "measured"
            finally:
                await planning.release_profile_claim(pid)
        await asyncio.sleep(POLL)  # another instance is measuring this very profile


async def _measure_and_publish(w: StageWorker, pid: str, hw: str) -> StageProfile:
    """Measure in a thread (the engine is not serving yet), renewing the claim meanwhile."""
    s = w.settings
    profiler = BudgetProfiler(w.engine, repeats=s.profile_repeats)
    measuring = asyncio.ensure_future(
        asyncio.to_thread(
            profiler.profile, s.ttft_slo, s.tbt_slo, max_images=s.image_budget, max_tokens=s.token_budget
        )
    )
    while not measuring.done():
        await asyncio.wait({measuring}, timeout=CLAIM_TTL / 3)
        if not measuring.done() and s.profile == "auto":
            try:
                await w.store.planning.claim_profile(pid, w.instance_id, CLAIM_TTL)
            except Exception as exc:  # at worst another instance measures the same profile too
                log.warning("could not renew the claim on profile %s: %r", pid, exc)
    profile = measuring.result()
    await w.store.planning.put_profile(profile.to_record(pid, model=s.served_model_name, hardware=hw))
    return profile
