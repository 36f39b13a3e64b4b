"""The whole deployment on one GPU (issue 45): NATS, Redis, the gateway, the planner and each worker as
its own process, as `trident up` starts them, every instance on the one GPU with its share of its
memory (trident/gpu_deploy.py, what compose.gpu.yaml and `trident kubernetes --gpu` deploy).

    python bench/gpu_serve.py [--deadline 480] [--out .trident/gpu_serve.json]   # on a GPU
    python bench/gpu_serve.py --cpu          # every step on tiny checkpoints, a very short sweep (CI)

Steps, in order, each timed and recorded pass/fail without stopping the rest; one that would start
with less time left than it needs is skipped with the reason (trident/bench/steps.py):

1. `environment`, `machine`: versions, the device, nats-server and redis-server found; the device's
   memory bandwidth and bf16 matmul rate (the ceilings; bench/gpu_check.py measures the same).
2. `parity <method>` for E+P+D, EP+D, ED+P and EPD: greedy answers through the OpenAI API against HF
   `generate` on the same device, for tiny-llava in float32.
3. `llava-1.5-7b <method>` for E+P+D, EP+D and EPD (random weights, bfloat16): an open-loop
   TextCaps-shaped sweep with images and the multi-turn workload through the gateway: goodput within
   the SLOs, TTFT/TBT p50/p90, each stage's time, each transfer's bytes, GB/s and share of TTFT, the
   path each worker's transfers took, and every process's memory (RSS; GPU: nvidia-smi's and torch's).
4. `transformers-serve llava-1.5-7b`: the baseline, on the same GPU and sweep, where it starts.
5. `qwen2-vl-7b ed+p`: the Qwen2-VL-7B shapes under the fourth method, the sweep alone (its
   checkpoint is written here first: the step the 8-minute deadline skips first).

With `--cpu` the same steps run on the CPU (tiny-llava for llava-1.5-7b, tiny-qwen2-vl for
qwen2-vl-7b, each deployment also checked against HF, one deployment per method), GPU fields null.
The last line of output is the whole result as one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from common.models import resolve_model
from common.stats import SLO
from trident import gpu_deploy
from trident.bench.client import image_data_url
from trident.bench.machine import device_rates
from trident.bench.oracle import Chat
from trident.bench.repeat import Repeats
from trident.bench.served_run import Config, Run, run
from trident.bench.steps import Steps
from trident.bench.sweep import LoadSpec

REPO = Path(__file__).resolve().parents[1]
PARITY = "tiny-llava"  # float32: token-identical to HF's on any device
METHODS = ("e+p+d", "ep+d", "ed+p", "epd")
PACKAGES = ("torch", "transformers", "fastapi", "pydantic", "nats-py", "redis", "celery", "openai")


def deployment_env(cpu: bool) -> dict[str, str]:
    """What every process of a deployment gets: trident/gpu_deploy.py's settings (on the CPU: the
    same, on the CPU device)."""
    return {**gpu_deploy.worker_env(), **({"TRIDENT_DEVICE": "cpu"} if cpu else {})}


def plan(cpu: bool) -> list[Run]:
    """The deployments, most telling first. On the CPU every checkpoint is a float32 tiny one, so
    each deployment is also held against HF, and one per method is all it starts."""
    llava, qwen = ("tiny-llava", "tiny-qwen2-vl") if cpu else ("llava-1.5-7b", "qwen2-vl-7b")
    dtype = "float32" if cpu else "bfloat16"
    need = 20.0 if cpu else 100.0
    runs = [] if cpu else [Run(f"parity {m}", PARITY, m, "float32", parity=True, profile=False, need=40)
                           for m in METHODS]  # fmt: skip
    runs += [
        Run(f"{llava} {m}", llava, m, dtype, parity=cpu, sweep=True, turns=True, profile=not cpu, need=need)
        for m in ("e+p+d", "ep+d", "epd")
    ]
    runs.append(Run(f"transformers-serve {llava}", llava, None, dtype, sweep=True, need=need))
    runs.append(
        Run(f"{qwen} ed+p", qwen, "ed+p", dtype, parity=cpu, sweep=True, profile=not cpu, need=2 * need)
    )
    return runs


def config(cpu: bool) -> Config:
    if cpu:  # a tiny model on two shared cores: a couple of requests a rate, a few tokens each
        slo, rates, duration, out_tokens, size = SLO(ttft=5.0, tbt=0.5), (1.0,), 2.0, 8, (64, 64)
        repeats = Repeats(turns=2, system_tokens=20, think_time=0.2, image_prob=0.5, seed=0)
        turns = LoadSpec(
            rates=(1.0,), duration=2.0, workload="textcaps", max_output_tokens=6, repeats=repeats
        )
    else:  # 7B on an H200: TextCaps' own image sizes, outputs capped so a rate drains in seconds
        slo, rates, duration, out_tokens, size = SLO(ttft=2.0, tbt=0.1), (2.0, 8.0, 24.0), 6.0, 128, None
        repeats = Repeats(turns=3, system_tokens=300, think_time=0.5, image_prob=0.3, seed=0)
        turns = LoadSpec(
            rates=(4.0,), duration=6.0, workload="textcaps", max_output_tokens=32, repeats=repeats
        )
    sweep = LoadSpec(rates=rates, duration=duration, workload="textcaps", max_output_tokens=out_tokens)
    env = {**deployment_env(cpu), "TRIDENT_TTFT_SLO": str(slo.ttft), "TRIDENT_TBT_SLO": str(slo.tbt)}
    return Config(
        device="cpu" if cpu else "cuda", env=env, slo=slo, sweep=sweep, turns=turns, chats=chats(),
        answer_tokens=8 if cpu else 12, image_size=size, timeout=60.0,
    )  # fmt: skip


def chats() -> tuple[Chat, ...]:
    """Greedy questions: two with an image, one without."""
    return (
        Chat("What is in this picture?", (image_data_url(1, (96, 72)),)),
        Chat("Describe the colours you see.", (image_data_url(2, (64, 64)),)),
        Chat("Say something about the number seven."),
    )


def environment(device: torch.device) -> dict:
    info: dict = {"python": sys.version.split()[0], "device": str(device), "cuda": torch.version.cuda}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1)}
    info["packages"] = {}
    for name in PACKAGES:
        try:
            info["packages"][name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            info["packages"][name] = None
    for server in ("nats-server", "redis-server"):
        found = shutil.which(server)
        run_ = (
            subprocess.run([found, "--version"], capture_output=True, text=True, timeout=30)
            if found
            else None
        )
        info[server] = (run_.stdout or run_.stderr).strip() if run_ else None
    return info


def machine(device: torch.device) -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    figures = {
        "dtype": str(dtype).removeprefix("torch."),
        **device_rates(device, dtype, small=device.type == "cpu"),
    }
    if device.type == "cuda":
        torch.cuda.empty_cache()  # what it measured with goes back before the deployments start
    return figures


def headline(results: dict) -> dict:
    """Goodput per run, Trident's best against the baseline's, parity per method, errors in all."""
    runs = {k: v for k, v in results["runs"].items() if isinstance(v, dict)}
    good = {k: v["sweep"]["goodput"] for k, v in runs.items() if "sweep" in v}
    ours = {k: g for k, g in good.items() if not k.startswith("transformers-serve")}
    peer = next((g for k, g in good.items() if k.startswith("transformers-serve")), None)
    best = max(ours, key=ours.get) if ours else None
    parity = {v["method"]: v["parity"]["equal"] for v in runs.values() if "parity" in v}
    return {
        "goodput": good,
        "best": best,
        "best_goodput": ours.get(best),
        "baseline_goodput": peer,
        "ratio": round(ours[best] / peer, 3) if best and peer else None,
        "parity": parity,
        "errors": sum(v[k]["errors"] for v in runs.values() for k in ("sweep", "turns") if k in v),
        "hung": sum(v[k]["hung"] for v in runs.values() for k in ("sweep", "turns") if k in v),
        "skipped": sorted(k for k, v in runs.items() if "skipped" in v),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu", action="store_true", help="rehearse every step on the CPU, tiny checkpoints")
    ap.add_argument("--deadline", type=float, default=480.0, help="seconds for the whole check")
    ap.add_argument(
        "--models", type=Path, default=REPO / ".trident" / "models", help="where checkpoints are kept"
    )
    ap.add_argument("--out", type=Path, default=REPO / ".trident" / "gpu_serve.json")
    ap.add_argument("--logs", type=Path, default=REPO / ".trident" / "gpu_serve_logs")
    args = ap.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --cpu to rehearse on the CPU")
    device = torch.device("cpu" if args.cpu else "cuda")
    cfg = config(args.cpu)
    results: dict = {
        "cpu_mode": args.cpu, "deadline_s": args.deadline,
        "slo": {"ttft": cfg.slo.ttft, "tbt": cfg.slo.tbt, "attainment": cfg.slo.attainment},
        "settings": {**deployment_env(args.cpu), "gpus_per_instance": gpu_deploy.GPUS_PER_INSTANCE,
                     "method_shares": {m: gpu_deploy.method_share(m) for m in METHODS}},
        "runs": {},
    }  # fmt: skip
    steps = Steps(results, args.out, args.deadline)
    steps.run("environment", lambda: environment(device))
    steps.run("machine", lambda: machine(device))
    for r in plan(args.cpu):

        def go(r: Run = r) -> dict:
            start = time.monotonic()
            model = resolve_model(r.preset, args.models)  # written here the first time (random weights)
            written = round(time.monotonic() - start, 1)
            log_dir = args.logs / r.name.replace(" ", "_").replace("+", "-")  # e+p+d -> e-p-d
            return {"checkpoint_s": written, **run(r, model, cfg, log_dir, steps.left())}

        steps.run(r.name, go, need=r.need, into=results["runs"])
    results["headline"] = headline(results)
    results["ok"] = all(
        v.get("ok") for v in [results["environment"], results["machine"], *results["runs"].values()]
    )
    steps.save()
    print(f"results in {args.out}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
