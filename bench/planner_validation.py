"""The planner's simulator against real runs on this machine (issue 5, "validated against real runs").

    python bench/planner_validation.py [--presets tiny-llava] [--methods e+p+d,ep+d,ed+p]
                                       [--rates 2,4,8] [--requests 40] [--out .trident/validation]
    python bench/planner_validation.py --replay .trident/validation

For each preset and method a real deployment (one instance per kind, nats-server, redis-server) is
started; unloaded requests calibrate the fixed costs; then a 50 % text / 50 % one-image workload is
sent at three rates and the
gateway-measured TTFT p50/p90 and per-request TBT p90 (median over requests) are compared with the
simulator's prediction for the same requests. A table goes to stdout; the last line is one JSON
object with every comparison and the largest relative error. The requests with their measured
latencies and the calibration are kept under --out; `--replay` predicts them again with the
simulator as it is now, so a change to the model can be judged without measuring again.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.checkpoints import is_checkpoint_dir, write_checkpoint
from common.planner.profiles import ProfileSet
from common.planner.trace import read_trace, write_trace
from common.stats import SLO
from tests.planner.validation import DEPLOYMENTS, Comparison, replay, validate


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
    ap.add_argument("--out", type=Path, default=Path(".trident/validation"), help="measurements kept here")
    ap.add_argument("--replay", type=Path, help="predict again what --out kept, without running anything")
    args = ap.parse_args()
    slo = SLO(args.ttft_slo, args.tbt_slo)
    runs = replayed(args.replay, slo) if args.replay else measured(args, slo)
    report: dict = {"calibration": [], "runs": []}
    worst = 0.0
    for preset, method, calibration, comparisons in runs:
        brief = {k: v for k, v in calibration.items() if k != "profiles"}
        print(f"{preset:12} {method:6} calibration {json.dumps(brief)}", flush=True)
        report["calibration"].append({"preset": preset, "method": method, **brief})
        for c in comparisons:
            worst = max([worst, *(abs(e) for e in c.errors.values())])
            report["runs"].append({"preset": preset, "method": method, **c.to_dict()})
            cells = "  ".join(_cell(k, c.measured[k], c.predicted[k]) for k in c.measured)
            print(f"{preset:12} {method:6} {c.rate:7.2f} req/s  {cells}", flush=True)
    report["max_abs_error"] = round(worst, 4)
    print(json.dumps(report))


def measured(args: argparse.Namespace, slo: SLO) -> Iterator[tuple[str, str, dict, list[Comparison]]]:
    """Each preset and method run for real, its measurements saved under --out as they come."""
    rates = [float(x) for x in args.rates.split(",")]
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
                folder = args.out / f"{preset}-{method.replace('+', '-')}"
                save(folder, preset, method, calibration, comparisons)
                yield preset, method, calibration, comparisons


def save(folder: Path, preset: str, method: str, calibration: dict, comparisons: list[Comparison]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    run = {"preset": preset, "method": method, **calibration}
    (folder / "calibration.json").write_text(json.dumps(run, indent=1))
    for c in comparisons:
        write_trace(folder / f"rate-{c.rate:g}.jsonl", c.requests, meta={"rate": c.rate})


def replayed(root: Path, slo: SLO) -> Iterator[tuple[str, str, dict, list[Comparison]]]:
    """What `save` kept, predicted again by today's simulator with the calibration then found."""
    folders = sorted(p.parent for p in root.glob("*/calibration.json"))
    if not folders:
        sys.exit(f"nothing to replay under {root}: run without --replay first")
    for folder in folders:
        calibration = json.loads((folder / "calibration.json").read_text())
        preset, method = calibration.pop("preset"), calibration.pop("method")
        profiles = ProfileSet.from_dict(calibration["profiles"])
        comparisons = []
        for path in sorted(folder.glob("rate-*.jsonl"), key=lambda p: float(p.stem.removeprefix("rate-"))):
            trace = read_trace(path)
            rate = float(trace.meta["rate"])
            comparisons.append(replay(rate, trace.entries, DEPLOYMENTS[method], profiles, slo))
        yield preset, method, calibration, comparisons


if __name__ == "__main__":
    main()
