"""`parallax plan --module pkg.mod:factory --example-shape B,S`: a user's own module class
planned from the command line, each thing the executor cannot split named in one line."""
from __future__ import annotations

import textwrap

import pytest

from layout.plan import Plan
from parallax_cli import main


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text(textwrap.dedent("""
        import torch
        from torch import nn

        def flat():
            return nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 100))

        def convs():
            return nn.Sequential(nn.ModuleList([nn.Conv1d(8, 8, 3) for _ in range(3)]))

        def needs_data():
            return nn.Linear(2, 2).weight.sum().item()

        not_a_function = 3
    """))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _error(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and "Traceback" not in err
    return err


@pytest.mark.parametrize("spec, says", [
    ("mymodels:flat", "no repeated blocks"), ("mymodels:convs", "no nn.Linear to split"),
    ("mymodels:needs_data", "failed on the meta device"), ("mymodels:not_a_function", "not a function"),
    ("mymodels:missing", "has no 'missing'"), ("nomodule:build", "cannot import"), ("mymodels", "package.module:function"),
])
def test_what_cannot_be_split_is_named_in_one_line(user_modules, capsys, spec, says):
    err = _error(capsys, ["plan", "--module", spec, "--example-shape", "1,64", "--hw", "8xa100-80g",
                          "--global-batch", "8"])
    assert says in err


def test_module_flags_are_checked(capsys):
    base = ["--hw", "8xa100-80g", "--global-batch", "8"]
    assert "--example-shape" in _error(capsys, ["plan", "--module", "examples.llama_module:build", *base])
    assert "--example-shape" in _error(capsys, ["plan", "--module", "examples.llama_module:build",
                                                "--example-shape", "1,x", *base])
    assert "give one of them" in _error(capsys, ["plan", "gpt2", "--module", "examples.llama_module:build",
                                                 "--example-shape", "1,64", *base])
    assert "no model given" in _error(capsys, ["plan", *base])


def test_a_module_plans_from_the_command_line(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "--module", "examples.llama_module:build", "--example-shape", "1,1024", "--hw", "8xa100-80g",
                 "--global-batch", "64", "--time-limit", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    plan = Plan.from_json(out.read_text())
    assert plan.model == "examples.llama_module:build" and plan.seq_len == 1024
    assert "attention priced as flash" in printed.replace("\n", " ")
