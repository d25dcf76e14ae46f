"""Argument lists: the form torchtitan's overrides, Megatron-LM's arguments and the serving
engines' command lines share. Written one option a line (a file a user can read and diff),
read back from such a file or from a whole command line."""
from __future__ import annotations

import shlex

from hardware.errors import FormatError


def write(options: list[tuple[str, object]], header: str) -> str:
    """`--flag value` lines (a bare `--flag` for True, several values for a list; False and None left
    out) under '# ' comments."""
    lines = [f"# {line}" for line in header.splitlines()]
    for flag, value in options:
        if value is True:
            lines.append(flag)
        elif isinstance(value, list):
            lines.append(" ".join([flag, *(shlex.quote(str(v)) for v in value)]))
        elif value is not False and value is not None:
            lines.append(f"{flag} {shlex.quote(str(value))}")
    return "\n".join(lines) + "\n"


def read(text: str, tool: str) -> dict[str, str | bool]:
    """{'--flag': value} from a file of such lines or a command line; a flag with no value is True,
    one with several values a list. '--a.b=v' and '--a.b v' both read; words before the first flag
    (the program and its arguments) are skipped."""
    found: dict[str, str | bool | list[str]] = {}
    words = split(text, tool)
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("--"):
            continue
        flag, eq, value = word.partition("=")
        values = [value] if eq else []
        while not eq and i < len(words) and not words[i].startswith("--"):
            values.append(words[i])
            i += 1
        found[flag] = True if not values else values[0] if len(values) == 1 else values
    if not found:
        raise FormatError("--from", f"no --flag found: not a {tool} argument list", "one --flag value per line")
    return found


def split(text: str, tool: str) -> list[str]:
    """The words of an argument file or command line, '#' comment lines and line continuations dropped."""
    body = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    try:
        return shlex.split(body.replace("\\\n", " "))
    except ValueError as error:
        raise FormatError("--from", f"not a {tool} argument list: {error}", "one --flag value per line") from None


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
