"""The field's own benchmark clients against our gateway, at one rate, with image requests.

    bash bench/third_party/setup.sh        # once: the clients' venvs
    python bench/third_party/run.py --url http://127.0.0.1:8123 --model-dir .trident/models/tiny-llava \\
        --rate 2 --num-prompts 40 --ttft-slo 2 --tbt-slo 0.5

Papers and reviewers quote `vllm bench serve` and NVIDIA's aiperf, not our client, so the same
deployment is measured by both, each sending one synthetic image per request with a fixed output
length (`ignore_eos`), Poisson arrivals at `--rate`, and goodput against the SLOs:

* vllm: `--backend openai-chat --dataset-name random-mm`, `--goodput ttft:MS tpot:MS`.
* aiperf: `--endpoint-type chat --streaming`, noise images, server token counts,
  `--goodput time_to_first_token:MS inter_token_latency:MS`.

Both tools judge the TBT objective on each request's *mean* gap after the first token (vllm's TPOT,
aiperf's inter_token_latency), while our gateway's trace and `trident bench serve` use each
request's p90 gap: with steady decoding they agree, with stalls the third-party goodput is higher.
`itl` is per SSE chunk (vllm's ITL, aiperf's inter_chunk_latency). The gateway's own mean TTFT over
each run (from its /metrics) is printed beside, so client-side overhead shows as the difference,
and so is the CPU time each client used: where client and server share the machine's cores, a
client that needs more CPU slows the server it measures.

A table goes to stdout, then one JSON object on the last line. Stdlib only: any Python 3.11 runs it.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import resource
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
VLLM = HERE / ".venv-vllm" / "bin" / "vllm"
AIPERF = HERE / ".venv-aiperf" / "bin" / "aiperf"
TOOLS = ("vllm", "aiperf", "trident")
TRIDENT = HERE.parents[1] / ".venv" / "bin" / "trident"  # our own client, `trident bench serve`
Summary = dict[str, float | int | None]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="gateway base URL, e.g. http://127.0.0.1:8123")
    p.add_argument("--model-dir", required=True, type=Path, help="the served checkpoint (its tokenizer)")
    p.add_argument("--rate", required=True, type=float, help="requests per second")
    p.add_argument(
        "--arrival", choices=("poisson", "constant"), default="poisson", help="gaps between requests"
    )
    p.add_argument("--num-prompts", required=True, type=int)
    p.add_argument("--ttft-slo", required=True, type=float, help="seconds")
    p.add_argument("--tbt-slo", required=True, type=float, help="seconds, on each request's mean TBT")
    p.add_argument("--out", type=Path, help="result folder (default bench/out/third_party/<time>)")
    p.add_argument("--model", help="served model name (default: the first of GET /v1/models)")
    p.add_argument("--input-len", type=int, default=64, help="text tokens per prompt")
    p.add_argument("--output-len", type=int, default=32, help="output tokens per request (ignore_eos)")
    p.add_argument("--image-size", type=int, default=256, help="square image side, pixels")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tools", default=",".join(TOOLS), help="comma-separated subset of vllm,aiperf,trident")
    return p.parse_args(argv)


def check_venvs(tools: list[str]) -> None:
    exes = {"vllm": VLLM, "aiperf": AIPERF, "trident": TRIDENT}
    missing = [str(exes[t]) for t in tools if not exes[t].exists()]
    if missing:
        sys.exit(f"missing {', '.join(missing)}: run bench/third_party/setup.sh first")


def get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.read().decode()


def served_model(url: str, model: str | None) -> str:
    """GET /health first, as the clients' users do, then the served model's name (the first listed
    unless given)."""
    try:
        get(f"{url}/health")
        return model or json.loads(get(f"{url}/v1/models"))["data"][0]["id"]
    except OSError as exc:
        sys.exit(f"cannot reach the gateway at {url}: {exc}")


def gateway_ttft(url: str) -> tuple[float, float]:
    """(sum, count) of the gateway's TTFT histogram: the server-side view to set beside the clients'."""
    text = get(f"{url}/metrics")
    total = re.search(r"^trident_gateway_ttft_seconds_sum (\S+)$", text, re.M)
    count = re.search(r"^trident_gateway_ttft_seconds_count (\S+)$", text, re.M)
    return (float(total[1]) if total else 0.0, float(count[1]) if count else 0.0)


def run_logged(cmd: list[str], log: Path, timeout: float) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        f.write(" ".join(cmd) + "\n\n")
        f.flush()
        try:
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            sys.exit(f"{cmd[0]} ran past {timeout:.0f} s; log {log}")
    if code != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-25:])
        sys.exit(f"{cmd[0]} exited with {code}; log {log}:\n{tail}")


def vllm_command(a: argparse.Namespace, model: str, out: Path) -> list[str]:
    ms = {"ttft": a.ttft_slo * 1000, "tpot": a.tbt_slo * 1000}
    return [
        str(VLLM), "bench", "serve",
        "--backend", "openai-chat", "--endpoint", "/v1/chat/completions",
        "--base-url", a.url, "--model", model, "--tokenizer", str(a.model_dir),
        "--dataset-name", "random-mm", "--num-prompts", str(a.num_prompts),
        "--random-input-len", str(a.input_len), "--random-output-len", str(a.output_len),
        "--random-range-ratio", "0",
        "--random-mm-base-items-per-request", "1", "--random-mm-num-mm-items-range-ratio", "0",
        "--random-mm-limit-mm-per-prompt", '{"image": 1, "video": 0}',
        "--random-mm-bucket-config", f"{{({a.image_size}, {a.image_size}, 1): 1.0}}",
        "--request-rate", str(a.rate), "--burstiness", "1" if a.arrival == "poisson" else "inf",
        "--ignore-eos", "--seed", str(a.seed),
        "--goodput", f"ttft:{ms['ttft']:g}", f"tpot:{ms['tpot']:g}",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", "result.json",
        "--disable-tqdm",
    ]  # fmt: skip


def aiperf_command(a: argparse.Namespace, model: str, out: Path) -> list[str]:
    goodput = f"time_to_first_token:{a.ttft_slo * 1000:g} inter_token_latency:{a.tbt_slo * 1000:g}"
    return [
        str(AIPERF), "profile",
        "--model", model, "--url", a.url, "--endpoint-type", "chat", "--streaming",
        "--tokenizer", str(a.model_dir), "--use-server-token-count",
        "--request-rate", str(a.rate), "--arrival-pattern", a.arrival, "--request-count", str(a.num_prompts),
        "--prompt-input-tokens-mean", str(a.input_len), "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", str(a.output_len), "--prompt-output-tokens-stddev", "0",
        "--extra-inputs", "ignore_eos:true",
        "--image-batch-size", "1", "--image-format", "jpeg",
        "--image-width-mean", str(a.image_size), "--image-width-stddev", "0",
        "--image-height-mean", str(a.image_size), "--image-height-stddev", "0",
        "--goodput", goodput, "--random-seed", str(a.seed),
        "--output-artifact-dir", str(out), "--no-server-metrics", "--no-gpu-telemetry", "--ui-type", "none",
    ]  # fmt: skip


def arrival_rate(starts: list[float]) -> float | None:
    """Requests per second as actually sent: the tools draw Poisson gaps differently (vllm rescales
    its draw so the last request goes out at N/rate; aiperf does not), so at one `--rate` their
    throughputs differ by the draw, and this says by how much."""
    span = max(starts) - min(starts) if starts else 0.0
    return (len(starts) - 1) / span if span > 0 else None


def vllm_summary(result: dict) -> Summary:
    done = result.get("completed") or 0
    return {
        "completed": done,
        "failed": result.get("failed"),
        "arrival_rate": arrival_rate(result.get("start_times") or []),
        "prompt_tokens_mean": result["total_input_tokens"] / done if done else None,  # server usage
        "output_tokens_mean": result["total_output_tokens"] / done if done else None,
        "request_throughput": result.get("request_throughput"),
        "goodput": result.get("request_goodput"),
        **{f"{m}_p{q}_ms": result.get(f"p{q}_{m}_ms") for m in ("ttft", "tpot", "itl") for q in (50, 90, 99)},
    }


def aiperf_summary(result: dict, records: list[dict]) -> Summary:
    def stat(metric: str, key: str) -> float | None:
        return (result.get(metric) or {}).get(key)

    starts = [r["metadata"]["request_start_ns"] / 1e9 for r in records if "request_start_ns" in r["metadata"]]
    names = {"ttft": "time_to_first_token", "tpot": "inter_token_latency", "itl": "inter_chunk_latency"}
    return {
        "completed": int(stat("completed_request_count", "avg") or stat("request_count", "avg") or 0),
        "failed": sum(e.get("count", 0) for e in result.get("error_summary") or []),
        "arrival_rate": arrival_rate(starts),
        "prompt_tokens_mean": stat("usage_prompt_tokens", "avg"),
        "output_tokens_mean": stat("usage_completion_tokens", "avg"),
        "request_throughput": stat("request_throughput", "avg"),
        "goodput": stat("goodput", "avg"),
        **{f"{m}_p{q}_ms": stat(name, f"p{q}") for m, name in names.items() for q in (50, 90, 99)},
    }


def cpu_seconds() -> float:
    """CPU time (user + system) of this process's finished children, their own children included."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(tool: str, a: argparse.Namespace, model: str, out: Path) -> Summary:
    """Run one tool and summarise its result file, with the gateway's mean TTFT over the run and
    the CPU time the client itself used (on a machine the server shares, a busier client slows it)."""
    before, cpu = gateway_ttft(a.url), cpu_seconds()
    timeout = 3 * a.num_prompts / a.rate + 600
    if tool == "vllm":
        run_logged(vllm_command(a, model, out / "vllm"), out / "vllm" / "log.txt", timeout)
        summary = vllm_summary(json.loads((out / "vllm" / "result.json").read_text()))
    elif tool == "trident":
        run_logged(trident_command(a, model, out / "trident"), out / "trident" / "log.txt", timeout)
        summary = trident_summary(json.loads((out / "trident" / "results.json").read_text()))
    else:
        run_logged(aiperf_command(a, model, out / "aiperf"), out / "aiperf" / "log.txt", timeout)
        result = json.loads((out / "aiperf" / "profile_export_aiperf.json").read_text())
        records = (out / "aiperf" / "profile_export.jsonl").read_text().splitlines()
        summary = aiperf_summary(result, [json.loads(line) for line in records if line.strip()])
    summary["client_cpu_s"] = cpu_seconds() - cpu
    after = gateway_ttft(a.url)
    served = after[1] - before[1]
    summary["gateway_ttft_mean_ms"] = (after[0] - before[0]) / served * 1000 if served else None
    return summary


