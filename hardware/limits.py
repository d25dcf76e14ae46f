"""The range of every count and size Parallax accepts: GPUs, batch, sequence, layers, heads, vocabulary.

Why bounds at all: a typo (`--global-batch 99999999999999999999`, 1e8 GPUs, an HF config with
1e9 layers) must be refused in one line, not searched for minutes or allocated until the
kernel kills the process. Each bound sits well above anything trained or served today, with
the reason beside it, so no real model or cluster meets one.
"""
from __future__ import annotations

import math

from hardware.errors import ParallaxError

MAX_GPUS = 2**20  # 1,048,576: the largest clusters announced (2025) hold ~200k GPUs
MAX_GLOBAL_BATCH = 2**24  # sequences per step: Llama 3 405B trained at 16M tokens = 2,048 sequences of 8K
MAX_SEQ_LEN = 2**24  # 16.7M tokens: the longest contexts published are 10M (Llama 4 Scout)
MAX_LAYERS = 4096  # the deepest transformers published hold a few hundred blocks
MAX_HIDDEN = 2**18  # 262,144: the widest published hidden size is 25,600 (GPT-3 175B: 12,288)
MAX_HEADS = 4096  # attention heads per layer (Llama 3 405B: 128)
MAX_VOCAB = 2**24  # 16.7M entries: the largest vocabularies in use are ~260k
MAX_EXPERTS = 4096  # routed experts per layer (DeepSeek-V3: 256)
MAX_REQUESTS = 2**24  # concurrent sequences or requests a serving plan is asked about

COUNT_LIMITS = {  # the CLI's and the plan's names of each count, with its bound
    "tp": MAX_GPUS, "pp": MAX_GPUS, "dp": MAX_GPUS, "cp": MAX_GPUS, "ep": MAX_GPUS, "dp_shard": MAX_GPUS,
    "vpp": MAX_LAYERS, "micro_batch": MAX_GLOBAL_BATCH, "global_batch": MAX_GLOBAL_BATCH, "seq_len": MAX_SEQ_LEN,
}


def check_count(field: str, value: object, high: int, low: int = 1, hint: str = "") -> int:
    """`value` as an int when it is a whole number in [low, high], else a ParallaxError naming `field`."""
    whole = isinstance(value, int) and not isinstance(value, bool)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        value, whole = int(value), True
    if not whole or not low <= value <= high:
        raise ParallaxError(field, f"{value!r} is not a whole number in [{low:,}, {high:,}]", hint or f"use {low}..{high:,}")
    return value


def check_positive(field: str, value: object, hint: str = "") -> float:
    """`value` when it is a finite number above zero (a time limit, a rate, an SLO), else a ParallaxError."""
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not math.isfinite(value) or value <= 0:
        raise ParallaxError(field, f"{value!r} is not a positive finite number", hint or "e.g. 4")
    return value
