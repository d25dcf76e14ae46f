"""What another person wrote, read as data: files bounded in size, encoding and depth; names
held to a pattern; text for the terminal stripped of control characters.

Plans, hardware profiles, HF configs and checkpoint manifests travel between people. A file
from someone else must not exhaust memory (`--hw /dev/zero`), crash the parser (UTF-16,
100,000 nested brackets) or smuggle a newline, a quote or `$(...)` into a batch script or an
escape sequence into the terminal. This module sits on the bottom floor so that every floor
reads such input through the same checks.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator

from hardware.errors import ParallaxError

MAX_FILE_BYTES = 64 * 2**20  # the largest plan or profile seen here is ~200 KB; a checkpoint manifest ~1 MB
MAX_JSON_DEPTH = 64  # a plan nests 6 deep, a profile 5
MAX_NAME_CHARS = 256

# Letters, digits and the punctuation that model ids, paths, factory specs and hardware specs use
# ("Qwen/Qwen2-7B", "./cfg/config.json", "pkg.mod:build", "16xa100-80g+8xh100-sxm", "cpu (EPYC)").
# No quotes, `$`, backquote, `;`, `&`, `|`, `<>`, `\`, brackets or control characters, and no
# leading '-' (it would read as an option on a worker's command line).
NAME = re.compile(r"(?!-)[A-Za-z0-9._+:/@~,()= -]{1,%d}" % MAX_NAME_CHARS)
NAME_HINT = "letters, digits, spaces and . _ + - : / @ ~ , ( ) =, at most 256 characters, not starting with '-'"
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _problem(value: object) -> str | None:
    if not isinstance(value, str) or not NAME.fullmatch(value) or value != value.strip():
        return f"{printable(repr(value))[:80]} is not a safe name"
    return None


def check_name(value: str, field: str = "name") -> str:
    """`value` when it is a safe name, else a ParallaxError naming `field`."""
    problem = _problem(value)
    if problem:
        raise ParallaxError(field, problem, f"use {NAME_HINT}")
    return value


def _name(value: str) -> str:
    problem = _problem(value)
    if problem:
        raise ValueError(f"{problem}: use {NAME_HINT}")
    return value


SafeName = Annotated[str, AfterValidator(_name)]  # a pydantic field type: model, GPU, cluster and profile names


def printable(text: str) -> str:
    """`text` with every control character (escape sequences' ESC included) but tab and
    newline replaced by '?', for the terminal."""
    return _CONTROL.sub("?", str(text))


def read_text(path: Path, field: str, what: str, limit: int = MAX_FILE_BYTES,
              error: type[ParallaxError] = ParallaxError) -> str:
    """The UTF-8 text of `path`, read no further than `limit` bytes (a device or a huge file
    is refused, not swallowed); every problem is one `error` naming `field`."""
    path = Path(path)
    try:
        if path.is_dir():
            raise error(field, f"{path} is a folder, not a {what}", f"give the {what} file itself")
        with open(path, "rb") as handle:
            data = handle.read(limit + 1)
    except FileNotFoundError:
        raise error(field, f"{what} {path} does not exist", f"give an existing {what} file") from None
    except OSError as problem:
        raise error(field, f"cannot read {what} {path}: {problem.strerror or problem}") from None
    if len(data) > limit:
        raise error(field, f"{what} {path} is larger than {limit // 2**20} MiB", f"a {what} is a small JSON file")
    return decode(data, field, f"{what} {path}", error)


def decode(data: bytes, field: str, where: str, error: type[ParallaxError] = ParallaxError) -> str:
    """UTF-8 text, or one line saying the encoding is wrong (a BOM'd UTF-8 file is read)."""
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise error(field, f"{where} is UTF-16", "save it as UTF-8")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as problem:
        raise error(field, f"{where} is not UTF-8 text (byte {problem.start})", "save it as UTF-8") from None


def parse_json(text: str, field: str, where: str, max_depth: int = MAX_JSON_DEPTH,
               error: type[ParallaxError] = ParallaxError) -> object:
    """JSON with its nesting bounded and no NaN or Infinity; every problem is one `error` naming `field`."""
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise error(field, f"{where} nests deeper than {max_depth} levels", "a plan or profile nests a few levels") from None
    except ValueError as problem:
        line = f" at line {problem.lineno}" if isinstance(problem, json.JSONDecodeError) else ""
        message = problem.msg if isinstance(problem, json.JSONDecodeError) else str(problem)
        raise error(field, f"{where} is not valid JSON: {message}{line}") from None
    if depth(data, max_depth) > max_depth:
        raise error(field, f"{where} nests deeper than {max_depth} levels", "a plan or profile nests a few levels")
    return data


def _no_constant(name: str) -> object:
    raise ValueError(f"{name} is not a number JSON allows")


def read_json(path: Path, field: str, what: str, limit: int = MAX_FILE_BYTES,
              error: type[ParallaxError] = ParallaxError) -> object:
    """A bounded, checked JSON file (see `read_text` and `parse_json`)."""
    return parse_json(read_text(path, field, what, limit, error), field, f"{what} {path}", error=error)


def depth(data: object, stop: int) -> int:
    """How deep `data` nests, counted without recursion and no further than `stop + 1`."""
    deepest, todo = 0, [(data, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, level)
            if level > stop:
                return level
            todo.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest
