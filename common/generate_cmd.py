"""`trident generate`: one request through the in-process engine, for trying a checkpoint quickly."""

from __future__ import annotations

import json
import time
from pathlib import Path

import typer

DEFAULT_MODEL = Path(".trident/models/tiny-llava")


def default_model() -> Path:
    """The tiny demo checkpoint, written on first use (deterministic, seed 0)."""
    from common.checkpoints import is_checkpoint_dir, write_checkpoint

    if not is_checkpoint_dir(DEFAULT_MODEL):
        write_checkpoint(DEFAULT_MODEL, "tiny-llava", seed=0)
    return DEFAULT_MODEL


def generate(
    prompt: str = typer.Option(..., "--prompt", help="The user's message."),
    model: Path | None = typer.Option(None, "--model", help="HF-format checkpoint dir (default: tiny demo)."),
    image: list[Path] = typer.Option([], "--image", help="Image file; repeat for several images."),  # noqa: B008
    max_tokens: int = typer.Option(64, "--max-tokens", help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, "--temperature", help="0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0 means no top-k cut."),
    seed: int | None = typer.Option(None, "--seed", help="Makes sampled output reproducible."),
    stop: list[str] = typer.Option([], "--stop", help="Stop string; repeat for several."),  # noqa: B008
    device: str = typer.Option("cpu", "--device", help="cpu or cuda[:N]."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object on the last line."),
) -> None:
    """Answer one prompt (with optional images) using the in-process engine."""
    from common.engine import Engine, EngineConfig, SamplingParams
    from common.engine.loader import CheckpointError
    from common.engine.processor import InputError

    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=tuple(stop),
        )
        engine = Engine(model or default_model(), EngineConfig(device=device))
        start = time.perf_counter()
        done = engine.generate([engine.chat_prompt(prompt, len(image))], [list(image)], params)[0]
        seconds = time.perf_counter() - start
    except (CheckpointError, InputError, ValueError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if not as_json:
        typer.echo(done.text)
        return
    usage = {"prompt_tokens": done.num_prompt_tokens, "completion_tokens": len(done.token_ids)}
    result = {
        "text": done.text,
        "token_ids": done.token_ids,
        "finish_reason": done.finish_reason,
        "usage": usage,
        "seconds": round(seconds, 4),
    }
    typer.echo(json.dumps(result))
