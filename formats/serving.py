"""The serving engines' command lines: vLLM, SGLang and TensorRT-LLM (`trtllm-serve`).

A serving plan becomes `EngineSettings`, the settings every engine has under its own names:
the parallel degrees, the replica count, the most concurrent sequences (the batch the plan
priced), the tokens one scheduler step takes, the share of GPU memory the engine may hold,
the KV cache and weight precision, and the longest request. Each engine's flag names follow
its own argument parser, read at the commits named in `SOURCES`; none installs on these
machines (each pulls a CUDA build of torch), so `tests/test_formats.py` holds the names to
those lists.
"""
from __future__ import annotations

import math
import shlex

from pydantic import BaseModel, ConfigDict, Field

from costmodel.inference import batched_tokens
from hardware.errors import FormatError

from . import argv
from .common import Exported

SOURCES = {  # each engine's parser, at the commit read (flags built from config fields: '--' + the name dashed)
    "vllm": "vllm-project/vllm vllm/engine/arg_utils.py @ 99d7eb5d6a51 (EngineArgs.add_cli_args); `vllm serve MODEL`",
    "sglang": "sgl-project/sglang python/sglang/srt/server_args.py @ 001067fffe33 (ServerArgs.add_cli_args); its "
              "--kv-cache-dtype takes fp8_e4m3, not fp8",
    "trtllm": "NVIDIA/TensorRT-LLM tensorrt_llm/commands/serve.py @ 4c05a74891e4 (click options, underscores); KV "
              "dtype and quantization come from --extra_llm_api_options YAML or the checkpoint, not flags",
}
TORCH_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# the plan's KV dtype as each engine's --kv-cache-dtype spells it (SGLang names the FP8 format); read back, every
# FP8 spelling is fp8
KV_FLAG_VALUE = {"sglang": {"fp8": "fp8_e4m3"}}
FP8_KV = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla")


class EngineSettings(BaseModel):
    """What a serving plan asks of an engine, in the plan's terms."""
    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    replicas: int = Field(ge=1)
    max_sequences: int = Field(ge=1, description="concurrent sequences per replica: the batch the plan priced")
    max_batched_tokens: int = Field(ge=1, description="tokens per scheduler step: a prompt beside every running "
                                    "sequence's next token, as the plan prices an iteration (costmodel.inference.batched_tokens)")
    memory_fraction: float = Field(gt=0, le=1, description="share of each GPU's memory the engine may hold")
    kv_dtype: str = Field("auto", description="auto: the activations' 16-bit type; bf16, fp16 or fp8")
    quantization: str | None = Field(None, description="fp8 weights, or None: vLLM and SGLang read a weight-only "
                                     "method (the plan's int8 or int4) from the checkpoint's quantization config")
    dtype: str = "bf16"
    max_model_len: int = Field(ge=1)
    expert_parallel: bool = Field(False, description="whole experts on each TP rank: expert parallelism as wide "
                                  "as TP (vLLM's --enable-expert-parallel; SGLang's and TRT-LLM's ep size = tp)")


def settings_of(plan) -> EngineSettings:
    """The engine settings of an `planner.inference.InferencePlan`. A batch runs that many
    sequences; under a request rate the mean batch is only a mean, and bursts above it are
    admitted as long as the KV cache holds them (what `serve-load` simulates), so the cap is
    the KV cache's room."""
    room = plan.estimate.max_concurrent_sequences
    wanted = room if plan.request_rate is not None else math.ceil(plan.batch_per_replica)
    max_sequences = max(1, min(room, wanted))
    budget = batched_tokens(plan.prompt_len, max_sequences, plan.output_len)
    return EngineSettings(model=plan.model, tp=plan.tp, pp=plan.pp, replicas=plan.replicas,
                          max_sequences=max_sequences, max_batched_tokens=budget,
                          memory_fraction=round(1 - plan.memory_reserve, 4), kv_dtype=plan.kv_dtype,
                          quantization="fp8" if plan.dtype == "fp8" else None,
                          dtype="bf16" if plan.dtype == "fp8" else plan.dtype,
                          max_model_len=plan.prompt_len + plan.output_len, expert_parallel=plan.expert_parallel)


