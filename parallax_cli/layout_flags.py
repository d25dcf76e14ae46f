"""The layout's CLI flags, read from the axes' declaration (`layout.axes`).

`plan` pins axes and `estimate` states a layout with the same flags; both take them from
here, so a new axis gets its flag, type and help once. A command decorated with
`layout_flags` receives the flags the user gave as one dict, `axes` (unset ones left out).
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable, Optional

import typer

from layout.axes import AXES, Axis

_FLAGGED = tuple(axis for axis in AXES if axis.pinnable)


def _option(axis: Axis) -> typer.models.OptionInfo:
    decls = (f"{axis.flag}/--no-{axis.flag[2:]}",) if axis.kind is bool else (axis.flag,)
    return typer.Option(None, *decls, help=axis.help, show_default=False)


def layout_flags(command: Callable) -> Callable:
    """`command` with one option per pinnable axis appended; it is called with `axes=`."""
    signature = inspect.signature(command)
    own = [p for p in signature.parameters.values() if p.name != "axes"]
    added = [inspect.Parameter(axis.name, inspect.Parameter.KEYWORD_ONLY, default=_option(axis),
                               annotation=Optional[axis.kind]) for axis in _FLAGGED]

    @functools.wraps(command)
    def with_axes(*args, **kwargs):
        given = {axis.name: kwargs.pop(axis.name) for axis in _FLAGGED if axis.name in kwargs}
        return command(*args, axes={k: v for k, v in given.items() if v is not None}, **kwargs)

    with_axes.__signature__ = signature.replace(parameters=own + added)
    annotations = {k: v for k, v in command.__annotations__.items() if k != "axes"}
    with_axes.__annotations__ = {**annotations, **{p.name: p.annotation for p in added}}
    return with_axes
