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
from dataclasses import dataclass

import torch

from common.engine import Engine
from common.engine.profiler import BudgetProfiler, StageProfile
from common.roles import letters
from common.store import Store
from services.settings import ProfileMode, WorkerSettings

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


def profile_id(s: WorkerSettings, engine: Engine, hw: str) -> str:
    """`<model>-<role initials>-<hash>`: the hash covers everything that changes what is measured."""
    roles = engine.config.roles
    config = (s.model / "config.json").read_bytes()
    facts = {
        "version": PROFILER_VERSION,
        "model": s.model.name,
        "config": hashlib.sha256(config).hexdigest(),
        "hardware": hw,
        "threads": torch.get_num_threads(),  # the engine's, set as it started
        "roles": sorted(r.value for r in roles),
        "slo": [s.ttft_slo, s.tbt_slo],
        "policy": s.policy,
        "limits": [s.token_budget, s.image_budget, s.kv_cache_bytes, s.block_size, s.max_num_seqs],
    }
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]
    return f"{s.model.name}-{letters(roles)}-{digest}"


async def establish(engine: Engine, store: Store, s: WorkerSettings, instance_id: str) -> str:
    """Measure or reuse this instance's profile as `settings.profile` says, apply its budgets to
    `engine` and publish it; returns the profile id ("" with profiling off). Runs before the engine
    serves anything."""
    if s.profile == ProfileMode.OFF:
        return ""
    hw = hardware(engine.device)
    pid = profile_id(s, engine, hw)
    started = time.monotonic()
    job = _Measurement(engine, store, s, instance_id, pid, hw)
    if s.profile == ProfileMode.MEASURE:
        profile, how = await job.measure(), "measured"
    else:
        profile, how = await job.reuse_or_measure()
    engine.apply_profile(profile)
    log.info(
        "%s profile %s %s in %.1fs: image budget %d, token budget %d (iteration limit %.3fs)",
        instance_id,
        pid,
        how,
        time.monotonic() - started,
        profile.image_budget,
        profile.token_budget,
        profile.latency_limit,
    )
    return pid


@dataclass
class _Measurement:
    engine: Engine
    store: Store
    settings: WorkerSettings
    instance_id: str
    pid: str
    hardware: str

    async def reuse_or_measure(self) -> tuple[StageProfile, str]:
        planning = self.store.planning
        while True:
            cached = await planning.get_profile(self.pid)
            if cached is not None:
                return StageProfile.from_record(cached), "reused"
            if await planning.claim_profile(self.pid, self.instance_id, CLAIM_TTL):
                try:
                    return await self.measure(), "measured"
                finally:
                    await planning.release_profile_claim(self.pid)
            await asyncio.sleep(POLL)  # another instance is measuring this very profile

    async def measure(self) -> StageProfile:
        """Measure in a thread (the engine is not serving yet), renewing the claim meanwhile."""
        s, pid = self.settings, self.pid
        profiler = BudgetProfiler(self.engine, repeats=s.profile_repeats)
        measuring = asyncio.ensure_future(
            asyncio.to_thread(
                profiler.profile, s.ttft_slo, s.tbt_slo, max_images=s.image_budget, max_tokens=s.token_budget
            )
        )
        while not measuring.done():
            await asyncio.wait({measuring}, timeout=CLAIM_TTL / 3)
            if not measuring.done() and s.profile == ProfileMode.AUTO:
                try:
                    await self.store.planning.claim_profile(pid, self.instance_id, CLAIM_TTL)
                except Exception as exc:  # at worst another instance measures the same profile too
                    log.warning("could not renew the claim on profile %s: %r", pid, exc)
        profile = measuring.result()
        record = profile.to_record(pid, model=s.served_model_name, hardware=self.hardware)
        await self.store.planning.put_profile(record)
        return profile
