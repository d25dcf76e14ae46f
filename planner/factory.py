"""A user's own module class as a planning door: `pkg.mod:factory`, built on the meta device.

`parallax plan --module pkg.mod:factory --example-shape 1,2048` imports the factory (the
current directory first, as `python -m` does), calls it under `torch.device("meta")` so
that no weight is allocated, and hands the module with token ids of that shape to
`planner.plan`. The plan records the spec as its model, and `parallax run` builds the
module through the same factory on every rank (`executor.runtime.models.build_model`).

What the executor splits is checked first, with one line naming what was found: a
container of repeated blocks (its layer map, `planner.executable.block_container`)
and nn.Linear weights (what tensor parallelism splits and the cost model prices as
GEMMs).
"""
from __future__ import annotations

import importlib
import os
import sys

from hardware.errors import ModelError

from planner.executable import block_container

EXAMPLE = "e.g. mypkg.model:build, a function returning the nn.Module"


TRUST_FLAG = "--trust-module"


def names_factory(model: str) -> bool:
    """Whether a plan's model is a module factory ("pkg.mod:build"), whose building runs the user's code."""
    return ":" in model and model.partition(":")[0].replace(".", "").replace("_", "").isalnum()


def refuse_untrusted(spec: str) -> ModelError:
    """The one-line refusal of a plan that names a module factory the user has not trusted."""
    return ModelError("model", f"{spec} is a module factory: building it imports and runs its code",
                      f"pass {TRUST_FLAG} if you trust it")


def factory_folder(spec: str) -> str:
    """The folder the factory's top package is imported from (the workers' path gets it, not the
    current folder); refused in one line when it does not import."""
    import importlib.util

    top = spec.partition(":")[0].split(".")[0]
    with _cwd_on_path():
        found = importlib.util.find_spec(top)
    if found is None or not (found.origin or found.submodule_search_locations):
        raise ModelError("model", f"cannot find the package of {spec}", "run from the folder that holds it")
    if found.submodule_search_locations:  # a package: the folder above it
        return os.path.dirname(list(found.submodule_search_locations)[0])
    return os.path.dirname(found.origin)


class _cwd_on_path:
    """The current folder at the front of sys.path for one import, as `python -m` would have it."""

    def __enter__(self):
        self.added = os.getcwd() not in sys.path
        if self.added:
            sys.path.insert(0, os.getcwd())

    def __exit__(self, *exc):
        if self.added and os.getcwd() in sys.path:
            sys.path.remove(os.getcwd())


def load_factory(spec: str, field: str = "--module"):
    """The callable `spec` ("package.module:function") names; errors name `field`."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ModelError(field, f"{spec!r} is not package.module:function", EXAMPLE)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except ImportError as error:
        raise ModelError(field, f"cannot import {module_name!r}: {error}", EXAMPLE) from None
    except AttributeError:
        raise ModelError(field, f"{module_name!r} has no {attr!r}", EXAMPLE) from None
    if not callable(factory):
        raise ModelError(field, f"{spec} is a {type(factory).__name__}, not a function", EXAMPLE)
    return factory


def parse_shape(text: str) -> tuple[int, ...]:
    """"1,2048" -> (1, 2048): the example token ids' shape, batch first, then the sequence."""
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ModelError("--example-shape", f"{text!r} is not comma-separated integers", "e.g. 1,2048") from None
    if len(shape) != 2 or min(shape) < 1:
        raise ModelError("--example-shape", f"{text!r} must be two positive sizes, batch and sequence",
                         "e.g. 1,2048")
    return shape


def build_on_meta(spec: str):
    """The module `spec` builds, on the meta device, checked for what the executor splits."""
    import torch

    factory = load_factory(spec)
    try:
        with torch.device("meta"):
            module = factory()
    except Exception as error:  # noqa: BLE001 - the user's code: one line, not a traceback
        first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
        raise ModelError("--module", f"{spec}() failed on the meta device: {type(error).__name__}: {first}",
                         "build the module from its sizes alone (no data, no .item())") from None
    if not isinstance(module, torch.nn.Module):
        raise ModelError("--module", f"{spec}() returned a {type(module).__name__}, not an nn.Module", EXAMPLE)
    check_splittable(module, spec)
    return module


def check_splittable(module, spec: str) -> None:
    """One line naming what the executor cannot split, if anything."""
    from torch import nn

    if block_container(module) is None:
        found = ", ".join(sorted({type(m).__name__ for m in module.children()})) or "no submodules"
        raise ModelError("--module", f"{spec} has no repeated blocks (no ModuleList/ModuleDict of same-typed "
                         f"children; found {found}): the executor maps layers from them",
                         "hold the blocks in an nn.ModuleList")
    if not any(isinstance(m, nn.Linear) for m in module.modules()):
        kinds = sorted({type(m).__name__ for m in module.modules() if any(True for _ in m.parameters(recurse=False))})
        raise ModelError("--module", f"{spec} has no nn.Linear to split (its weights sit in {', '.join(kinds)})",
                         "write the projections as nn.Linear")
