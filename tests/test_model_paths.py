"""Models by path and by HF id: a config.json, a folder holding one, an id in the local HF cache."""
import json

import pytest

import planner
from hardware.errors import ModelError
from parallax_cli import main

transformers = pytest.importorskip("transformers")

SMALL = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL),
    "mistral": lambda: transformers.MistralConfig(**SMALL),
    "mixtral": lambda: transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
    "gpt2": lambda: transformers.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=512, n_positions=512),
    "bert": lambda: transformers.BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                            intermediate_size=512, vocab_size=512),
    "t5": lambda: transformers.T5Config(d_model=128, d_ff=512, num_layers=2, num_heads=4, d_kv=32, vocab_size=512),
}


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_a_config_written_by_transformers_plans_by_path_and_folder(tmp_path, family):
    CONFIGS[family]().save_pretrained(tmp_path)
    by_file = planner.plan(str(tmp_path / "config.json"), "8xh100-sxm", global_batch=16, seq_len=256, time_limit_s=2)
    by_folder = planner.plan(str(tmp_path), "8xh100-sxm", global_batch=16, seq_len=256, time_limit_s=2)
    assert by_file.estimate.step_time_s == pytest.approx(by_folder.estimate.step_time_s)
    assert by_file.n_gpus == 8


def _fake_cache(root, model_id, config):
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<rev>/config.json}."""
    repo = root / ("models--" + model_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    config.save_pretrained(snapshot)


def test_a_hub_id_is_read_from_the_local_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    _fake_cache(tmp_path, "acme/tiny-llama", CONFIGS["llama"]())
    plan = planner.plan("acme/tiny-llama", "8xh100-sxm", global_batch=16, seq_len=256, time_limit_s=2)
    assert plan.model == "acme/tiny-llama"
    with pytest.raises(ModelError, match=str(tmp_path)):
        planner.plan("acme/not-downloaded", "8xh100-sxm", global_batch=16, seq_len=256)


@pytest.mark.parametrize("content,needle", [("{bad", "not valid JSON"), (json.dumps({"hidden_size": 4}), "model_type"),
                                            (json.dumps([1, 2]), "model_type")])
def test_broken_config_files_are_one_line_errors(tmp_path, capsys, content, needle):
    path = tmp_path / "config.json"
    path.write_text(content)
    code = main(["plan", str(path), "--hw", "8xh100-sxm", "--global-batch", "16", "--seq-len", "256"])
    err = capsys.readouterr().err
    assert code != 0
    assert needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_missing_config_path_names_it(tmp_path):
    with pytest.raises(ModelError, match="does not exist"):
        planner.plan(str(tmp_path / "config.json"), "8xh100-sxm", global_batch=16, seq_len=256)
