"""Hypothesis writes plans, profiles and HF configs a little or very wrong and hands them to
`plan`, `estimate`, `simulate` and `dry-run`: each answers, or says what is wrong in one line
with exit 2. Never a traceback, never "internal error", never a hang (an alarm bounds each
example; it is a guard against hanging, not a speed target)."""
import json
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parallax_cli import main

sys.path.insert(0, str(Path(__file__).parent))
from test_executor import make_plan  # noqa: E402

GUARD_S = 300
VALUES = st.one_of(
    st.sampled_from([-1, 0, 1, 2, 3, 7, 64, 1000, 2**24, 2**31, 10**20]),
    st.sampled_from([0.0, 2.5, -1.5, 1e300]),
    st.sampled_from(["", "x", "8", "$(touch pwned)", "a\nb", "\x1b[31m"]),
    st.none(), st.booleans(), st.just([1, 2]), st.just({"a": 1}),
)
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@contextmanager
def guard():
    def expire(signum, frame):  # noqa: ARG001
        raise TimeoutError(f"no answer within {GUARD_S} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(GUARD_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def answers_or_one_line(capsys, argv: list[str]) -> None:
    with guard():
        code = main(argv)
    err = capsys.readouterr().err
    assert code in (0, 2), (argv, code, err)
    assert len(err.strip().splitlines()) <= 1 and "Traceback" not in err and "internal error" not in err, err
    assert "\x1b" not in err


def _write(path: Path, data) -> Path:
    path.write_text(json.dumps(data, allow_nan=True))
    return path


TINY = json.loads(make_plan("reference-tiny", dp=2).to_json())
PLAN_FIELDS = ["global_batch", "seq_len", "dp", "tp", "pp", "micro_batch", "zero", "cp", "vpp", "schedule", "dtype",
               "dp_shard", "model", "hardware", "sp", "offload", "compression"]


@SETTINGS
@given(changes=st.dictionaries(st.sampled_from(PLAN_FIELDS), VALUES, min_size=1, max_size=3),
       command=st.sampled_from(["simulate", "estimate", "dry-run"]))
def test_generated_plans(tmp_path_factory, capsys, changes, command):
    path = _write(tmp_path_factory.mktemp("plan") / "plan.json", {**TINY, **changes})
    argv = ["estimate", "--plan", str(path)] if command == "estimate" else [command, str(path)]
    answers_or_one_line(capsys, argv)


PROFILE = json.loads(Path(__file__).resolve().parents[1].joinpath("hardware/catalog/h100-sxm.json").read_text())


@SETTINGS
@given(where=st.sampled_from([("gpu", "hbm_gb"), ("gpu", "hbm_gbps"), ("gpu", "name"), ("node", "gpus_per_node"),
                              ("node", "link_gbps"), ("network", "nic_gbps"), ("count",), ("gpu", "peak_tflops")]),
       value=VALUES)
def test_generated_profiles(tmp_path_factory, capsys, where, value):
    data = json.loads(json.dumps(PROFILE))
    target = data
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = value
    path = _write(tmp_path_factory.mktemp("profile") / "profile.json", data)
    answers_or_one_line(capsys, ["plan", "gpt2", "--hw", str(path), "--global-batch", "8", "--seq-len", "64",
                                 "--time-limit", "1"])


HF = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "rope_theta": 10000.0,
      "max_position_embeddings": 512}


@SETTINGS
@given(changes=st.dictionaries(st.sampled_from(sorted(HF)), VALUES, min_size=1, max_size=2))
def test_generated_hf_configs(tmp_path_factory, capsys, changes):
    config = {**HF, **changes}
    if any(isinstance(v, int) and not isinstance(v, bool) and v > 4096 for v in changes.values()):
        config = {**config, "hidden_size": 64}  # a valid huge width is a real (if slow) trace; keep it small
    path = _write(tmp_path_factory.mktemp("hf") / "config.json", config)
    answers_or_one_line(capsys, ["plan", str(path), "--hw", "8xh100-sxm", "--global-batch", "8", "--seq-len", "64",
                                 "--time-limit", "1"])

