"""The `parallax` command line: one typer app, one module per command group.

The top of the data flow: it may import every package (hardware, costmodel,
planner, executor); none imports it.

`main` is the console-script entry point; it turns every user-input error
(`ParallaxError`, a pydantic validation error, a missing file) into one line on
stderr and a non-zero exit code, never a traceback.
"""
from __future__ import annotations

import sys

import typer
from pydantic import ValidationError

from hardware.errors import ParallaxError, RunError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Plan, simulate and run parallel training.")


def _register_commands() -> None:
    """Import the command modules; each adds its commands to `app`."""
    import importlib
    import pkgutil

    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")


def _one_line(error: Exception) -> str:
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"]) or "input"
        return " ".join(f"{where}: {first['msg']}".split())
    return " ".join(str(error).split())


def _is_click_error(error: BaseException) -> bool:
    """click's usage errors, whichever click raised them (typer may vendor its own copy)."""
    return any(cls.__name__ == "ClickException" for cls in type(error).__mro__)


def _usage_line(error) -> str:
    """click's message on one line, with the command's --help to try."""
    context = getattr(error, "ctx", None)
    where = f" (see '{context.command_path} --help')" if context is not None else ""
    return f"error: {' '.join(error.format_message().split())}{where}"


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; every failure is one line on stderr and a non-zero exit code:
    2 for wrong input (usage, values, files), 1 for a failed run or an internal error."""
    _register_commands()
    try:
        app(args=argv, standalone_mode=False, prog_name="parallax")
    except (ParallaxError, ValidationError, FileNotFoundError, IsADirectoryError) as error:
        print(f"error: {_one_line(error)}", file=sys.stderr)
        return 1 if isinstance(error, RunError) else 2
    except (typer.Abort, KeyboardInterrupt):
        print("aborted", file=sys.stderr)
        return 1
    except Exception as error:
        if _is_click_error(error):
            print(_usage_line(error), file=sys.stderr)
            return int(getattr(error, "exit_code", 2) or 2)
        print(f"error: internal error, please report it: {type(error).__name__}: "
              f"{' '.join(str(error).split())[:300]}", file=sys.stderr)
        return 1
    return 0


def load_plan(path):
    """A plan file, or one line naming the file and what is wrong with it."""
    from costmodel.plan import Plan
    from hardware.errors import PlanError

    text = path.read_text()
    try:
        return Plan.from_json(text)
    except ValidationError as error:
        mixed = _mixed_mode(text)
        if mixed:  # the report an older Parallax's mixed search wrote, before mixed plans were Plans
            raise PlanError("plan", f"{path} is an older mixed-cluster report ({mixed}), not a plan",
                            "plan the mixed cluster again with `parallax plan MODEL --hw A+B --out FILE`") from None
        raise PlanError("plan", f"{path} is not a valid plan: {_one_line(error)}",
                        "write one with `parallax plan ... --out FILE`") from None


def _mixed_mode(text: str) -> str | None:
    import json

    try:
        data = json.loads(text)
    except ValueError:
        return None
    return data.get("mode") if isinstance(data, dict) and "balance" in data else None


def emit(result, out, as_json: bool) -> bool:
    """Write `result`'s JSON to `out` if given and print it for --json; True when printed
    (the tables are then left out)."""
    if out:
        out.write_text(result.to_json())
    if as_json:
        print(result.to_json())
    return as_json


def entry() -> None:
    sys.exit(main())