# engine -> (program, {setting: flag}); the model is the program's first argument (vLLM, TRT-LLM) or a flag
FLAGS = {
    "vllm": ("vllm serve", {"tp": "--tensor-parallel-size", "pp": "--pipeline-parallel-size",
                            "replicas": "--data-parallel-size", "max_sequences": "--max-num-seqs",
                            "max_batched_tokens": "--max-num-batched-tokens",
                            "memory_fraction": "--gpu-memory-utilization", "kv_dtype": "--kv-cache-dtype",
                            "quantization": "--quantization", "dtype": "--dtype", "max_model_len": "--max-model-len",
                            "expert_parallel": "--enable-expert-parallel"}),
    "sglang": ("python -m sglang.launch_server", {
        "model": "--model-path", "tp": "--tp-size", "pp": "--pp-size", "replicas": "--dp-size",
        "max_sequences": "--max-running-requests", "max_batched_tokens": "--chunked-prefill-size",
        "memory_fraction": "--mem-fraction-static", "kv_dtype": "--kv-cache-dtype", "quantization": "--quantization",
        "dtype": "--dtype", "max_model_len": "--context-length", "expert_parallel": "--ep-size"}),
    "trtllm": ("trtllm-serve", {"tp": "--tp_size", "pp": "--pp_size", "max_sequences": "--max_batch_size",
                                "max_batched_tokens": "--max_num_tokens", "max_model_len": "--max_seq_len",
                                "memory_fraction": "--kv_cache_free_gpu_memory_fraction", "expert_parallel": "--ep_size"}),
}
EP_SIZE = {"sglang", "trtllm"}  # engines that take expert parallelism as a size (the plan's: tp), not a switch


def export(plan, engine: str, lossy: bool) -> Exported:
    settings = settings_of(plan)
    program, flags = FLAGS[engine]
    lost = []
    options = []
    for key, flag in flags.items():
        value = getattr(settings, key)
        if key == "dtype":
            value = TORCH_DTYPE[value]
        elif key == "kv_dtype":
            value = KV_FLAG_VALUE.get(engine, {}).get(value, value)
        elif key == "expert_parallel" and engine in EP_SIZE:
            value = settings.tp if value else None
        options.append((flag, value))
    missing = [k for k in ("replicas", "kv_dtype", "quantization", "dtype") if k not in flags]
    for key in missing:
        value = getattr(settings, key)
        if key == "replicas" and value > 1:
            lost.append(f"replicas: {engine} serves one tp x pp group per server; start {value} servers")
        elif key in ("kv_dtype", "quantization") and value not in (None, "auto"):
            lost.append(f"{key}: {value} is set by the checkpoint's quantization for {engine}, not a flag")
    if lost and not lossy:
        raise FormatError(lost[0].partition(":")[0], f"{engine} cannot express {lost[0].partition(': ')[2]}",
                          "pass --lossy to export without it")
    head = f"{engine} for {plan.model} on {plan.hardware}: tp{plan.tp} pp{plan.pp} x{plan.replicas}\n" \
           "(written by parallax export; run: the lines below joined, or $(grep -v '^#' FILE))"
    model_first = "model" not in flags
    text = argv.write(options, head)
    launch = f"{program} {shlex.quote(plan.model) + ' ' if model_first else ''}$(grep -v '^#' FILE)"
    return Exported(format=engine, text=text, launch=launch, lost=lost)


