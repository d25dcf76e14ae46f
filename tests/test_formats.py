"""The formats from the command line, as a user meets them: `parallax export`, `estimate --from`
and `plan --from`; what a tool cannot say named in one line; broken and hostile files refused
in one line; and every flag written for a tool that does not install here held to the names
its own argument parser declares (cited in each module)."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import formats
import planner
from formats import megatron, serving
from hardware.errors import ParallaxError
from parallax_cli import main

# accumulation pinned to the recipe every tool's file states (the search may hold gradients unsharded)
PLAN_ARGS = ["llama-3-8b", "--hw", "8xh100-sxm", "--global-batch", "64", "--seq-len", "4096", "--accumulation",
             "reduce_each"]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("formats") / "plan.json"
    assert main(["plan", *PLAN_ARGS, "--out", str(path)]) == 0
    return path


@pytest.mark.parametrize("tool", ["torchtitan", "deepspeed", "accelerate"])
def test_an_exported_plan_is_priced_back_as_planned(plan_file, tool, tmp_path, capsys):
    out = tmp_path / f"config{formats.SUFFIX[tool]}"
    assert main(["export", str(plan_file), "--to", tool, "--out", str(out)]) == 0
    assert "run: " in capsys.readouterr().out
    planned = json.loads(plan_file.read_text())["estimate"]
    extra = {"deepspeed": ["llama-3-8b", "--seq-len", "4096"],
             "accelerate": ["llama-3-8b", "--seq-len", "4096", "--global-batch", "64",
                            "--micro-batch", str(json.loads(plan_file.read_text())["micro_batch"])],
             "torchtitan": []}[tool]
    assert main(["estimate", *extra, "--hw", "8xh100-sxm", "--from", str(out), "--json"]) == 0
    priced = json.loads(capsys.readouterr().out)["estimate"]
    assert priced["step_time_s"] == pytest.approx(planned["step_time_s"], rel=1e-9)
    assert priced["peak_memory_bytes"] == pytest.approx(planned["peak_memory_bytes"], rel=1e-9)


def test_torchtitan_overrides_saved_under_a_toml_name_are_read_as_overrides(plan_file, tmp_path, capsys):
    """`export --to torchtitan --out run.toml` writes overrides whatever the name; `--from run.toml`
    reads them back as such, where it once refused them as a broken TOML file."""
    out = tmp_path / "run.toml"
    assert main(["export", str(plan_file), "--to", "torchtitan", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["estimate", "--hw", "8xh100-sxm", "--from", str(out), "--json"]) == 0
    priced = json.loads(capsys.readouterr().out)["estimate"]
    assert priced["step_time_s"] == pytest.approx(json.loads(plan_file.read_text())["estimate"]["step_time_s"], rel=1e-9)
    out.write_text("[training]\nlocal_batch_size = 2\nseq_len = 4096\n[parallelism]\ndata_parallel_shard_degree = 8\n")
    assert formats.torchtitan.read(out.read_text(), ".toml").local_batch == 2  # an older release's TOML still reads


def test_plan_from_a_users_config_proposes_a_faster_layout_in_the_same_format(tmp_path, capsys):
    mine = tmp_path / "ds_config.json"  # ZeRO-3 with one sequence per micro-batch and every block recomputed
    mine.write_text(json.dumps({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 1,
                                "gradient_accumulation_steps": 8, "zero_optimization": {"stage": 3},
                                "bf16": {"enabled": True}, "activation_checkpointing": {}}))
    out = tmp_path / "proposed.json"
    assert main(["plan", "llama-3-8b", "--hw", "8xh100-sxm", "--seq-len", "4096", "--from", str(mine),
                 "--out", str(out)]) == 0
    said = capsys.readouterr().out
    line = next(line for line in said.splitlines() if line.startswith("your layout"))
    assert "dp8 tp1 pp1 z3 mb1" in line and "x faster" in line
    assert float(line.rsplit(", ", 1)[1].split("x")[0]) >= 1.0
    proposed = formats.deepspeed.read(out.read_text())
    assert proposed.global_batch == 64 and proposed.axes["zero"] in (0, 1, 2, 3)


@pytest.mark.parametrize("argv, field", [
    (["export", "{plan}", "--to", "vlm"], "--to: unknown format 'vlm'"),
    (["export", "{plan}", "--to", "vllm"], "--to: vllm does not take a training plan"),
    (["estimate", "llama-3-8b", "--hw", "8xh100-sxm", "--seq-len", "4096", "--from", "{bad}"], "--from:"),
    (["estimate", "llama-3-8b", "--seq-len", "4096", "--from", "{bad}"], "--from:"),
    (["plan", "llama-3-8b", "--hw", "8xh100-sxm", "--seq-len", "4096", "--from", "{missing}"], "does not exist"),
])
def test_wrong_input_is_one_line(plan_file, tmp_path, capsys, argv, field):
    bad = tmp_path / "bad.json"
    bad.write_text('{"zero_optimization": ')
    paths = {"plan": plan_file, "bad": bad, "missing": tmp_path / "nowhere.json"}
    assert main([a.format(**paths) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert field in err and len(err.splitlines()) == 1, err


def test_what_a_tool_cannot_say_is_refused_by_name_and_exported_with_lossy(plan_file, capsys):
    assert main(["export", str(plan_file), "--to", "megatron"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: stack: Megatron-LM cannot express the eager stack") and "--lossy" in err
    assert main(["export", str(plan_file), "--to", "megatron", "--lossy"]) == 0
    said = capsys.readouterr()
    assert "not expressed in megatron: stack:" in said.err and "--tensor-model-parallel-size 1" in said.out


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(text=st.text(max_size=300) | st.from_regex(r"(--[a-z_.\-]{1,30}( [\w\[\]\",.-]{0,12})?\n){1,6}", fullmatch=True),
       tool=st.sampled_from([*formats.TRAINING, *formats.SERVING]))
def test_any_text_is_read_or_refused_in_the_tools_terms(text, tool):
    try:
        if tool in formats.SERVING:
            serving.read(text, tool, model="m")
        else:
            formats.TRAINING[tool].read(text)
    except ParallaxError:
        pass


JSON = st.recursive(st.none() | st.booleans() | st.integers(-5, 10**6) | st.sampled_from(["auto", "cpu", "bf16"]),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
                        st.sampled_from(["stage", "zero_optimization", "train_batch_size", "bf16", "enabled",
                                         "offload_param", "device", "tensor_parallel", "autotp_size",
                                         "mics_shard_size", "train_micro_batch_size_per_gpu"]), inner, max_size=4),
                    max_leaves=12)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(config=JSON)
def test_any_ds_config_is_read_or_refused_by_field(config):
    try:
        formats.deepspeed.read(json.dumps(config))
    except ParallaxError as error:
        assert error.field


# Flag names as each tool's argument parser declares them, read from its source (see each module's SOURCE(S)).
MEGATRON_PARSER = {
    "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage",
    "--context-parallel-size", "--expert-model-parallel-size", "--sequence-parallel", "--tp-comm-overlap",
    "--use-distributed-optimizer",
    "--use-megatron-fsdp", "--data-parallel-sharding-strategy", "--micro-batch-size", "--global-batch-size",
    "--seq-length", "--max-position-embeddings", "--bf16", "--fp16", "--fp8-format", "--grad-reduce-in-bf16",
    "--fp8-param-gather", "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers", "--num-layers", "--hidden-size", "--num-attention-heads",
    "--group-query-attention", "--num-query-groups", "--ffn-hidden-size", "--swiglu", "--vocab-size",
    "--untie-embeddings-and-output-weights", "--num-experts", "--moe-router-topk"}
ENGINE_PARSERS = {
    "vllm": {"--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size", "--max-num-seqs",
             "--max-num-batched-tokens", "--gpu-memory-utilization", "--kv-cache-dtype", "--quantization", "--dtype",
             "--max-model-len", "--enable-expert-parallel"},
    "sglang": {"--model-path", "--tp-size", "--pp-size", "--dp-size", "--max-running-requests", "--chunked-prefill-size",
               "--mem-fraction-static", "--kv-cache-dtype", "--quantization", "--dtype", "--context-length", "--ep-size"},
    "trtllm": {"--tp_size", "--pp_size", "--max_batch_size", "--max_num_tokens", "--max_seq_len",
               "--kv_cache_free_gpu_memory_fraction", "--ep_size"},
}


def test_megatron_flags_are_megatrons_own():
    assert set(megatron.FLAGS) <= MEGATRON_PARSER


@pytest.mark.parametrize("engine", formats.SERVING)
def test_engine_flags_are_the_engines_own(engine):
    assert set(serving.FLAGS[engine][1].values()) <= ENGINE_PARSERS[engine]


def test_an_engines_command_line_is_priced_as_it_stands(tmp_path, capsys):
    """serve-plan --from pins the engine's degrees and replicas (a flag left out is the engine's 1)."""
    command = tmp_path / "vllm.cmd"
    command.write_text("vllm serve meta-llama/Meta-Llama-3-8B-Instruct --tensor-parallel-size 2\n")
    serve = ["serve-plan", "llama-3-8b", "--hw", "8xh100-sxm", "--prompt-len", "1024", "--output-len", "256"]
    assert main([*serve, "--from", str(command), "--json"]) == 0
    priced = json.loads(capsys.readouterr().out)
    assert (priced["tp"], priced["pp"], priced["replicas"]) == (2, 1, 1)
    assert main([*serve, "--replicas", "16"]) == 2
    assert "replicas: replicas=16: no such deployment" in capsys.readouterr().err


def test_megatrons_gradient_dtype_is_read_and_written_as_it_runs():
    """Megatron-LM accumulates and reduces bf16 runs' gradients in fp32 unless --grad-reduce-in-bf16
    (its arguments.py): read so, and a plan's 16-bit gradients are written with the flag."""
    base = "--tensor-model-parallel-size 1\n--micro-batch-size 1\n--global-batch-size 64\n--seq-length 4096\n"
    assert megatron.read(base + "--bf16\n").axes["reduce_dtype"] == "fp32"
    assert megatron.read(base + "--bf16\n--fp8-format hybrid\n").axes["reduce_dtype"] == "fp32"
    assert "reduce_dtype" not in megatron.read(base + "--bf16\n--grad-reduce-in-bf16\n").axes
    assert "reduce_dtype" not in megatron.read(base + "--fp16\n").axes

    plan = planner.plan("llama-3-8b", "8xh100-sxm", global_batch=64, seq_len=4096,
                        fixed={"stack": "fused", "dp": 8, "tp": 1, "pp": 1, "zero": 1, "micro_batch": 1,
                               "recompute": "none"})
    assert "--grad-reduce-in-bf16" in formats.export(plan, "megatron").text
    fp32 = plan.model_copy(update={"reduce_dtype": "fp32"})
    assert "--grad-reduce-in-bf16" not in formats.export(fp32, "megatron").text


