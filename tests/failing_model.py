"""A model whose forward fails on rank 1 only: the failed-run report test's patient."""
from __future__ import annotations

import os

from planner.trace.models.build import build_module


class _FailsOnRankOne(type(build_module("reference-tiny"))):
    def forward(self, tokens):
        if os.environ.get("RANK") == "1":
            raise ValueError("boom on purpose in rank 1's forward")
        return super().forward(tokens)


def build():
    model = build_module("reference-tiny")
    model.__class__ = _FailsOnRankOne
    return model
