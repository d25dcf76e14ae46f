"""Hypothesis throws bad input at the plan loader and the CLI: one line, never a traceback."""
import json

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from hardware.catalog_io import canonical_name
from layout.plan import Plan
from parallax_cli import main
from planner.trace.models.catalog import list_models

# Hypothesis also draws string constants from the project's source, catalog names among them: those plan.
CATALOG = set(list_models())
names = st.text(alphabet=st.characters(codec="ascii", exclude_categories=("Cc",)), min_size=1, max_size=20).filter(
    lambda s: not s.startswith("-") and s.strip() == s and s not in CATALOG
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(model=names, batch=st.integers(-5, 64), seq=st.integers(-5, 64))
def test_cli_plan_with_unknown_models_fails_in_one_line(capsys, model, batch, seq):
    code = main(["plan", model, "--hw", "8xh100-sxm", "--global-batch", str(batch), "--seq-len", str(seq)])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(hw=names)
def test_cli_plan_with_random_hardware_fails_in_one_line(capsys, hw):
    assume(canonical_name(hw) is None and canonical_name(hw.split("x", 1)[-1]) is None)  # "GLOO" is the CPU's alias
    code = main(["plan", "gpt2", "--hw", hw, "--global-batch", "8", "--seq-len", "64"])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=10,
)


@settings(max_examples=200, deadline=None)
@given(data=st.dictionaries(st.sampled_from(list(Plan.model_fields) + ["junk"]), json_values, max_size=12))
def test_plan_loader_only_raises_validation_errors(data):
    try:
        Plan.model_validate_json(json.dumps(data))
    except ValidationError:
        pass
