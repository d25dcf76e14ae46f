"""Running torchrun so that an interrupt stops all of it.

Why: torchrun starts each worker in a session of its own, so Ctrl-C in the terminal or a
SIGTERM from a scheduler reaches neither the workers nor, once `parallax run` has died,
anyone who would stop them; they are reparented to PID 1 and train on, writing and pruning
checkpoints. Here torchrun runs in its own session, the launcher turns SIGINT and SIGTERM
into an `Interrupted` exception, passes the signal to torchrun (whose agent stops its
workers), and after a grace period kills whatever of the tree is still alive.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from hardware.errors import Interrupted

GRACE_S = 20.0  # torchrun's agent gives its workers 30 s by default; checkpoints are atomic, so less is safe


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, read from /proc."""
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        tree.setdefault(int(fields[1]), []).append(int(entry.name))
    return tree


def descendants(pid: int) -> list[int]:
    """Every process below `pid`."""
    tree, found, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited; only its parent's wait is missing
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop(proc: subprocess.Popen, signum: int, grace_s: float = GRACE_S) -> None:
    """Pass `signum` to torchrun and its workers, wait up to `grace_s`, then kill what is left."""
    tree = [proc.pid, *descendants(proc.pid)]
    for pid in tree:
        try:
            os.kill(pid, signum)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (proc.poll() is None or any(_alive(p) for p in tree[1:])):
        time.sleep(0.1)
    for pid in [*tree, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def run_interruptible(cmd: list[str], env: dict, timeout_s: float | None) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)` in a session of its own; SIGINT and
    SIGTERM stop the whole tree and raise `Interrupted`, a timeout stops it and raises TimeoutExpired."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)

    def on_signal(signum, frame):  # noqa: ARG001 - signal's handler signature
        raise Interrupted(signum)

    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)} if main else {}
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except Interrupted as interrupted:
        for s in previous:  # a second Ctrl-C must not cut the stopping short
            signal.signal(s, signal.SIG_IGN)
        stop(proc, interrupted.signum)
        raise Interrupted(interrupted.signum, "torchrun and every worker stopped; complete checkpoints are kept, "
                                              "a save in progress is left as a .tmp- folder that is never loaded") from None
    except subprocess.TimeoutExpired:
        stop(proc, signal.SIGTERM)
        raise
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