def trident_command(a: argparse.Namespace, model: str, out: Path) -> list[str]:
    """`trident bench serve` replaying a trace of the same requests: `input_len` words of text, one
    image of `image_size` pixels, `output_len` tokens, arriving at `rate` (Poisson or constant)."""
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    t, lines = 0.0, [json.dumps({"format": "trident-trace", "version": 1})]
    for _ in range(a.num_prompts):
        lines.append(
            json.dumps(
                {
                    "arrival": t,
                    "prompt_tokens": a.input_len,
                    "num_images": 1,
                    "image_tokens": 0,
                    "output_tokens": a.output_len,
                    "image_sizes": [[a.image_size, a.image_size]],
                }
            )
        )
        t += rng.expovariate(a.rate) if a.arrival == "poisson" else 1 / a.rate
    trace = out / "trace.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    return [
        str(TRIDENT), "bench", "serve", "--url", a.url, "--model", model, "--trace", str(trace),
        "--rate", str(a.rate), "--duration", str(a.num_prompts / a.rate + 1), "--ttft-slo", str(a.ttft_slo),
        "--tbt-slo", str(a.tbt_slo), "--every-rate", "--name", "trident", "--out", str(out),
    ]  # fmt: skip


def trident_summary(result: dict) -> Summary:
    """Ours judges TBT on each request's p90 gap (the others on its mean); `goodput` here is the
    requests that met both SLOs per second, as theirs is."""
    r = result["rates"][0]

    def ms(key: str) -> float | None:
        return None if r[key] is None else r[key] * 1000

    return {
        "completed": r["completed"],
        "failed": r["failed"],
        "request_throughput": r["throughput"],
        "goodput": r["attainment"] * r["sent"] / r["duration"] if r["duration"] else None,
        "ttft_p50_ms": ms("ttft_p50"),
        "ttft_p90_ms": ms("ttft_p90"),
        "ttft_p99_ms": ms("ttft_p99"),
        "itl_p50_ms": ms("tbt_p50"),
        "itl_p90_ms": ms("tbt_p90"),
    }


