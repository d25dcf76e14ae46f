"""Round trips through the tools' formats: a layout drawn from the planner's space, exported
to torchtitan, DeepSpeed, Accelerate or Megatron-LM and read back with `estimate --from`'s
reader, is the same layout, priced at the same step time and memory; what a tool cannot say
is refused by name, never written wrong. Serving plans come back with the same degrees and
engine settings."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import formats
import hardware
from costmodel.estimate import estimate
from formats.serving import read as read_engine, settings_of
from formats.stated import merge, to_plan as stated_to_plan
from hardware.errors import FormatError
from layout.axes import AXIS, RECOMPUTE, STACKS
from planner.search.space import layouts, to_plan
from planner.trace.workload_for import workload_for

MODEL, HW, BATCH = "llama-3-8b", "16xh100-sxm", 64
COMMAND_LINE = {"deepspeed": ("seq_len",), "accelerate": ("global_batch", "seq_len", "micro_batch"),
                "megatron": (), "torchtitan": ()}  # what each tool keeps outside its file
STACK_OF = {"deepspeed": ("eager",), "accelerate": ("eager", "compile"), "torchtitan": ("eager", "compile"),
            "megatron": ("fused",)}
RECOMPUTE_OF = {"deepspeed": (("uniform", "none"), ("uniform", "full")), "accelerate": (("uniform", "none"), ("uniform", "full")),
                "torchtitan": (("uniform", "none"), ("uniform", "op"), ("uniform", "full")),
                "megatron": (("uniform", "none"), ("uniform", "selective"), ("uniform", "full"), ("first", "none"))}
COUNTS = {fmt: {"round trips": 0, "refusals": 0} for fmt in formats.TRAINING}


@pytest.fixture(scope="module")
def space():
    workload, _ = workload_for(MODEL, seq_len=4096)
    cluster = hardware.load(HW)
    space = sorted(layouts(workload, cluster, BATCH), key=repr)
    return workload, cluster, space, {fmt: _spoken(space[::3], fmt, workload, cluster) for fmt in formats.TRAINING}


def _as_run(layout, fmt):
    """`layout` as the tool runs it: Accelerate's DDP keeps torch's bucket copies."""
    if fmt == "accelerate" and layout.reduces_through_ddp:
        return layout.model_copy(update={"ddp_bucket_view": False})
    return layout


def _spoken(space, fmt, workload, cluster):
    """The layouts a tool can say (its own stack, no recomputation), as it runs them: where most draws come from."""
    ours = []
    for layout in map(lambda layout: _as_run(layout, fmt), space):
        plan = to_plan(layout.model_copy(update={"stack": STACK_OF[fmt][0]}), workload, cluster, global_batch=BATCH,
                       dtype="bf16", recompute="none", model=MODEL)
        try:
            formats.export(plan, fmt)
        except FormatError:
            continue
        ours.append(layout)
    return ours


def _drawn_plan(data, workload, cluster, space, spoken, fmt):
    """Mostly a layout, recompute pattern, precision and stack the tool says; else anything, to be
    refused by name or said exactly."""
    native = data.draw(st.integers(0, 3)) > 0
    layout = data.draw(st.sampled_from(spoken[fmt] if native else space))
    pattern, policy = data.draw(st.sampled_from(RECOMPUTE_OF[fmt])) if native else \
        (data.draw(st.sampled_from(["uniform", "first", "every"])), data.draw(st.sampled_from(RECOMPUTE)))
    plan = to_plan(layout, workload, cluster, global_batch=BATCH, dtype="bf16" if native else "fp8",
                   recompute=policy, model=MODEL)
    plan = plan.with_overrides(stack=data.draw(st.sampled_from(STACK_OF[fmt] if native else STACKS)))
    if pattern == "first":  # full on the first n blocks of every stage (Megatron's block method)
        n = data.draw(st.integers(1, 3))
        stages = [s.model_copy(update={"recompute": [p if k == "none" else k for k, p in zip(_first(s, n, plan), s.recompute)]})
                  for s in plan.stages]
        plan = plan.with_overrides(stages=[s.model_dump() for s in stages])
    elif pattern == "every":  # full on every k-th block (torchtitan's selective_ac_option k)
        k = data.draw(st.integers(2, 4))
        last, stages, block = plan.stages[-1].end, [], 0
        for s in plan.stages:
            policies = []
            for i in range(s.start, s.end):
                is_block = 0 < i < last - 1
                block += is_block
                policies.append("full" if is_block and block % k == 0 else "none")
            stages.append({**s.model_dump(), "recompute": policies})
        plan = plan.with_overrides(stages=stages)
    return plan


def _first(stage, n, plan):
    last = plan.stages[-1].end
    blocks = [i for i in range(stage.start, stage.end) if 0 < i < last - 1][:n]
    return ["full" if i in blocks else "none" for i in range(stage.start, stage.end)]


def _read_back(plan, exported, fmt, workload, cluster):
    stated = formats.TRAINING[fmt].read(exported.text, *((".args",) if fmt == "torchtitan" else ()))
    given = {"model": MODEL, **{key: getattr(plan, key) for key in COMMAND_LINE[fmt]}}
    stated = merge(stated, given)
    return stated_to_plan(stated, cluster, [layer.kind for layer in workload.layers])


@settings(max_examples=120, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.generate])
@given(data=st.data())
def test_a_drawn_layout_comes_back_from_every_training_format_priced_the_same(space, data):
    workload, cluster, layouts_, spoken = space
    fmt = data.draw(st.sampled_from(sorted(formats.TRAINING)))
    plan = _drawn_plan(data, workload, cluster, layouts_, spoken, fmt)
    try:
        exported = formats.export(plan, fmt)
    except FormatError as refusal:
        assert refusal.field in (*AXIS, "recompute", "stages", "model", "dtype"), refusal
        assert "--lossy" in str(refusal)
        COUNTS[fmt]["refusals"] += 1
        return
    back = _read_back(plan, exported, fmt, workload, cluster)
    assert back.axes() == plan.axes(), (fmt, plan.layout_tag, back.layout_tag)
    assert back.stages == plan.stages, (fmt, plan.layout_tag)
    assert (back.global_batch, back.seq_len, back.dtype) == (plan.global_batch, plan.seq_len, plan.dtype)
    mine, theirs = estimate(workload, plan, cluster), estimate(workload, back, cluster)
    assert theirs.step_time_s == pytest.approx(mine.step_time_s, rel=1e-9)
    assert theirs.peak_memory_bytes == pytest.approx(mine.peak_memory_bytes, rel=1e-9)
    COUNTS[fmt]["round trips"] += 1


def test_the_round_trips_covered_every_format():
    """Run after the drawn test: each training format round-tripped and refused."""
    print(COUNTS)
    assert all(c["round trips"] >= 5 and c["refusals"] >= 1 for c in COUNTS.values()), COUNTS


@pytest.mark.parametrize("engine", formats.SERVING)
def test_a_serving_plan_comes_back_with_its_degrees_and_settings(engine):
    from planner.inference import plan_inference

    plan = plan_inference("llama-3-70b", "16xh100-sxm", prompt_len=2048, output_len=256, top_k=1)
    for candidate in (plan, plan.model_copy(update={"dtype": "fp8", "replicas": 1}),
                      plan.model_copy(update={"kv_dtype": "fp8", "replicas": 1})):
        try:
            exported = formats.export(candidate, engine)
        except FormatError as refusal:
            assert engine == "trtllm" and refusal.field in ("replicas", "quantization", "kv_dtype"), refusal
            exported = formats.export(candidate, engine, lossy=True)
            assert exported.lost
            continue
        assert read_engine(exported.launch.replace("$(grep -v '^#' FILE)", exported.text), engine) == \
            settings_of(candidate)
