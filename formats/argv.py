"""Argument lists: the form torchtitan's overrides, Megatron-LM's arguments and the serving
engines' command lines share. Written one option a line (a file a user can read and diff),
read back from such a file or from a whole command line."""
from __future__ import annotations

import shlex

from hardware.errors import FormatError


def write(options: list[tuple[str, object]], header: str) -> str:
    """`--flag value` lines (a bare `--flag` for True; False and None left out) under '# ' comments."""
    lines = [f"# {line}" for line in header.splitlines()]
    for flag, value in options:
        if value is True:
            lines.append(flag)
        elif value is not False and value is not None:
            lines.append(f"{flag} {shlex.quote(str(value))}")
    return "\n".join(lines) + "\n"


def read(text: str, tool: str) -> dict[str, str | bool]:
    """{'--flag': value} from a file of such lines or a command line; a flag with no value is True.
    '--a.b=v' and '--a.b v' both read; words before the first flag (the program) are skipped."""
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    try:
        words = shlex.split(body.replace("\\\n", " "))
    except ValueError as error:
        raise FormatError("--from", f"not a {tool} argument list: {error}", "one --flag value per line") from None
    found: dict[str, str | bool] = {}
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("--"):
            continue
        flag, eq, value = word.partition("=")
        if eq:
            found[flag] = value
        elif i < len(words) and not words[i].startswith("--"):
            found[flag] = words[i]
            i += 1
        else:
            found[flag] = True
    if not found:
        raise FormatError("--from", f"no --flag found: not a {tool} argument list", "one --flag value per line")
    return found


def whole(found: dict, flag: str, tool: str, low: int = 1) -> int | None:
    """`flag`'s value as a whole number >= `low`, or None when absent."""
    if flag not in found:
        return None
    value = found[flag]
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise FormatError(flag, f"{value!r} is not a whole number", f"{tool} takes an integer here") from None
    if number < low:
        raise FormatError(flag, f"{number} is below {low}", f"{tool} takes an integer >= {low} here")
    return number


def truth(found: dict, flag: str) -> bool:
    """A switch: present bare, or given true/false as torchtitan's and the engines' parsers accept."""
    value = found.get(flag, False)
    if isinstance(value, bool):
        return value
    return str(value).lower() in ("1", "true", "yes", "on")
