"""The `parallax` command line: one typer app, one module per command group.

The top of the data flow: it may import every package (hardware, costmodel,
planner, executor); none imports it.

`main` is the console-script entry point; it turns every user-input error
(`ParallaxError`, a pydantic validation error, a missing file) into one line on
stderr and a non-zero exit code, never a traceback.
"""
from __future__ import annotations

import sys
import warnings

import typer
from pydantic import ValidationError

from hardware.errors import Interrupted, ParallaxError, RunError
from hardware.untrusted import check_name, printable, read_json

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
        message = first["msg"].removeprefix("Value error, ")  # a model rule's own text names its field
        where = ".".join(str(part) for part in first["loc"])
        return printable(" ".join((f"{where}: {message}" if where else message).split()))
    return printable(" ".join(str(error).split()))


def _is_click_error(error: BaseException) -> bool:
    """click's usage errors, whichever click raised them (typer may vendor its own copy)."""
    return any(cls.__name__ == "ClickException" for cls in type(error).__mro__)


def _usage_line(error) -> str:
    """click's message on one line, with the command's --help to try."""
    context = getattr(error, "ctx", None)
    where = f" (see '{context.command_path} --help')" if context is not None else ""
    return f"error: {' '.join(error.format_message().split())}{where}"


def _raise_interrupted(signum, frame) -> None:  # noqa: ARG001 - signal's handler signature
    raise Interrupted(signum)


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; every failure is one line on stderr and a non-zero exit code:
    2 for wrong input (usage, values, files), 1 for a failed run or an internal error,
    130 for Ctrl-C and 143 for SIGTERM (the shell's codes for those signals)."""
    previous = _on_sigterm(_raise_interrupted)
    shown, warnings.showwarning = warnings.showwarning, _note
    try:
        _register_commands()  # inside: Ctrl-C while torch imports is an interrupt like any other
        code = app(args=argv, standalone_mode=False, prog_name="parallax")
        if code == 130:  # typer turns Ctrl-C inside a command into Exit(130), returned when not standalone
            raise KeyboardInterrupt
    except (ParallaxError, ValidationError, FileNotFoundError, IsADirectoryError) as error:
        _say(f"error: {_one_line(error)}")
        return 1 if isinstance(error, RunError) else 2
    except (typer.Abort, KeyboardInterrupt):
        _say("interrupted")
        return 130
    except Interrupted as interrupted:  # SIGTERM, or a signal `parallax run` passed on to torchrun
        _say(str(interrupted))
        return interrupted.exit_code
    except OSError as error:  # a path the user named: --out into a folder that is a file, read-only, full
        where = f": {error.filename}" if error.filename else ""
        _say(f"error: {error.strerror or type(error).__name__}{where}")
        return 2
    except Exception as error:
        if _is_click_error(error):
            _say(_usage_line(error))
            return int(getattr(error, "exit_code", 2) or 2)
        _say(f"error: internal error, please report it: {type(error).__name__}: "
             f"{' '.join(str(error).split())[:300]}")
        return 1
    finally:
        _on_sigterm(previous)
        warnings.showwarning = shown
    return 0


def _note(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ARG001 - showwarning's signature
    """A warning (the tracer's, a library's) as one `note:` line, not Python's file:line form."""
    _say(f"note: {' '.join(str(message).split())[:300]}")


def _say(line: str) -> None:
    """One line on stderr, with no control character from the input that caused it."""
    print(printable(line), file=sys.stderr)


def _on_sigterm(handler):
    """Install `handler` for SIGTERM where this thread may (the main thread); the previous one."""
    import signal
    import threading

    if handler is None or threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, handler)


TRUST_MODULE_HELP = "build the plan's module factory (pkg.mod:function): this imports and runs its code"


def check_model(model: str | None, trust_module: bool) -> None:
    """A model name from a plan or --model: a safe name, and a module factory only when trusted."""
    from planner.factory import names_factory, refuse_untrusted

    if model is None:
        return
    check_name(model, "model")
    if names_factory(model) and not trust_module:
        raise refuse_untrusted(model)


def load_plan(path, trust_module: bool = False):
    """A plan file, or one line naming the file and what is wrong with it: read bounded,
    UTF-8, nesting and numbers checked (`hardware.untrusted`); a plan naming a module
    factory is refused unless the user trusts it."""
    plan = _read_plan(path)
    check_model(plan.model, trust_module)
    return plan


def _read_plan(path):
    from layout.plan import Plan
    from hardware.errors import PlanError

    data = read_json(path, "plan", "plan")
    try:
        return Plan.model_validate(data)
    except ValidationError as error:
        if is_serving_plan(data):
            raise PlanError("plan", f"{path} is a serving plan (from `parallax serve-plan`), not a training plan",
                            "export it with `parallax export FILE --to vllm`, sglang or trtllm; plan training with "
                            "`parallax plan ... --out FILE`") from None
        mixed = _mixed_mode(data)
        if mixed:  # the report an older Parallax's mixed search wrote, before mixed plans were Plans
            raise PlanError("plan", f"{path} is an older mixed-cluster report ({mixed}), not a plan",
                            "plan the mixed cluster again with `parallax plan MODEL --hw A+B --out FILE`") from None
        raise PlanError("plan", f"{path} is not a valid plan: {_one_line(error)}",
                        "write one with `parallax plan ... --out FILE`") from None


def is_serving_plan(data: object) -> bool:
    """Whether a plan file's JSON is what `serve-plan --out` writes (a serving plan states its prompt length)."""
    return isinstance(data, dict) and "prompt_len" in data


def _mixed_mode(data: object) -> str | None:
    return data.get("mode") if isinstance(data, dict) and "balance" in data else None


def emit(result, out, as_json: bool) -> bool:
    """Write `result`'s JSON to `out` if given and print it for --json; True when printed
    (the tables are then left out)."""
    if out:
        write_output(out, result.to_json())
    if as_json:
        print(result.to_json())
    return as_json


def write_output(path, text: str, option: str = "--out") -> None:
    """Write a file the user named; a path that cannot be written is one line naming the option."""
    try:
        path.write_text(text)
    except OSError as error:
        raise ParallaxError(option, f"cannot write {path}: {error.strerror or error}",
                            "name a file in a folder you can write") from None


def wide_console(stderr: bool = False):
    """A rich console for tables: the terminal's width, and on a pipe or file wide enough that
    no line is wrapped mid-phrase (rich's default there is 80 columns)."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else 400)


def entry() -> None:
    sys.exit(main())
