"""The `parallax` command line: one typer app, one module per command group.

`main` is the console-script entry point; it turns every user-input error
(`ParallaxError`, a pydantic validation error, a missing file) into one line on
stderr and a non-zero exit code, never a traceback.
"""
from __future__ import annotations

import sys

import typer
from pydantic import ValidationError

from hardware.errors import ParallaxError

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
        return f"{where}: {first['msg']}"
    return str(error)


def main(argv: list[str] | None = None) -> int:
    _register_commands()
    try:
        app(args=argv, standalone_mode=False)
    except (ParallaxError, ValidationError, FileNotFoundError) as error:
        print(f"error: {_one_line(error)}", file=sys.stderr)
        return 2
    except typer.Abort:
        print("aborted", file=sys.stderr)
        return 1
    except Exception as error:  # click's own usage errors
        import click

        if isinstance(error, click.ClickException):
            error.show()
            return error.exit_code
        raise
    return 0


def entry() -> None:
    sys.exit(main())
