"""`trident generate`: one request through the in-process engine, for trying a checkpoint quickly."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer


def generate(
    prompt: Annotated[str, typer.Option("--prompt", help="The user's message.")],
    model: Annotated[
        str | None,
        typer.Option(
            help="A checkpoint directory, or a preset name (tiny-llava, small-llava, ...; `trident "
            "make-model --help` lists them) written to .trident/models/<preset> on first use; "
            "default: tiny-llava."
        ),
    ] = None,
    image: Annotated[list[Path] | None, typer.Option(help="Image file; repeat for several images.")] = None,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Most tokens to generate.")] = 64,
    temperature: Annotated[float, typer.Option(help="0 is greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="0 means no top-k cut.")] = 0,
    seed: Annotated[int | None, typer.Option(help="Makes sampled output reproducible.")] = None,
    stop: Annotated[list[str] | None, typer.Option(help="Stop string; repeat for several.")] = None,
    device: Annotated[str, typer.Option(help="cpu or cuda[:N].")] = "cpu",
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object on the last line.")] = False,
) -> None:
    """Answer one prompt (with optional images) using the in-process engine."""
    from common.engine import Engine, EngineConfig, SamplingParams
    from common.engine.loader import CheckpointError
    from common.engine.processor import InputError
    from common.models import resolve_model

    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=tuple(stop or ()),
        )
        engine = Engine(resolve_model(model, say=typer.echo), EngineConfig(device=device))
        start = time.perf_counter()
        done = engine.generate([engine.chat_prompt(prompt, len(image or []))], [list(image or [])], params)[0]
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