def read(text: str, engine: str, model: str | None = None) -> EngineSettings:
    """An engine's command line (or its flags one a line) back as settings; `model` where the
    engine takes it as an argument rather than a flag."""
    program, flags = FLAGS[engine]
    found = argv.read(text, engine)
    if model is None and "model" not in flags:
        model = _positional(text, program)
    values: dict = {"model": model, "replicas": 1, "kv_dtype": "auto", "quantization": None, "dtype": "bf16"}
    dtypes = {v: k for k, v in TORCH_DTYPE.items()}
    for key, flag in flags.items():
        if flag not in found:
            continue
        value = found[flag]
        if key in ("tp", "pp", "replicas", "max_sequences", "max_batched_tokens", "max_model_len"):
            value = argv.whole(found, flag, engine)
        elif key == "memory_fraction":
            value = _fraction(value, flag)
        elif key == "dtype":
            value = dtypes.get(value, value)
        elif key == "kv_dtype":
            value = kv_dtype_of(value)
        elif key == "expert_parallel":
            value = _expert_parallel(found, flag, engine, values.get("tp") or 1)  # tp is read first
        values[key] = value
    absent = [flags.get(k, k) for k in ("model", "tp", "pp", "max_sequences", "max_batched_tokens", "memory_fraction",
                                         "max_model_len") if values.get(k) is None]
    if absent:
        raise FormatError(absent[0], f"not in the {engine} command line", "Parallax's export states it")
    return EngineSettings(**values)


def _expert_parallel(found: dict, flag: str, engine: str, tp: int) -> bool:
    """An engine's expert parallelism in the plan's terms: on, as wide as TP, or off."""
    if engine not in EP_SIZE:
        return argv.truth(found, flag)
    size = argv.whole(found, flag, engine)
    if size not in (1, tp):
        raise FormatError(flag, f"expert parallelism over {size} ranks with tp {tp}: Parallax plans it as wide as TP",
                          f"use {flag} {tp}, or 1")
    return size == tp > 1


def kv_dtype_of(value: str) -> str:
    """An engine's --kv-cache-dtype value in the plan's terms: fp8 for any FP8 format, else as given."""
    return "fp8" if value in FP8_KV else {"bfloat16": "bf16", "float16": "fp16"}.get(value, value)


class EnginePins(BaseModel):
    """What an engine's command line pins of a serving plan: a flag left out is the engine's
    default (one of each degree, an auto KV cache dtype, no expert parallelism)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    degrees: dict[str, int]
    kv_dtype: str = "auto"
    expert_parallel: bool = False


def engine_pins(text: str, engine: str) -> EnginePins:
    """tp, pp and replicas, the KV cache dtype and expert parallelism of an engine's command line,
    read once, as the engine reads them."""
    _, flags = FLAGS[engine]
    found = argv.read(text, engine) if any(w.startswith("--") for w in argv.split(text, engine)) else {}
    degrees = {key: argv.whole(found, flags[key], engine) or 1 if key in flags else 1 for key in ("tp", "pp", "replicas")}
    kv_dtype = kv_dtype_of(found[flags["kv_dtype"]]) if flags.get("kv_dtype") in found else "auto"
    ep_flag = flags.get("expert_parallel")
    expert_parallel = ep_flag in found and _expert_parallel(found, ep_flag, engine, degrees["tp"])
    return EnginePins(degrees=degrees, kv_dtype=kv_dtype, expert_parallel=expert_parallel)


def _positional(text: str, program: str) -> str | None:
    """The model a command line names after its program (`vllm serve MODEL --flags`), if any."""
    body = " ".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    words = shlex.split(body)
    start = next((i + len(program.split()) for i in range(len(words)) if words[i:i + len(program.split())] == program.split()), None)
    if start is None or start >= len(words) or words[start].startswith("--"):
        return None
    return words[start]


def _fraction(value, flag: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise FormatError(flag, f"{value!r} is not a number", "a fraction in (0, 1], e.g. 0.9") from None
    if not 0 < number <= 1:
        raise FormatError(flag, f"{number} is not in (0, 1]", "e.g. 0.9")
    return number
