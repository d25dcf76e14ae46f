"""Exports read by the tools' own code, where the tool installs here (the `formats` extra):
DeepSpeed's config class, Accelerate's launcher (config file -> environment -> FSDP plugin and
ParallelismConfig) and torchtitan's ConfigManager. Each checks every degree and option the
export states against the plan it came from. Layouts are those each tool says, drawn from the
planner's space for llama-3-8b on 16 H100s."""
from __future__ import annotations

import pytest

import formats
from tests.test_formats_roundtrip import BATCH, MODEL, STACK_OF, _spoken

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def plans():
    import hardware
    from planner.search.space import layouts, to_plan
    from planner.trace.workload_for import workload_for

    workload, _ = workload_for(MODEL, seq_len=4096)
    cluster = hardware.load("16xh100-sxm")
    space = sorted(layouts(workload, cluster, BATCH), key=repr)

    def of(fmt, recompute=("none", "full")):
        spoken = _spoken(space[::5], fmt, workload, cluster)
        return [to_plan(layout.model_copy(update={"stack": STACK_OF[fmt][0]}), workload, cluster, global_batch=BATCH,
                        dtype="bf16", recompute=recompute[i % len(recompute)], model=MODEL)
                for i, layout in enumerate(spoken[::max(1, len(spoken) // 12)])]
    return of


class _DataParallelGroups:
    """The `mpu` interface DeepSpeed's config asks for the data-parallel world (tensor-parallel ranks excluded)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def get_data_parallel_world_size(self) -> int:
        return self.size


def test_deepspeed_reads_every_export_as_planned(plans, monkeypatch):
    pytest.importorskip("deepspeed")
    import json

    from deepspeed.runtime import config as ds

    monkeypatch.setattr(ds.dist, "get_rank", lambda *a, **k: 0)  # no process group: rank 0 of the stub's world
    checked = 0
    for plan in plans("deepspeed"):
        parsed = ds.DeepSpeedConfig(json.loads(formats.export(plan, "deepspeed").text),
                                    mpu=_DataParallelGroups(plan.data_parallel))
        assert parsed.zero_optimization_stage == plan.zero, plan.layout_tag
        assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == \
            (plan.global_batch, plan.micro_batch, plan.num_micro_batches)
        assert parsed.bfloat16_config.enabled
        offloads = [parsed.zero_config.offload_optimizer, parsed.zero_config.offload_param]
        assert [str(o.device.value if hasattr(o.device, "value") else o.device) if o else None for o in offloads] == \
            [("cpu" if plan.offload else None), ("cpu" if plan.offload and plan.zero == 3 else None)]
        assert parsed.tensor_parallel_config.autotp_size == (plan.tp if plan.tp > 1 else 0)
        checked += 1
    assert checked >= 5


def test_accelerate_launches_every_export_as_planned(plans, tmp_path, monkeypatch):
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    checked = 0
    for i, plan in enumerate(plans("accelerate")):
        path = tmp_path / f"accelerate{i}.yaml"
        path.write_text(formats.export(plan, "accelerate").text)
        args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "x.py"]))
        assert args.num_processes == plan.n_gpus
        env = prepare_multi_gpu_env(args)
        assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
        with monkeypatch.context() as patched:
            for key, value in env.items():
                patched.setenv(key, value)
            _check_accelerate_plugins(plan, env)
        checked += 1
    assert checked >= 5


def _check_accelerate_plugins(plan, env):
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import CPUOffloadPolicy

    if plan.zero >= 2:
        fsdp = FullyShardedDataParallelPlugin()
        assert fsdp.fsdp_version == 2 and fsdp.reshard_after_forward == (plan.zero == 3), plan.layout_tag
        assert isinstance(fsdp.cpu_offload, CPUOffloadPolicy) == plan.offload
        assert fsdp.activation_checkpointing == (plan.stages[0].recompute[1] == "full")
    else:
        assert "ACCELERATE_USE_FSDP" not in env
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG") == "true":
        degrees = ParallelismConfig()
        assert (degrees.tp_size, degrees.cp_size) == (plan.tp, plan.cp), plan.layout_tag
        assert degrees.dp_replicate_size * degrees.dp_shard_size * degrees.cp_size == plan.data_parallel
        assert degrees.dp_shard_size * degrees.cp_size == plan.shard_degree
    else:
        assert plan.tp == plan.cp == 1 and plan.dp_replicate in (1, plan.data_parallel)


def _torchtitan_parser():
    """torchtitan 0.3.0's own config classes and parser rules (the Makefile installs them beside the venv)."""
    import sys
    from pathlib import Path

    folder = Path(sys.prefix) / "torchtitan-parser"
    if folder.is_dir() and str(folder) not in sys.path:
        sys.path.append(str(folder))
    pytest.importorskip("tyro")
    pytest.importorskip("torchtitan.config.configs")
    import dataclasses

    import tyro
    from torchtitan.config.configs import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.config.manager import ConfigManager, custom_registry
    from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig, SelectiveAC

    # the sections of torchtitan's Trainer.Config an export sets, with their types and defaults (and the
    # --module/--config pair ConfigManager takes before tyro)
    field = dataclasses.field
    Sections = dataclasses.make_dataclass("Sections", [
        ("module", str, field(default="")), ("config", str, field(default="")),
        ("training", TrainingConfig, field(default_factory=TrainingConfig)),
        ("parallelism", ParallelismConfig, field(default_factory=ParallelismConfig)),
        ("activation_checkpoint", ActivationCheckpointingConfig, field(default_factory=SelectiveAC.Config)),
        ("compile", CompileConfig, field(default_factory=CompileConfig))], kw_only=True)

    ConfigManager()  # registers torchtitan's tyro rules (comma-separated string lists)
    return lambda args: tyro.cli(Sections, args=args, default=Sections(), registry=custom_registry)


def test_torchtitan_parses_every_export_as_planned(plans):
    from formats.argv import split

    parse = _torchtitan_parser()
    checked = 0
    for plan in plans("torchtitan"):
        parsed = parse(split(formats.export(plan, "torchtitan").text, "torchtitan"))
        p, t = parsed.parallelism, parsed.training
        shard = p.data_parallel_shard_degree
        assert (p.data_parallel_replicate_degree * shard * p.context_parallel_degree * p.tensor_parallel_degree
                * p.pipeline_parallel_degree) == plan.n_gpus, plan.layout_tag
        assert (p.tensor_parallel_degree, p.pipeline_parallel_degree, p.context_parallel_degree) == \
            (plan.tp, plan.pp, plan.cp)
        assert shard > 1 or plan.cp > 1 if plan.zero >= 2 else shard == 1
        assert p.enable_sequence_parallel == (plan.sp or plan.tp == 1)
        assert (t.global_batch_size, t.seq_len, t.mixed_precision_param) == (plan.global_batch, plan.seq_len, "bfloat16")
        assert t.enable_cpu_offload == plan.offload and parsed.compile.enable == (plan.stack == "compile")
        assert t.disable_cuda_graphs == (plan.pp > 1)  # its Trainer refuses a pipeline under CUDA graphs
        assert (parsed.activation_checkpoint is None) == (plan.stages[0].recompute[1] == "none")
        if plan.pp > 1:
            assert len(p.module_fqns_per_model_part) == plan.pp * plan.vpp
            assert p.pipeline_parallel_microbatch_size == plan.micro_batch
        else:
            assert t.local_batch_size == plan.micro_batch
        checked += 1
    assert checked >= 5


def test_torchtitan_looks_up_the_schedule_class_the_executor_runs():
    """Each pipeline schedule's torchtitan name resolves, through torch's own lookup that torchtitan
    calls, to the class `parallax run` builds; a ZB-V export reads back as two chunks per rank."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    import hardware
    from executor.apply.pipeline import CHUNKED
    from formats import torchtitan
    from formats.argv import split
    from layout.layout import Layout
    from planner.search.space import to_plan
    from planner.trace.workload_for import workload_for
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    workload, _ = workload_for(MODEL, seq_len=4096)
    cluster = hardware.load("16xh100-sxm")
    parse = _torchtitan_parser()
    runs = {**CHUNKED, "1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
    for schedule, vpp in (("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zero-bubble", 2), ("zbv", 2)):
        layout = Layout(dp=4, pp=4, schedule=schedule, vpp=vpp)
        plan = to_plan(layout, workload, cluster, global_batch=BATCH, dtype="bf16", recompute="none", model=MODEL)
        text = formats.export(plan, "torchtitan").text
        assert get_schedule_class(parse(split(text, "torchtitan")).parallelism.pipeline_parallel_schedule) is runs[schedule]
        read = torchtitan.read(text)
        assert (read.axes["schedule"], read.axes["vpp"]) == (schedule, vpp), schedule
        unsplit = "\n".join(line for line in text.splitlines() if "module_fqns_per_model_part" not in line)
        if schedule == "zbv":  # no parts stated: torchtitan's ZBV still runs two stages per rank
            assert torchtitan.read(unsplit).axes["vpp"] == 2