def table(results: dict[str, Summary]) -> str:
    rows = list(next(iter(results.values())))
    width = max(len(r) for r in rows)
    lines = [f"{'':{width}}  " + "  ".join(f"{t:>10}" for t in results)]
    for row in rows:
        cells = []
        for summary in results.values():
            v = summary.get(row)
            text = "-" if v is None else str(v) if isinstance(v, int) else f"{v:.2f}"
            cells.append(f"{text:>10}")
        lines.append(f"{row:{width}}  " + "  ".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    tools = [t for t in a.tools.split(",") if t]
    if unknown := set(tools) - set(TOOLS):
        sys.exit(f"unknown tools {sorted(unknown)}; choose from {', '.join(TOOLS)}")
    check_venvs(tools)
    a.url = a.url.rstrip("/")
    a.model_dir = a.model_dir.resolve()
    model = served_model(a.url, a.model)
    out = (a.out or HERE.parent / "out" / "third_party" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    results: dict[str, Summary] = {}
    for tool in tools:
        print(f"{tool}: {a.num_prompts} requests at {a.rate:g} req/s ...", flush=True)
        results[tool] = measure(tool, a, model, out)
    config = {
        "url": a.url,
        "model": model,
        "model_dir": str(a.model_dir),
        "rate": a.rate,
        "arrival": a.arrival,
        "num_prompts": a.num_prompts,
        "input_len": a.input_len,
        "output_len": a.output_len,
        "images_per_request": 1,
        "image_size": a.image_size,
        "ttft_slo_ms": a.ttft_slo * 1000,
        "tbt_slo_ms": a.tbt_slo * 1000,
        "seed": a.seed,
        "out": str(out),
    }
    print(table(results))
    print(f"logs and result files in {out}")
    print(json.dumps({**results, "config": config}))


if __name__ == "__main__":
    main()
