"""Atomic, verified, resharding checkpoints of model and optimizer state.

Layout of a checkpoint directory D:

    D/step-00000010/            one complete checkpoint (10 steps done)
        .metadata, __R_0.distcp   torch.distributed.checkpoint, sharded as the plan shards
                                  (DDP: replicated tensors written once; FSDP2/TP: DTensor shards;
                                  ZeRO-1: each AdamW state by the rank that owns it)
        extra/rank00003.pt        per-rank RNG states (torch, python, numpy, CUDA) and compression residuals
        manifest.json             step, data position, world size, plan, and size + sha256 of every file

Model and optimizer state are `get_state_dict`'s, one chunk and its optimizers at a time,
optimizer state flattened and keyed by parameter name ("state.blocks.3.attn.q.weight.exp_avg"),
so a checkpoint names every tensor as the unsplit model does: any other layout (dp, tp, pp,
vpp, zero, rank count) loads the entries its own chunks hold, and DCP reshards them. A
weight tied across pipeline stages is saved under each of its names.
    D/.tmp-step-00000012/       a write in progress, never loaded

A checkpoint is written into `.tmp-step-N`, verified complete by every rank
(barrier), then rank 0 hashes the files, writes the manifest (itself written
to a temporary name and renamed) and renames the directory into place: a
crash at any point leaves either the previous checkpoints or a `.tmp-` folder
that is ignored. On resume rank 0 walks the checkpoints newest first, checks
each one's files against its manifest (present, same size, same sha256) and
takes the first that passes, saying why any newer one was skipped; every rank
loads that one. Saves run with `dcp.async_save` on a process group of their own: the
write overlaps the next step, and the manifest and rename follow once it is done. DCP loads onto whatever the current plan shards (another
rank count, another ZeRO stage), which is what elastic resume relies on.

The data position is the step: every step's global batch is a function of
(seed, step) only, and each DP rank slices it, so resuming at step s on any
rank count sees the same tokens as the uninterrupted run.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from layout.plan import Plan
from executor.checkpoints.read import DataOnlyPlanner, DataOnlyReader, UnsafeCheckpoint, referenced_files
from executor.checkpoints.state import (chunk_states, from_plain, layout_words, load_chunks, merged, restore_rng,
                                       rng_states, to_plain)
from hardware.errors import PlanError

MANIFEST = "manifest.json"
FORMAT = 1
PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"


def step_dir(root: Path, step: int) -> Path:
    return root / f"{PREFIX}{step:08d}"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST and not p.name.endswith(".tmp"))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(folder: Path, info: dict) -> dict:
    """Hash every file of `folder` and write the manifest atomically (temp name, fsync, rename)."""
    files = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in _files(folder)}
    manifest = {"format": FORMAT, **info, "files": files}
    tmp = folder / (MANIFEST + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(manifest, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, folder / MANIFEST)
    _fsync_dir(folder)
    return manifest


def verify(folder: Path) -> tuple[dict | None, str]:
    """(manifest, "") when every file matches the manifest, else (None, why not)."""
    path = folder / MANIFEST
    if not path.exists():
        return None, "no manifest (incomplete write)"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        return None, f"unreadable manifest ({error})"
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict) or not manifest["files"]:
        return None, "manifest lists no files"
    for rel, meta in manifest["files"].items():
        p = folder / rel
        if not p.exists():
            return None, f"{rel} is missing"
        size = p.stat().st_size
        if size != meta["bytes"]:
            return None, f"{rel} has {size} bytes, manifest says {meta['bytes']} (truncated?)"
        if sha256(p) != meta["sha256"]:
            return None, f"{rel} checksum mismatch (corrupted)"
    unlisted = sorted(referenced_files(folder) - set(manifest["files"])) if ".metadata" in manifest["files"] else []
    if unlisted:
        return None, f"its metadata needs {unlisted[0]}, which the manifest does not list"
    return manifest, ""


def complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders, newest first (by step), unverified."""
    if not root.exists():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]), reverse=True)


def latest_valid(root: Path) -> tuple[Path | None, dict | None, list[str]]:
    """The newest checkpoint whose files match its manifest, and a message per skipped one."""
    messages = []
    for folder in complete_checkpoints(root):
        manifest, why = verify(folder)
        if manifest is not None:
            return folder, manifest, messages
        messages.append(f"checkpoint {folder.name} is invalid: {why}; trying the previous one")
    return None, None, messages


def read_latest_manifest(root: str | Path) -> dict | None:
    """For the launcher: the manifest of the checkpoint a resume would use (or None)."""
    _, manifest, _ = latest_valid(Path(root))
    return manifest


