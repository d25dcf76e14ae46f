"""Every CLI command answers wrong usage with one line and exit code 2, never a traceback.

The commands are walked from the app itself, so a new command is covered too."""
from __future__ import annotations

import typer

from parallax_cli import _register_commands, app, main


def _commands():
    _register_commands()
    group = typer.main.get_command(app)
    out = []
    for name, command in group.commands.items():
        subs = getattr(command, "commands", None)
        if subs:  # a command group (`parallax hardware list`)
            out += [([name, sub], c) for sub, c in subs.items()]
        else:
            out.append(([name], command))
    return out


def _typed_option(command):
    """(flag, bad value) for an option that parses numbers, if the command has one
    (read from the callback's annotations: typer converts by them)."""
    import inspect
    import typing

    hints = typing.get_type_hints(command.callback)
    for param in command.params:
        kind = hints.get(param.name)
        numeric = kind in (int, float) or set(typing.get_args(kind)) & {int, float}
        if param.param_type_name == "option" and numeric and param.opts and not inspect.isclass(param):
            return param.opts[0], "not-a-number"
    return None


def _one_line_usage_error(capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, f"{argv}: exit {code}, stderr {err!r}"
    assert "Traceback" not in err and len(err.splitlines()) == 1 and err.startswith("error:"), f"{argv}: {err!r}"
    return err


def test_every_command_is_walked():
    names = {" ".join(path) for path, _ in _commands()}
    assert {"plan", "estimate", "simulate", "run", "calibrate", "whatif"} <= names


def test_unknown_option_is_one_line(capsys):
    for path, _ in _commands():
        err = _one_line_usage_error(capsys, [*path, "--no-such-option"])
        assert "--no-such-option" in err


def test_missing_required_argument_or_option_is_one_line(capsys):
    for path, command in _commands():
        if any(p.required for p in command.params):
            err = _one_line_usage_error(capsys, list(path))
            assert "Missing" in err, err


def test_badly_typed_value_is_one_line(capsys):
    checked = 0
    for path, command in _commands():
        typed = _typed_option(command)
        if typed is not None:
            err = _one_line_usage_error(capsys, [*path, typed[0], typed[1]])
            assert typed[0] in err or "Invalid value" in err or "Missing" in err, err
            checked += 1
    assert checked >= 5


def test_unknown_command_is_one_line(capsys):
    err = _one_line_usage_error(capsys, ["plna"])
    assert "plan" in err


def test_failed_run_names_the_first_failing_rank_in_one_line(tmp_path, capsys):
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from test_executor import make_plan

    plan_path = tmp_path / "plan.json"
    plan_path.write_text(make_plan("reference-tiny", dp=2).to_json())
    code = main(["run", str(plan_path), "--steps", "2", "--model", "tests.failing_model:build", "--trust-module"])
    err = capsys.readouterr().err.strip()
    assert code == 1 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "rank 1" in err and "boom on purpose" in err and "logs are in" in err, err


def test_a_broken_plan_file_names_itself(tmp_path, capsys):
    from parallax_cli import main

    bad = tmp_path / "plan.json"
    bad.write_text('{"model": ')
    for argv in (["run", str(bad)], ["simulate", str(bad)], ["estimate", "gpt2", "--hw", "8xh100-sxm", "--plan", str(bad)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: plan:") and str(bad) in err and "\n" not in err


def test_a_warning_is_one_note_line_not_pythons_file_and_line(monkeypatch, capsys):
    """The tracer warns through `warnings` (blocks that differ, an op without a FLOP formula): the
    CLI shows each as a `note:` line, without the file:line form Python gives them."""
    import warnings

    import planner.trace.models.catalog as catalog

    listed = catalog.list_models

    def warning_list():
        warnings.warn("blocks of encoder.block differ structurally", stacklevel=2)
        return listed()

    monkeypatch.setattr("parallax_cli.models_cmd.list_models", warning_list)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        assert main(["models"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["note: blocks of encoder.block differ structurally"]
    assert warnings.showwarning.__name__ != "_note"  # put back after the command


def test_an_encoder_is_refused_for_serving_by_name(capsys):
    code = main(["serve-plan", "bert-large", "--hw", "1xa100-80g", "--prompt-len", "128", "--output-len", "16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "attend both ways" in err[0]


def test_a_schedule_pinned_with_a_chunk_count_it_does_not_run_names_vpp(capsys):
    """zbv runs two chunks per rank, 1f1b one: the rulebook's reason, not an empty search."""
    for schedule, vpp in (("zbv", 3), ("1f1b", 2)):
        code = main(["plan", "llama-160m", "--hw", "4xh100-sxm", "--global-batch", "8", "--seq-len", "128",
                     "--schedule", schedule, "--vpp", str(vpp)])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith("error: vpp:"), err
