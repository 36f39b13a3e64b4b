"""What a sweep shows while it runs: a progress bar per rate on stderr, and one summary line per rate
on stdout (`trident bench serve`, `trident bench compare`, bench/ablations.py)."""

from __future__ import annotations

from contextlib import contextmanager

from trident.bench.sweep import Hooks


@contextmanager
def progress_reporter(label: str):
    """A progress bar on stderr (stdout keeps the table and the JSON line), and the hooks a sweep
    reports through that move it and print each rate's summary."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    current: list = []

    def on_start(rate: float, count: int) -> None:
        current[:] = [bar.add_task(f"{label} {rate:g} req/s", total=count)]

    def on_done(_result) -> None:
        bar.advance(current[0])

    def on_rate(s) -> None:
        bar.remove_task(current[0])
        print(format_summary(label, s), flush=True)

    with bar:
        yield Hooks(on_start, on_done, on_rate)


def _ms(value: float | None) -> str:
    return "     -" if value is None else f"{value * 1000:6.0f}"


def format_summary(label: str, s) -> str:
    return (
        f"{label:14} {s.rate:6g} req/s  attainment {100 * s.attainment:5.1f} %  "
        f"TTFT p50/p90 {_ms(s.ttft_p50)}/{_ms(s.ttft_p90)} ms  "
        f"TBT p50/p90 {_ms(s.tbt_p50)}/{_ms(s.tbt_p90)} ms  "
        f"done {s.completed}/{s.sent}  {s.throughput:.2f} req/s" + _reuse_line(s.reuse)
    )


def _reuse_line(reuse: dict | None) -> str:
    """New images against encoder runs, prompt tokens computed against the ideal, where known."""
    if not reuse:
        return ""
    line = f"  images new {reuse['new_images']}"
    if reuse["encoder_runs"] is not None:
        line += f" encoded {reuse['encoder_runs']}"
    line += f"  prompt computed {reuse['computed_tokens']}/{reuse['prompt_tokens']}"
    if reuse["ideal_computed_tokens"] is not None:
        line += f" (ideal {reuse['ideal_computed_tokens']})"
    return line
