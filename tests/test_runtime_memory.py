"""Memory outside the tensors: the CUDA context, cuBLAS workspaces and NCCL's buffers per
communicator (hardware data), the caching allocator's replay of a dry run, and the CLI's
memory check and headroom."""
from __future__ import annotations

import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

import hardware
import planner
from costmodel.runtime_memory import communicators, runtime_memory_bytes
from parallax_cli import main

GIB, MIB = 2**30, 2**20


CASES = [("hf-llama-tiny", {"tp": 2, "pp": 2, "zero": 3, "dp_shard": 2}, "fp32"),  # TP, a pipeline, HSDP
         ("hf-llama-tiny", {"tp": 1, "pp": 1, "zero": 3, "cp": 2}, "fp32"),  # context parallel under HSDP
         ("hf-mixtral-tiny", {"tp": 1, "pp": 1, "zero": 3, "ep": 2}, "bf16")]  # expert parallel


def _created_groups(name: str, fixed: dict, dtype: str) -> tuple[list[int], list[int]]:
    """(sizes of the process groups of more than one rank the executor creates for rank 0 of a
    16-rank fake world, the cost model's communicators), in a fresh process: DTensor keeps
    sub-meshes of an earlier world."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.distributed_c10d import _world
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from costmodel.terms import tied_across_stages
    from executor.apply.materialize import materialize_rank
    from executor.runtime.mesh import build_mesh
    from executor.runtime.models import build_model
    from planner.trace.workload_for import workload_for

    plan = planner.plan(name, "16xh100-sxm", global_batch=16, seq_len=64, fixed=fixed, dtype=dtype)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.n_gpus)
    try:
        mesh = build_mesh(plan)
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = build_model(name)
        materialize_rank(plan, model, mesh)
        created = sorted(len(ranks) for ranks in _world.pg_group_ranks.values() if len(ranks) > 1)
    finally:
        dist.destroy_process_group()
    workload, _ = workload_for(name, seq_len=64)
    return created, sorted(communicators(plan, tied_across_stages(workload)).values())


def _every_case() -> list:
    return [(case, *_created_groups(*case)) for case in CASES]


def test_the_communicators_priced_are_the_groups_the_executor_creates():
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        for case, created, priced in pool.submit(_every_case).result():
            assert created == priced, case


def test_runtime_memory_is_the_profiles_and_comes_off_the_usable_memory():
    cluster = hardware.load("8xh100-sxm")
    plan = planner.plan("hf-llama-tiny", cluster, global_batch=16, seq_len=64, fixed={"tp": 2, "pp": 1})
    runtime = plan.estimate.runtime_memory_bytes
    assert runtime["cuda_context"] == 381 * MIB and runtime["cublas_workspace"] == 2 * 32 * MIB
    assert runtime["nccl"] == len(communicators(plan)) * 16 * 2 * 10 * MIB
    # the GPU less the runtime and the prediction's error band: the caching allocator's blocks are priced in the
    # reservation it is held to
    assert plan.estimate.memory_capacity_bytes == pytest.approx(80 * GIB * 0.95 - sum(runtime.values()))
    assert plan.estimate.peak_reserved_bytes >= plan.estimate.peak_memory_bytes
    assert runtime_memory_bytes(plan, hardware.load("4xcpu")) == {}  # CPU ranks: gloo's buffers are the host's


def test_the_dry_run_replays_the_allocator_and_judges_the_whole_gpu(tmp_path, capsys):
    plan = planner.plan("hf-llama-tiny", "8xh100-sxm", global_batch=16, seq_len=64,
                        fixed={"tp": 1, "pp": 1, "zero": 3, "recompute": "none"})
    path = tmp_path / "p.json"
    path.write_text(plan.to_json())
    from executor.measure.dry_run import dry_run

    (rank,) = dry_run(plan).ranks
    replayed = rank.allocator
    # every tensor rounded up to 512 B, packed into segments no smaller than 2 MiB
    assert rank.measured_peak <= replayed["allocated"] <= rank.measured_peak * 1.05 + 64 * 1024
    assert min(replayed["reserved"], replayed["reserved_expandable"]) >= max(replayed["allocated"], 2 * MIB)
    # judged as `parallax run` sets torch's allocator (expandable segments), on the GPU less the runtime's memory:
    # far from full, nothing is given back and the replay on the device reads as the one with no pressure
    assert replayed["reserved_on_device"] == replayed["reserved_expandable"] and replayed["allocation_retries"] == 0
    assert rank.device_total == pytest.approx(replayed["reserved_on_device"] + sum(rank.runtime.values()))
    assert rank.fits and not replayed["out_of_memory"] and rank.gpu_bytes == 80 * GIB
    assert main(["dry-run", str(path)]) == 0
    out = capsys.readouterr().out
    assert "max_memory_reserved (expandable_segments, as run on this GPU)" in out and "without expandable" in out
    assert "+ nccl" in out


class _Trace:
    """An allocation sequence: a 60 MiB hole below live blocks, then 100 MiB more."""

    def device_events(self) -> list[tuple]:
        return [("malloc", "a", 60 * MIB, "default"), ("malloc", "b", 60 * MIB, "default"),
                ("malloc", "c", 20 * MIB, "default"), ("free", "a"), ("malloc", "d", 100 * MIB, "default")]


def _judged(room_mib: int):
    from executor.measure.dry_run import RankMemory
    from executor.measure.dry_run_trackers import CategoryPeaks, replay_allocator

    peaks = CategoryPeaks()
    replay_allocator(peaks, _Trace(), room=room_mib * MIB)
    return RankMemory(rank=0, pp_rank=0, measured={}, measured_peak=180 * MIB, at_peak={}, predicted={},
                      predicted_peak=180 * MIB, capacity=room_mib * MIB, allocator=peaks.allocator,
                      runtime={"cuda_context": 20 * MIB}, gpu_bytes=(room_mib + 20) * MIB)


def test_a_rank_fits_when_its_live_tensors_do_once_the_cache_is_given_back():
    """240 MiB reserved with no memory pressure, on a GPU leaving the allocator 200: torch gives
    the hole's pages back and retries, so the rank fits (it used to be refused on the 240); with
    150 MiB the live tensors themselves do not fit, and the line says out of memory."""
    from parallax_cli.dry_run_cmd import _does_not_fit, _reserved_line

    roomy = _judged(200)
    assert roomy.allocator["reserved_expandable"] == 240 * MIB
    assert (roomy.allocator["reserved_on_device"], roomy.allocator["allocation_retries"]) == (180 * MIB, 1)
    assert roomy.fits and roomy.device_total == 200 * MIB
    assert "gives its cache back 1 time(s)" in _reserved_line(roomy)
    tight = _judged(150)
    assert tight.allocator["out_of_memory"] == 1 and not tight.fits
    assert "out of memory in the caching allocator's replay" in _does_not_fit(tight)


def test_cuda_ranks_run_the_allocator_the_dry_run_replays(monkeypatch):
    """A CUDA rank sets torch's caching allocator to expandable segments before its first
    allocation, the setting the dry run's replay judges a plan by (no GPU here: torch's calls
    are stood in for)."""
    import torch

    from executor.runtime import mesh

    calls = []
    monkeypatch.setattr(mesh, "device_and_backend", lambda: ("cuda", "nccl"))
    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", calls.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append(index))
    assert mesh.local_device() == torch.device("cuda", 0)
    assert calls == ["expandable_segments:True", 0]


def test_plan_checks_its_pick_by_the_allocators_replay(capsys):
    args = ["plan", "hf-llama-tiny", "--hw", "8xh100-sxm", "--global-batch", "16", "--seq-len", "64"]
    assert main(args + ["--check-memory", "--zero", "3"]) == 0
    assert "memory check of" in capsys.readouterr().out
    assert main(args + ["--check-memory", "--zero", "0"]) == 0  # DDP: the dry run cannot follow it, and says so
    assert "memory not checked: zero" in capsys.readouterr().out
    assert main(args + ["--json"]) == 0
    plain = json.loads(capsys.readouterr().out)["estimate"]["memory_capacity_bytes"]
    assert main(args + ["--json", "--memory-headroom", "8"]) == 0
    margin = json.loads(capsys.readouterr().out)["estimate"]["memory_capacity_bytes"]
    assert plain - margin == pytest.approx(8 * GIB)
    assert main(args + ["--memory-headroom", "80"]) == 2
    assert "--memory-headroom" in capsys.readouterr().err
