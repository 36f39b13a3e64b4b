"""Algorithm 2 on GPU-like profiles: which method and split wins per workload (issue 5, reproduction).

    python bench/planner_paper.py [--instances 8,32] [--shapes textcaps,pope,mme,textvqa,vizwiz]
                                  [--requests 300] [--profile paper:llava-1.5-7b]

For each model, workload shape, instance count and SLO setting, the planner picks a method and split
by simulated replay and reports its goodput next to a fixed, evenly split E+P+D. Models differ in
image tokens: LLaVA-1.5 576 an image, LLaVA-NeXT up to ~2900 (its tiles cost the vision tower as many
336 px images). SLO settings: the paper's (000 Table 3) and a tight-TTFT one (a quarter of it, same
TBT). A table goes to stdout; the last line is one JSON object with every result.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

from common.planner.algorithm import goodput, plan
from common.planner.paper_profiles import profiles_from
from common.planner.profiles import ProfileSet
from common.planner.types import Deployment
from common.planner.workloads import generate, llava15_tokens, llava_next_tokens
from common.stats import SLO

# 000 Table 3 (TTFT s, TBT s) per model and dataset.
PAPER_SLOS = {
    "llava-1.5": {s: (4.0, 0.08) for s in ("textcaps", "pope", "mme", "textvqa", "vizwiz")},
    "llava-next": {
        "textcaps": (8.0, 0.3),
        "pope": (8.0, 0.3),
        "mme": (8.0, 0.6),
        "textvqa": (8.0, 0.6),
        "vizwiz": (8.0, 0.6),
    },
}
IMAGE_TOKENS = {"llava-1.5": llava15_tokens, "llava-next": llava_next_tokens}


def slo_for(model: str, shape: str, setting: str) -> SLO:
    ttft, tbt = PAPER_SLOS[model][shape]
    return SLO(ttft=ttft / 4 if setting == "tight-ttft" else ttft, tbt=tbt)


def _even(instances: int) -> Deployment:
    base, extra = divmod(instances, 3)
    e, p, d = (base + (1 if k < extra else 0) for k in range(3))
    return Deployment.of("e+p+d", e=e, p=p, d=d)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", default="8,32")
    ap.add_argument("--shapes", default="textcaps,pope,mme,textvqa,vizwiz")
    ap.add_argument("--slos", default="paper,tight-ttft")
    ap.add_argument("--models", default="llava-1.5,llava-next")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--profile", default="paper:llava-1.5-7b")
    args = ap.parse_args()
    profiles = profiles_from(args.profile)
    rows = []
    for model in args.models.split(","):
        for slo_name in args.slos.split(","):
            for shape in args.shapes.split(","):
                slo = slo_for(model, shape, slo_name)
                trace = generate(
                    shape, rate=10.0, num_requests=args.requests, seed=0, image_tokens=IMAGE_TOKENS[model]
                )
                case = Case(model, slo_name, slo, shape, trace)
                for n in (int(x) for x in args.instances.split(",")):
                    rows.append(_row(case, n, profiles))
    print(json.dumps({"profile": profiles.source, "results": rows}))


def _best_by_method(result) -> dict[str, float]:
    best: dict[str, float] = {}
    for c in result.candidates:
        if c.pruned:
            continue
        m = c.deployment.method
        best[m] = max(best.get(m, 0.0), c.goodput)
    return best


@dataclass(frozen=True)
class Case:
    """One case of the paper's grid: a model, an SLO (its name and its bounds), a workload shape and
    the trace drawn from it."""

    model: str
    slo_name: str
    slo: SLO
    shape: str
    trace: list


def _row(case: Case, n: int, profiles: ProfileSet) -> dict:
    model, slo_name, slo, shape, trace = case.model, case.slo_name, case.slo, case.shape, case.trace
    started = time.monotonic()
    result = plan(trace, profiles, slo, n)
    baseline = goodput(trace, _even(n), profiles, slo)
    row = {
        "model": model,
        "slo": slo_name,
        "ttft_slo": slo.ttft,
        "tbt_slo": slo.tbt,
        "shape": shape,
        "instances": n,
        "method": result.deployment.method,
        "split": result.deployment.label,
        "goodput": result.goodput,
        "baseline": baseline.deployment.label,
        "baseline_goodput": baseline.goodput,
        "gain": round(result.goodput / baseline.goodput, 3) if baseline.goodput else None,
        "best_by_method": _best_by_method(result),
        "seconds": round(time.monotonic() - started, 1),
    }
    print(
        f"{model:10} {slo_name:10} {shape:9} N={n:<3} {row['split']:>9} {row['goodput']:8.2f} req/s"
        f"  vs {row['baseline']:>9} {row['baseline_goodput']:8.2f}  x{row['gain']}"
        f"  {row['best_by_method']}  ({row['seconds']} s)",
        flush=True,
    )
    return row


if __name__ == "__main__":
    main()
