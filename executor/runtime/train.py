"""The per-rank training loop: synthetic tokens, AdamW, timed steps, peak memory, losses."""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from layout.plan import Plan
from executor.apply.data_parallel import sync_context
from executor.apply.materialize import Materialized, lm_loss, loss_context, materialize_rank
from executor.measure.memory import PeakMemory, check_fits, out_of_memory
from executor.runtime.config import RunConfig
from executor.runtime.mesh import coords
from executor.runtime.models import build_model, parameter_shapes, vocab_size

MEMORY_STEPS = 2  # steps 0-1 run under the CPU memory tracker (its dispatch overhead would skew timing)


def global_batch(plan: Plan, step: int, seed: int, vocab: int) -> torch.Tensor:
    """The step's [global_batch, seq_len + 1] tokens, identical on every rank."""
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    return torch.randint(0, vocab, (plan.global_batch, plan.seq_len + 1), generator=gen)


def local_batch(plan: Plan, tokens: torch.Tensor, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This data-parallel rank's contiguous slice of sequences, split into inputs and next-token
    targets; under context parallelism (dp_rank = replica * cp + cp rank) its two sequence chunks."""
    from executor.apply.context_parallel import shard_sequence

    replica, cp_rank = divmod(dp_rank, plan.cp)
    first = plan.first_sequence_of(replica)
    rows = tokens[first:first + plan.micro_batch * plan.micro_batches_of(replica)]
    x, y = rows[:, :-1], rows[:, 1:]
    if plan.cp > 1:
        x, y = shard_sequence(x, plan.cp, cp_rank), shard_sequence(y, plan.cp, cp_rank)
    return x, y


def precision(plan: Plan, device: torch.device):
    """bf16/fp16 plans compute under autocast, their weights, gradients and AdamW state in the
    master dtype (`executor.apply.data_parallel.cast_master_weights`): the bytes per parameter
    the cost model holds, and half-width activations where autocast casts (GEMM inputs and
    outputs)."""
    import contextlib

    if plan.dtype == "fp32":  # fp8 plans compute in bf16 here: see executor.runtime.launch.executed_dtype_notes
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype={"bf16": torch.bfloat16, "fp16": torch.float16,
                                              "fp8": torch.bfloat16}[plan.dtype])


def step_context(plan: Plan, device: torch.device):
    """What a step's forwards and backwards run under: the plan's autocast and the loss's."""
    import contextlib

    stack = contextlib.ExitStack()
    stack.enter_context(precision(plan, device))
    stack.enter_context(loss_context(plan))
    return stack


def _plain_step(run: Materialized, plan: Plan, x, y, call=None, phase=None, replica: int = 0) -> torch.Tensor:
    """Forward and backward of every micro-batch of this data-parallel `replica`; `call(module, xs)`
    runs the forward (the dry run gives each micro-batch its own parent module for torch's memory
    trackers); `phase(name)` marks them for the profiler.

    Each micro-batch's mean loss is weighted by its share of the global batch times dp
    (1/m when every replica runs m): the data-parallel average of the gradients is then the
    token-weighted mean over the whole batch, however unevenly the replicas share it."""
    module, n = run.modules[0], plan.micro_batches_of(replica)
    weight = plan.dp * plan.micro_batch / plan.global_batch
    phase = phase or (lambda name: _null())
    total = torch.zeros((), device=run.device)
    for i, (xs, ys) in enumerate(zip(x.chunk(n), y.chunk(n))):
        with sync_context(module, i == n - 1, plan):
            with phase("forward"):
                loss = lm_loss(call(module, xs) if call else module(xs), ys)
            with phase("backward"):
                (loss * weight).backward()
        total += loss.detach() * weight
    return total


def _pipeline_step(run: Materialized, plan: Plan, x, y, pp_rank: int) -> torch.Tensor | None:
    """One step of this rank's pipeline schedule; the last stage's mean loss. The schedule is told
    not to return outputs: by default its last stage keeps every micro-batch's output (the
    logits) until the step ends and concatenates them, memory the plan does not price."""
    losses: list[torch.Tensor] = []
    kwargs = {"target": y, "losses": losses} if pp_rank == plan.stage_rank(plan.n_virtual_stages - 1) else {}
    args = (x,) if pp_rank == 0 else ()
    run.schedule.step(*args, return_outputs=False, **kwargs)
    return torch.stack([l.detach() for l in losses]).mean() if losses else None


def _global_loss(loss: torch.Tensor | None, plan: Plan, at: dict[str, int], device) -> float:
    """Mean over DP replicas of the last stage's loss, known to every rank."""
    counts = loss is not None and at["pp"] == plan.stage_rank(plan.n_virtual_stages - 1) and at["tp"] == 0
    value = (loss.float() / plan.data_parallel) if counts else torch.zeros((), device=device)
    value = value.clone()
    dist.all_reduce(value)
    return float(value)


def train_steps(run: Materialized, plan: Plan, steps: int, seed: int, vocab: int, start_step: int = 0,
                checkpointer=None, on_step=None, profile_dir: str | None = None,
                device_memory: float | None = None) -> dict:
    """Run optimizer steps `start_step`..`steps - 1`; return losses, step times and this rank's peak memory.

    With a checkpointer, state is saved after every step it says is due (and after the last).
    `on_step(step)`: called after the step's backward and before its update (a `StepHook`'s).
    `profile_dir`: the last steps run under torch.profiler (executor/measure/profiling.py).
    `device_memory`: a first step that peaks above it stops the run (`DoesNotFit`), as a
    device's out-of-memory error does in any step."""
    from executor.measure.profiling import StepProfiler, profiled_steps

    at = coords(run.mesh)
    params = [p for m in run.modules for p in m.parameters()]
    memory = PeakMemory(run.device, params)
    profiler = StepProfiler(profile_dir, dist.get_rank(), profiled_steps(start_step, steps, MEMORY_STEPS))
    if profile_dir and run.schedule is not None:
        profiler.watch_forward(run.modules)
    losses, times = [], []
    for step in range(start_step, steps):
        x, y = (t.to(run.device) for t in local_batch(plan, global_batch(plan, step, seed, vocab), at["dp"]))
        with memory.measure() if step - start_step < MEMORY_STEPS else _null():
            dist.barrier()
            start = time.perf_counter()
            with profiler.step(step):
                loss = _one_step(run, plan, x, y, at, profiler.phase, on_step, step)
            times.append(time.perf_counter() - start)
        if step == start_step:
            check_fits(memory, device_memory, step)
        losses.append(_global_loss(loss, plan, at, run.device))
        if checkpointer is not None:
            checkpointer.finish()  # the previous step's save, written while this step ran
            if checkpointer.due(step + 1, steps):
                checkpointer.save(run, step + 1, wait=step + 1 == steps)
    return {"losses": losses, "step_times_s": times, "peak_memory_bytes": memory.peak_bytes,
            "peak_reserved_bytes": memory.reserved_bytes,
            "profiled_steps": [s - start_step for s in profiler.window]}


def _one_step(run: Materialized, plan: Plan, x, y, at: dict[str, int], phase, on_step, step: int):
    """Forward, backward, gradient sync and update; a device's out-of-memory error names the
    phase it struck in."""
    where = "forward and backward"
    try:
        loss = _forward_backward(run, plan, x, y, at, phase)
        if on_step is not None:
            on_step(step)
        where = "gradient sync"
        with phase("sync"):
            run.sync_gradients()
        where = "optimizer step"
        with phase("optimizer"):
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)
        if run.device.type == "cuda":
            torch.cuda.synchronize(run.device)
    except torch.OutOfMemoryError as error:
        raise out_of_memory(error, where, step) from None
    return loss