def test_megatrons_fp8_weights_are_read_and_written():
    """--fp8-param-gather is read with FP8 and written back; NVIDIA's Llama 3 8B FP8 script's
    layout (tp1, micro-batch 1 of 8192 tokens, the distributed optimizer) fits 80-GB H100s with it."""
    base = ("--tensor-model-parallel-size 1\n--micro-batch-size 1\n--global-batch-size 128\n--seq-length 8192\n"
            "--use-distributed-optimizer\n--bf16\n--grad-reduce-in-bf16\n--fp8-format hybrid\n")
    assert megatron.read(base).axes["fp8_param_gather"] is False
    stated = megatron.read(base + "--fp8-param-gather\n")
    assert stated.axes["fp8_param_gather"] is True and "reduce_dtype" not in stated.axes
    fixed = {**{k: v for k, v in stated.axes.items() if v is not None}, "recompute": "none"}
    plan = planner.plan("llama-3-8b", "8xh100-sxm", global_batch=128, seq_len=8192, dtype="fp8", fixed=fixed)
    assert plan.layout_tag == "dp8 tp1 pp1 z1 mb1 fp8-params fp8 fused" and plan.estimate.fits
    assert "--fp8-param-gather" in formats.export(plan, "megatron").text


def test_accelerates_ddp_is_read_with_torchs_bucket_copies_and_views_are_not_written():
    """Accelerate builds DDP with torch's defaults: a MULTI_GPU file states bucket copies, and a
    plan whose gradients are views into the buckets is refused by name (the script says that)."""
    from formats import accelerate
    from formats.stated import merge, to_plan
    import hardware

    text = "distributed_type: MULTI_GPU\nmixed_precision: bf16\nnum_processes: 8\n"
    stated = merge(accelerate.read(text), {"model": "gpt2", "global_batch": 16, "seq_len": 1024})
    assert stated.axes["ddp_bucket_view"] is False
    plan = to_plan(stated, hardware.load("8xh100-sxm"), ["embedding", *["block"] * 12, "head"])
    assert plan.copies_into_buckets and plan.dp == 8
    assert formats.export(plan, "accelerate").lost == []
    with pytest.raises(ParallaxError) as refused:
        formats.export(plan.with_overrides(ddp_bucket_view=True), "accelerate")
    assert refused.value.field == "ddp_bucket_view"
    assert "ddp_bucket_view" in formats.export(plan, "torchtitan", lossy=True).lost[0]
