"""The `trident` command line: model preparation now, serving commands as they land."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from common.checkpoints import PRESETS
from trident.cli.bench import bench_app
from trident.cli.bundle import bundle
from trident.cli.certs import certs
from trident.cli.generate import generate
from trident.cli.kubernetes import kubernetes
from trident.cli.plan import plan
from trident.cli.top import top
from trident.cli.up import down, follow_plan, up

app = typer.Typer(
    name="trident",
    help="Trident: disaggregated encode/prefill/decode serving for multimodal LLMs.",
    no_args_is_help=True,
    add_completion=False,
)

# An enum makes typer reject unknown presets with a usage error that lists the valid ones.
PresetName = StrEnum("PresetName", {name: name for name in PRESETS})
DEFAULT_PRESET = PresetName("tiny-llava")
# --help lists the presets by family, in this order (then any family not named here), in the option's help
# text, which wraps between whole names.
FAMILY_TITLES = {
    "llava": "LLaVA-1.5",
    "llava_next": "LLaVA-NeXT",
    "qwen2_vl": "Qwen2-VL",
    "qwen2_5_vl": "Qwen2.5-VL",
    "qwen3_vl": "Qwen3-VL",
}
PRESET_HELP = "Model shapes to generate. " + " ".join(
    f"{FAMILY_TITLES.get(family, family)}: {', '.join(n for n, p in PRESETS.items() if p.family == family)}."
    # A stable sort: families without a title follow the titled ones, in the order PRESETS has them.
    for family in sorted(
        dict.fromkeys(p.family for p in PRESETS.values()),
        key=lambda family: [*FAMILY_TITLES, family].index(family),
    )
)


@app.callback()
def main() -> None:
    """Trident: disaggregated encode/prefill/decode serving for multimodal LLMs."""
    # An explicit callback keeps `app` a command group, so `trident make-model ...` keeps its subcommand
    # name even while it is the only command.


@app.command("make-model")
def make_model(
    directory: Annotated[Path, typer.Argument(metavar="DIR", help="Where to write the checkpoint.")],
    preset: Annotated[PresetName, typer.Option(metavar="PRESET", help=PRESET_HELP)] = DEFAULT_PRESET,
    seed: Annotated[int, typer.Option(min=0, help="The weights depend only on (preset, seed).")] = 0,
    force: Annotated[bool, typer.Option("--force", help="Replace DIR if it holds a checkpoint.")] = False,
) -> None:
    """Write a random-weight HF-format checkpoint (config, weights, tokenizer, ...) of any preset's family:
    LLaVA-1.5, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL or Qwen3-VL."""
    from common.checkpoints import CheckpointExistsError, count_parameters, write_checkpoint  # transformers

    try:
        path = write_checkpoint(directory, preset=preset.value, seed=seed, overwrite=force)
    except CheckpointExistsError as exc:
        hint = "pass --force to replace it" if exc.replaceable else "choose a new or empty directory"
        raise typer.BadParameter(f"{exc}; {hint}", param_hint="DIR") from None
    typer.echo(f"directory: {path}")
    typer.echo(f"preset: {preset.value}")
    typer.echo(f"seed: {seed}")
    typer.echo(f"parameters: {count_parameters(preset.value)}")


app.command("generate")(generate)
app.command("up")(up)
app.command("down")(down)
app.command("follow-plan")(follow_plan)
app.command("plan")(plan)
app.command("top")(top)
app.command("certs")(certs)
app.command("kubernetes")(kubernetes)
app.command("bundle")(bundle)
app.add_typer(bench_app, name="bench")