def _forward_backward(run: Materialized, plan: Plan, x, y, at: dict[str, int], phase):
    with step_context(plan, run.device):
        if run.schedule is None:
            return _plain_step(run, plan, x, y, phase=phase, replica=at["dp"] // plan.cp)
        with phase("pipeline"):  # torch's schedules mark each action (forward/backward of micro-batch i)
            return _pipeline_step(run, plan, x, y, at["pp"])


def _torchrun_attempt() -> int:
    """How many times torchrun has restarted this worker group (its documented TORCHELASTIC_RESTART_COUNT)."""
    import os

    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _null():
    import contextlib

    return contextlib.nullcontext()


def steady_step_time(times: list[float], profiled: list[int] = ()) -> float:
    """Median over steps after the tracked warm-up steps (all steps when there are too few),
    leaving out the profiled steps when others remain."""
    steady = times[MEMORY_STEPS:] or times[1:] or times
    skip = set(profiled)
    unprofiled = [t for i, t in enumerate(times) if i >= MEMORY_STEPS and i not in skip]
    return statistics.median(unprofiled or steady)


def run_rank(plan: Plan, config: RunConfig, lr: float = 1e-3) -> dict:
    """Build, materialise and train on this rank (resuming from `config.checkpoint_dir` if it
    holds a valid checkpoint); every rank returns its own numbers."""
    model_name, seed, steps = config.model_for(plan.model), config.seed, config.steps
    model = build_model(model_name, seed, config.trust.module)
    vocab = vocab_size(model)
    shapes = parameter_shapes(model)
    run = materialize_rank(plan, model, lr=lr, seed=seed)
    checkpointer, start = None, 0
    if config.checkpoint_dir:
        from executor.checkpoints.store import Checkpointer

        checkpointer = Checkpointer(config.checkpoint_dir, config.checkpoint_every, plan, seed, tied=run.tied_names,
                                    model=model_name, parameters=shapes)
        start = checkpointer.resume(run)
    on_step = _step_hook(config)
    result = train_steps(run, plan, steps, seed, vocab, start, checkpointer, on_step, config.profile_dir,
                         config.device_memory_bytes)
    result["tp_replicated"] = run.tp_replicated
    result["rank"] = dist.get_rank()
    result["start_step"] = start
    result["notes"] = checkpointer.notes if checkpointer else []
    from executor.apply.compression import compression_states

    states = compression_states(run.modules)
    if states and steps > start:
        result["notes"].append(f"{plan.compression} compression: {sum(s.bytes_sent for s in states) / (steps - start):,.0f} "
                               f"bytes sent per step by rank {dist.get_rank()}")
    return result


def _step_hook(config: RunConfig):
    """The configured hook bound to this rank and torchrun attempt, or None."""
    if config.step_hook is None:
        return None
    hook, rank, attempt = config.step_hook.build(), dist.get_rank(), _torchrun_attempt()
    return lambda step: hook(step, rank, attempt)
