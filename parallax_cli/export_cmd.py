"""`parallax export`: a plan in the format of the tool that will run it."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from hardware.errors import PlanError
from hardware.untrusted import read_json
from parallax_cli import _one_line, app, is_serving_plan, load_plan, write_output

FORMATS_HELP = "torchtitan, deepspeed, accelerate or megatron (training plans); vllm, sglang or trtllm (serving plans)"


def load_any_plan(path: Path):
    """A training plan, or a serving plan (`parallax serve-plan --out`), from its JSON file."""
    data = read_json(path, "plan", "plan")
    if is_serving_plan(data):
        from pydantic import ValidationError

        from planner.inference import InferencePlan

        try:
            return InferencePlan.model_validate(data)
        except ValidationError as error:
            raise PlanError("plan", f"{path} is not a valid serving plan: {_one_line(error)}",
                            "write one with `parallax serve-plan ... --out FILE`") from None
    return load_plan(path, trust_module=True)  # exporting builds nothing: a module factory is only a name here


@app.command("export")
def export_command(
    plan_file: Path = typer.Argument(..., help="a plan JSON from `parallax plan --out` or `parallax serve-plan --out`"),
    to: str = typer.Option(..., "--to", help=FORMATS_HELP),
    out: Optional[Path] = typer.Option(None, "--out", help="write the file here (default: print it)"),
    lossy: bool = typer.Option(False, "--lossy", help="export even where the tool cannot express a field of the "
                               "plan; each such field is named"),
) -> None:
    """Write PLAN in the format a training or serving tool takes, with the command that runs it."""
    from formats import check_format, export

    check_format(to)
    exported = export(load_any_plan(plan_file), to, lossy)
    for lost in exported.lost:
        typer.echo(f"not expressed in {to}: {lost}", err=True)
    if out is None:
        typer.echo(exported.text, nl=False)
    else:
        write_output(out, exported.text)
        typer.echo(f"wrote {out}")
    typer.echo(f"run: {exported.launch.replace('FILE', str(out) if out else 'FILE')}", err=out is None)
