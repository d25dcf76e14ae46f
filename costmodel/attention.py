"""Which scaled-dot-product-attention kernel a device runs, and the layer profiles priced so.

A traced layer that calls `scaled_dot_product_attention` carries two profiles: one with
the call as a single fused kernel (no score matrix kept; its backward recomputes the
scores) and one on torch's math path (scores written, masked, softmaxed, dropped out and
saved). Which one a device runs is torch's own dispatch decision, restated here from its
eligibility rules (ATen's `sdp_utils`, torch 2.9-2.13) over what the tracer recorded of
the call (`AttentionCall`) and the profile's GPU (`GPU.arch`, `GPU.device_type`):

* CUDA tries its kernels in priority order: cuDNN, flash, memory-efficient, math on
  sm90/sm100 (torch prefers cuDNN there from cuDNN 9.9), else flash, memory-efficient,
  math (cuDNN after math, so never by default):
  - flash: sm80-sm121; fp16/bf16; no explicit mask (is_causal only, square when causal);
    head_dim <= 256, q/k/v alike; on sm86/89/120 training rules out head_dim in (192, 224]
    and head_dim > 224 with dropout;
  - memory-efficient: sm50-sm121; fp16/fp32, and bf16 from sm80; any mask; head_dim a
    multiple of the GEMM alignment (8 halves, 4 floats); no grouped-query heads;
  - cuDNN: sm80-sm121; fp16/bf16; head_dim a multiple of 8, at most 128 (256 on sm90);
    keys longer than 1; q/k/v in [b, s, h, d] order transposed, or packed;
* ROCm (gfx targets) runs flash and memory-efficient through AOTriton, head_dim up to
  512, no cuDNN;
* the CPU runs its flash loop when there is no dropout (any float dtype, masks allowed),
  else the math path.
"""
from __future__ import annotations

from hardware.schema import GPU

from .workload import AttentionCall, LayerProfile, Segment, Workload

HALVES = ("float16", "bfloat16")


def _sm(gpu: GPU) -> int | None:
    return int(gpu.arch[2:]) if gpu.arch and gpu.arch.startswith("sm") else None


def _rocm(gpu: GPU) -> bool:
    return bool(gpu.arch and gpu.arch.startswith("gfx"))


def _flash(call: AttentionCall, gpu: GPU) -> bool:
    if call.mask not in ("none", "causal") or call.dtype not in HALVES or call.head_dim != call.value_dim:
        return False
    if call.mask == "causal" and call.q_len != call.kv_len:
        return False
    if _rocm(gpu):
        return call.head_dim <= 512
    sm = _sm(gpu)
    if sm is None or not 80 <= sm <= 121 or call.head_dim > 256:
        return False
    narrow = sm in (86, 87, 88, 89, 120, 121)  # consumer parts: less shared memory for the backward
    return not (narrow and (192 < call.head_dim <= 224 or (call.head_dim > 224 and call.dropout)))


def _efficient(call: AttentionCall, gpu: GPU) -> bool:
    if call.gqa and call.kv_heads != call.heads:
        return False
    alignment = 8 if call.dtype in HALVES else 4
    if call.head_dim % alignment or call.value_dim % alignment:
        return False
    if _rocm(gpu):
        return call.head_dim <= 512 and call.dtype in (*HALVES, "float32")
    sm = _sm(gpu)
    if sm is None or not 50 <= sm <= 121:
        return False
    return call.dtype in ((*HALVES, "float32") if sm >= 80 else ("float16", "float32"))


def _cudnn(call: AttentionCall, gpu: GPU) -> bool:
    sm = _sm(gpu)
    if sm is None or not 80 <= sm <= 121 or call.dtype not in HALVES or call.layout == "other":
        return False
    limit = 256 if sm == 90 else 128
    return call.head_dim % 8 == 0 and call.value_dim % 8 == 0 and max(call.head_dim, call.value_dim) <= limit \
        and call.kv_len > 1


CHECKS = {"cudnn": _cudnn, "flash": _flash, "efficient": _efficient}


def sdpa_backend(call: AttentionCall, gpu: GPU) -> str:
    """The kernel torch dispatches for `call` on `gpu`: flash, efficient, cudnn, cpu-flash or math."""
    if gpu.device_type == "cpu":
        return "math" if call.dropout else "cpu-flash"
    order = ["cudnn", "flash", "efficient"] if _sm(gpu) in (90, 100) else ["flash", "efficient"]  # then math
    return next((name for name in order if CHECKS[name](call, gpu)), "math")


def _path_for(layer: LayerProfile, gpus: list[GPU]) -> tuple[LayerProfile, set[str]]:
    if layer.attention is None:
        return layer, set()
    backends = {sdpa_backend(layer.attention, gpu) for gpu in gpus}
    want = "math" if "math" in backends else "fused"
    if layer.attention_path == want or layer.other_path is None:
        return layer, backends
    swapped = layer.other_path.model_copy(update={"other_path": layer.model_copy(update={"other_path": None})})
    return swapped, backends


def on_path(workload: Workload, path: str) -> Workload:
    """`workload` with every attention layer on `path` ("math": the scores materialised, as runs
    before fused attention kernels; "fused") whatever the GPU would dispatch: the other path
    is dropped, so `for_device` keeps this one."""
    segments = []
    for segment in workload.segments:
        layer = segment.layer
        if layer.attention is not None and layer.attention_path != path and layer.other_path is not None:
            layer = layer.other_path
        if layer.attention is not None:
            layer = layer.model_copy(update={"other_path": None})
        segments.append(Segment(layer=layer, count=segment.count))
    fields = {name: getattr(workload, name) for name in Workload.model_fields}
    return Workload(**{**fields, "segments": segments, "flash_attention": path != "math"})


def for_device(workload: Workload, gpus: GPU | list[GPU]) -> Workload:
    """`workload` with each attention layer on the path `gpus` run (the math path if any of a
    mixed cluster's GPUs runs it) and `attention_backend` naming the kernels."""
    gpus = gpus if isinstance(gpus, list) else [gpus]
    segments, names = [], set()
    for segment in workload.segments:
        layer, backends = _path_for(segment.layer, gpus)
        names |= backends
        segments.append(segment if layer is segment.layer else Segment(layer=layer, count=segment.count))
    if not names:
        return workload
    # a new model, not model_copy: the copy would carry the cached expanded `layers` along
    fields = {name: getattr(workload, name) for name in Workload.model_fields}
    return Workload(**{**fields, "segments": segments, "attention_backend": "/".join(sorted(names))})


def backend_note(workload: Workload, where: str) -> str:
    """One line naming the attention kernel priced, and what of the call decided it."""
    call = next((l.attention for l in workload.layers if l.attention is not None), None)
    if call is None or workload.attention_backend is None:
        return ""
    mask = {"none": "no mask", "causal": "causal", "bool": "boolean mask", "float": "additive mask"}[call.mask]
    return (f"attention priced as {workload.attention_backend} on {where} (scaled_dot_product_attention: {call.dtype}, "
            f"head_dim {call.head_dim}, {mask}{', dropout' if call.dropout else ''})")