@dataclass
class Checkpointer:
    root: Path
    every: int
    plan: Plan
    seed: int = 0
    keep: int = 3
    model: str = ""  # the model's name and its unsplit parameters' shapes, checked before a resume
    parameters: dict[str, list[int]] = field(default_factory=dict)
    tied: list[tuple[str, ...]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    group: object = None  # the saves' own process group (async saves run beside training's collectives)
    pending: tuple | None = None  # (future, steps_done) of an async save not yet finalised

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if self.every < 0:
            raise PlanError("checkpoint_every", f"must be >= 0, got {self.every}")
        self.group = dist.new_group(backend="gloo")

    def _extra(self, run) -> dict:
        from executor.apply.compression import compression_states

        return to_plain({**rng_states(), "compression": [s.state_dict() for s in compression_states(run.modules)]})

    # ------------------------------------------------------------ save
    def due(self, steps_done: int, total: int) -> bool:
        return steps_done == total or (self.every > 0 and steps_done % self.every == 0)

    def _tmp(self, steps_done: int) -> Path:
        return self.root / f"{TMP_PREFIX}{steps_done:08d}"

    def save(self, run, steps_done: int, wait: bool = False) -> None:
        """Collective: every rank calls it after `steps_done` optimizer steps. The state is
        staged to host memory and written in the background (`dcp.async_save`); `finish`
        makes it a checkpoint. `wait`: finish before returning (the last step's save)."""
        self.finish()
        rank, tmp = dist.get_rank(), self._tmp(steps_done)
        if rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():  # left by a crash mid-write
                shutil.rmtree(tmp)
            (tmp / "extra").mkdir(parents=True)
        dist.barrier()
        extra = tmp / "extra" / f"rank{rank:05d}.pt"
        torch.save(self._extra(run), extra)
        with open(extra, "rb+") as fh:
            os.fsync(fh.fileno())
        state = merged(chunk_states(run, self.tied))
        future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=self.group)
        self.pending = (future, steps_done)
        if wait:
            self.finish()

    def finish(self) -> Path | None:
        """Collective: wait for the pending save, then rank 0 writes its manifest and renames it
        into place; a crash before this leaves only a `.tmp-` folder, never loaded."""
        if self.pending is None:
            return None
        future, steps_done = self.pending
        self.pending = None
        future.result()
        dist.barrier()  # every rank's shards and extras are on disk
        final, tmp = step_dir(self.root, steps_done), self._tmp(steps_done)
        if dist.get_rank() == 0:
            write_manifest(tmp, {
                "step": steps_done,
                "data_position": {"next_step": steps_done, "samples_consumed": steps_done * self.plan.global_batch,
                                  "seed": self.seed},
                "world_size": dist.get_world_size(),
                "model": self.model,
                "parameters": self.parameters,
                "plan": json.loads(self.plan.to_json()),
                "rng": "extra/rankNNNNN.pt: torch, python, numpy (and CUDA) RNG states and compression residuals per rank",
                "created_unix": time.time(),
            })
            if final.exists():  # re-reaching a step after resuming from an older checkpoint
                old = self.root / f".old-{final.name}"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            _fsync_dir(self.root)
            self._prune()
        dist.barrier()
        return final

    def _prune(self) -> None:
        for old in complete_checkpoints(self.root)[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------ resume
    def resume(self, run) -> int:
        """Load the newest valid checkpoint (rank 0 decides, everyone loads); return the next step (0: none)."""
        choice: list = [None, None, []]
        if dist.get_rank() == 0:
            folder, manifest, messages = latest_valid(self.root)
            choice = [str(folder) if folder else None, manifest, messages]
            for message in messages:
                print(f"parallax: {message}", file=sys.stderr, flush=True)
        dist.broadcast_object_list(choice, src=0)
        folder, manifest, messages = choice
        self.notes += messages
        if folder is None:
            return 0
        states = chunk_states(run, self.tied)
        loaded = merged(states)
        dcp.load(loaded, storage_reader=DataOnlyReader(folder), planner=DataOnlyPlanner(), process_group=self.group)
        load_chunks(run, states, loaded)
        resharded = _reshard_line(manifest.get("plan"), self.plan)
        same = manifest.get("world_size") == dist.get_world_size() and not resharded
        self._restore_extra(run, Path(folder), same)
        step = int(manifest["step"])
        saved_world = manifest.get("world_size")
        where = f"resumed from {Path(folder).name} (step {step}"
        self.notes.append(where + (f", written by {saved_world} ranks, resharded onto {dist.get_world_size()})"
                                   if saved_world != dist.get_world_size() else ")"))
        if resharded:
            self.notes.insert(0, resharded)
        return step

    def _restore_extra(self, run, folder: Path, same: bool) -> None:
        """RNG states and compression residuals: each rank's own when the layout is `same`, else rank 0's RNG."""
        from executor.apply.compression import compression_states

        rank = dist.get_rank()
        path = folder / "extra" / f"rank{(rank if same else 0):05d}.pt"
        if not path.exists():
            return
        try:
            extra = from_plain(torch.load(path, weights_only=True))
        except pickle.UnpicklingError:
            raise UnsafeCheckpoint("checkpoint", f"{path} holds code, not data", "do not resume from this folder") from None
        restore_rng(extra)
        states = compression_states(run.modules)
        if same:
            for state, saved in zip(states, extra.get("compression", [])):
                state.load_state_dict(saved)
        elif states and rank == 0:
            self.notes.append("compression residuals are per rank and were dropped on the new layout")


def _reshard_line(saved: dict | None, plan: Plan) -> str:
    """"resharded from dp2 pp2 interleaved v2 zero1 to dp2 tp2 zero3" when the layouts differ."""
    if not saved:
        return ""
    try:
        before = layout_words(Plan.model_validate(saved))
    except ValueError:
        return ""
    after = layout_words(plan)
    return f"resharded from {before} to {after}" if before != after else ""
