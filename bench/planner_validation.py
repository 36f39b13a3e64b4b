"""The planner's simulator against real runs on this machine (issue 5, "validated against real runs").

    python bench/planner_validation.py [--presets tiny-llava] [--methods e+p+d,ep+d,ed+p]
                                       [--rates 2,4,8] [--requests 40]

For each preset and method a real deployment (one instance per kind, nats-server, redis-server) is
started; unloaded requests calibrate the fixed costs; then a 50 % text / 50 % one-image workload is
sent at three rates and the
gateway-measured TTFT p50/p90 and per-request TBT p90 (median over requests) are compared with the
simulator's prediction for the same requests. A table goes to stdout; the last line is one JSON
object with every comparison and the largest relative error.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.checkpoints import is_checkpoint_dir, write_checkpoint
from common.planner.types import SLO
from tests.planner.validation import validate


def _cell(name: str, measured: float, predicted: float) -> str:
    error = (predicted - measured) / measured if measured else 0.0
    return f"{name} {measured * 1000:7.1f}/{predicted * 1000:7.1f} ms ({error:+.0%})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="tiny-llava")
    ap.add_argument("--methods", default="e+p+d,ep+d,ed+p")
    ap.add_argument("--rates", default="2,4,8", help="requests/s")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--max-output", type=int, default=16)
    ap.add_argument("--ttft-slo", type=float, default=5.0)
    ap.add_argument("--tbt-slo", type=float, default=0.5)
    args = ap.parse_args()
    rates = [float(x) for x in args.rates.split(",")]
    slo = SLO(args.ttft_slo, args.tbt_slo)
    report: dict = {"rates": rates, "requests": args.requests, "calibration": [], "runs": []}
    worst = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets.split(","):
            model = Path(tmp) / preset
            if not is_checkpoint_dir(model):
                write_checkpoint(model, preset, seed=0)
            for method in args.methods.split(","):
                workdir = Path(tmp) / f"{preset}-{method.replace('+', '-')}"
                workdir.mkdir()
                calibration, comparisons = validate(
                    model, method, rates, args.requests, workdir, slo, max_output=args.max_output
                )
                brief = {k: v for k, v in calibration.items() if k != "profiles"}
                print(f"{preset:12} {method:6} calibration {json.dumps(brief)}", flush=True)
                report["calibration"].append({"preset": preset, "method": method, **calibration})
                for c in comparisons:
                    errors = c.errors
                    worst = max([worst, *(abs(e) for e in errors.values())])
                    report["runs"].append({"preset": preset, "method": method, **c.to_dict()})
                    cells = "  ".join(_cell(k, c.measured[k], c.predicted[k]) for k in c.measured)
                    print(f"{preset:12} {method:6} {c.rate:7.2f} req/s  {cells}", flush=True)
    report["max_abs_error"] = round(worst, 4)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
