"""What the launcher checks of a checkpoint folder before any rank starts.

Why before: a worker that meets a bad checkpoint fails inside torchrun, and the user reads
"torchrun exited 1 with no rank reporting an exception" or, worse, a run that trains
nothing and exits 0. Here, in one line each:
- who may write the folder: one writable by other users could swap the weights a resume
  loads, so it is refused unless the user trusts it (`--trust-checkpoint-dir`);
- who is using it: one run holds a lock on it (fcntl, released when the launcher exits),
  and a second run is refused naming the first;
- what a resume would load: its step within the run's target, the same model, seed and
  unsplit parameter names and shapes.
"""
from __future__ import annotations

import fcntl
import os
import socket
import stat
import time
from pathlib import Path

from hardware.errors import PlanError

LOCK_FILE = ".parallax-lock"
TRUST_FLAG = "--trust-checkpoint-dir"


def check_owner(root: Path, trusted: bool) -> None:
    """Refuse a folder another user owns or may write, unless the user trusts it."""
    if trusted or not root.exists():
        return
    info = root.stat()
    if info.st_uid != os.getuid():
        raise PlanError("checkpoint_dir", f"{root} belongs to another user (uid {info.st_uid}), who could replace "
                        "the weights a resume loads", f"use a folder of your own, or pass {TRUST_FLAG}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        who = "every user" if info.st_mode & stat.S_IWOTH else "its group"
        raise PlanError("checkpoint_dir", f"{root} is writable by {who}, who could replace the weights a resume loads",
                        f"chmod go-w {root}, or pass {TRUST_FLAG} if you trust them")


class FolderLock:
    """One run per checkpoint folder: an exclusive fcntl lock held for the launcher's life."""

    def __init__(self, root: Path) -> None:
        self.path = Path(root) / LOCK_FILE
        self.handle = None

    def __enter__(self) -> "FolderLock":
        # 0o755 whatever the umask adds: a group-writable folder would be refused on the next run
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        handle = open(self.path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = " ".join(handle.read().split()) or "another run"
            handle.close()
            raise PlanError("checkpoint_dir", f"{self.path.parent} is in use by {holder}",
                            "wait for that run to end, or use another --checkpoint-dir") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"parallax run (pid {os.getpid()} on {socket.gethostname()}, since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')})\n")
        handle.flush()
        self.handle = handle
        return self

    def __exit__(self, *exc) -> None:
        if self.handle is not None:
            fcntl.flock(self.handle, fcntl.LOCK_UN)
            self.handle.close()


def check_resume(root: Path, *, model: str, seed: int, steps: int, parameters: dict[str, list[int]]) -> str:
    """The checkpoint a resume would load, checked against this run; "" when there is none,
    else one line naming it. Raises PlanError naming what differs."""
    from executor.checkpoints.store import PREFIX, latest_valid

    folder, manifest, _ = latest_valid(Path(root))
    if folder is None:
        return ""
    step = manifest.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step != int(folder.name[len(PREFIX):]):
        raise PlanError("checkpoint", f"{folder.name}'s manifest says step {step!r}", "a manifest written by `parallax run`")
    _same(folder, "model", manifest.get("model"), model, "pass the model it was written for, or another --checkpoint-dir")
    saved_seed = (manifest.get("data_position") or {}).get("seed")
    _same(folder, "seed", saved_seed, seed, f"pass --seed {saved_seed} to continue it, or use another --checkpoint-dir")
    _same_parameters(folder, manifest.get("parameters"), parameters)
    _extras_are_data(folder)
    if not 0 <= step < steps:
        raise PlanError("--steps", f"{folder} is at step {step}, and this run stops at step {steps}: nothing to train",
                        f"pass --steps above {step} to train on, or use another --checkpoint-dir")
    return f"{folder.name} (step {step})"


def _extras_are_data(folder: Path) -> None:
    """Each rank's RNG and compression state loads as data (`weights_only`), or the resume is refused."""
    import pickle
    import warnings

    import torch

    from executor.checkpoints.read import UnsafeCheckpoint

    for path in sorted((folder / "extra").glob("*.pt")):
        try:
            with warnings.catch_warnings():  # a foreign pickle's protocol warning: the refusal below says it all
                warnings.simplefilter("ignore", UserWarning)
                torch.load(path, weights_only=True)
        except pickle.UnpicklingError:
            raise UnsafeCheckpoint("checkpoint", f"{path} holds code, not data",
                                   "do not resume from this folder") from None


def _same(folder: Path, what: str, saved, mine, hint: str) -> None:
    if saved is not None and saved != mine:
        raise PlanError("checkpoint", f"{folder.name} was written with {what} {saved!r}, this run has {mine!r}", hint)


def _same_parameters(folder: Path, saved, mine: dict[str, list[int]]) -> None:
    """The unsplit model's parameter names and shapes, as the manifest recorded them."""
    if not saved:
        return  # a manifest from before parameters were recorded: DCP still checks every shape on load
    if not isinstance(saved, dict):
        raise PlanError("checkpoint", f"{folder.name}'s manifest lists its parameters as {type(saved).__name__}")
    missing, extra = sorted(set(mine) - set(saved)), sorted(set(saved) - set(mine))
    if missing or extra:
        name = (missing or extra)[0]
        where = "the model has, the checkpoint lacks" if missing else "the checkpoint has, the model lacks"
        raise PlanError("checkpoint", f"{folder.name} is of another model: {len(missing) + len(extra)} parameter(s) "
                        f"differ, e.g. {name} ({where})", "resume the model it was written for, or use another folder")
    for name, shape in mine.items():
        if list(saved[name]) != list(shape):
            raise PlanError("checkpoint", f"{folder.name} holds {name} as {saved[name]}, the model's is {shape}",
                            "resume the model it was written for, or use another folder")
