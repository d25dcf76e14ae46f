"""Checkpoints hold data, never code; one run per folder; a resume is checked before any rank starts."""
import json
import os
import pickle
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from executor.checkpoints.store import write_manifest
from executor.checkpoints.guard import FolderLock, check_owner, check_resume
from executor.checkpoints.read import UnsafeCheckpoint, read_metadata
from executor.checkpoints.state import from_plain, restore_rng, rng_states, to_plain
from hardware.errors import PlanError
from parallax_cli import main

sys.path.insert(0, str(Path(__file__).parent))
from test_executor import make_plan  # noqa: E402


class Payload:
    """What a probe plants: unpickling it runs a shell command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_dcp_metadata_that_names_code_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UnsafeCheckpoint, match="posix.system|os.system"):
        read_metadata(tmp_path)
    assert not marker.exists()


def test_a_dotted_name_through_an_allowed_module_is_refused(tmp_path):
    """DCP's metadata module imports os: `metadata.os.system` must not resolve through it."""
    marker = tmp_path / "pwned"
    payload = (b"\x80\x04\x95\x00\x00\x00\x00\x00\x00\x00\x00"  # protocol 4, a frame
               b"\x8c%torch.distributed.checkpoint.metadata\x94\x8c\tos.system\x94\x93\x94"
               + b"\x8c" + bytes([len(f"touch {marker}")]) + f"touch {marker}".encode() + b"\x94\x85\x94R\x94.")
    (tmp_path / ".metadata").write_bytes(payload)
    with pytest.raises(UnsafeCheckpoint, match="os.system"):
        read_metadata(tmp_path)
    assert not marker.exists()


class _ByName:
    """Pickles as getattr(owner, name): how Python 3.11.2 (Debian 12's) pickles an enum member."""

    def __init__(self, owner, name: str) -> None:
        self.owner, self.name = owner, name

    def __reduce__(self):
        return getattr, (self.owner, self.name)


def test_an_enum_member_pickled_by_name_reads_back_and_nothing_else_does(tmp_path):
    """DCP's metadata holds an enum (`_MEM_FORMAT_ENCODING`); on Python 3.11.2 every resume
    read `builtins.getattr` there and refused the run's own checkpoint. getattr is answered for
    members of enums the allow-list admits, and refused for anything else."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, TensorProperties

    member = _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    (tmp_path / ".metadata").write_bytes(pickle.dumps([_ByName(_MEM_FORMAT_ENCODING, member.name)]))
    assert read_metadata(tmp_path) == [member]
    for owner, name in [(_MEM_FORMAT_ENCODING, "__class__"), (TensorProperties, "__reduce__"), (torch.Size, "mro")]:
        (tmp_path / ".metadata").write_bytes(pickle.dumps(_ByName(owner, name)))
        with pytest.raises(UnsafeCheckpoint, match="not an enum member"):
            read_metadata(tmp_path)


def test_dcp_metadata_that_dcp_writes_reads_back(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(2, 3), "opt": {"step": 3, "betas": (0.9, 0.95), "name": "adamw"}},
             checkpoint_id=str(tmp_path), no_dist=True)
    metadata = read_metadata(tmp_path)
    assert metadata.state_dict_metadata["w"].size == torch.Size([2, 3])


def test_rng_and_numpy_state_round_trip_as_plain_data(tmp_path):
    random.seed(3)
    np.random.seed(4)
    torch.manual_seed(5)
    generator = np.random.RandomState(7)
    saved = to_plain({**rng_states(), "compression": [{"rng": generator, "residual": {"w": torch.ones(2)}}]})
    torch.save(saved, tmp_path / "extra.pt")
    expected = (random.random(), np.random.rand(), torch.rand(1).item(), generator.rand())
    loaded = from_plain(torch.load(tmp_path / "extra.pt", weights_only=True))  # data only
    restore_rng(loaded)
    again = (random.random(), np.random.rand(), torch.rand(1).item(), loaded["compression"][0]["rng"].rand())
    assert again == expected


def _checkpoint(root: Path, folder_step: int, **manifest) -> Path:
    folder = root / f"step-{folder_step:08d}"
    (folder / "extra").mkdir(parents=True)
    torch.save(to_plain(rng_states()), folder / "extra" / "rank00000.pt")
    info = {"step": folder_step, "model": "reference-tiny", "data_position": {"seed": 0},
            "parameters": {"w": [4, 4], "b": [4]}}
    info.update(manifest)
    write_manifest(folder, info)
    return folder


RUN = dict(model="reference-tiny", seed=0, steps=10, parameters={"w": [4, 4], "b": [4]})


@pytest.mark.parametrize("change, needle", [
    ({"step": 100}, "manifest says step 100"),
    ({"folder_step": 100}, "nothing to train"),
    ({"folder_step": 10}, "nothing to train"),
    ({"step": -3}, "manifest says step -3"),
    ({"step": "4"}, "manifest says step '4'"),
    ({"model": "gpt2"}, "model 'gpt2'"),
    ({"data_position": {"seed": 7}}, "pass --seed 7"),
    ({"parameters": {"w": [4, 4]}}, "another model"),
    ({"parameters": {"w": [4, 5], "b": [4]}}, "holds w as [4, 5]"),
])
def test_a_resume_that_differs_from_the_run_is_refused_by_name(tmp_path, change, needle):
    _checkpoint(tmp_path, **{"folder_step": 4, **change})
    with pytest.raises(PlanError) as info:
        check_resume(tmp_path, **RUN)
    assert needle in str(info.value)


def test_a_matching_resume_is_named_and_an_empty_folder_is_a_fresh_start(tmp_path):
    assert check_resume(tmp_path, **RUN) == ""
    _checkpoint(tmp_path, 4)
    assert check_resume(tmp_path, **RUN) == "step-00000004 (step 4)"


def test_rank_state_that_holds_code_is_refused_before_launch(tmp_path):
    marker = tmp_path / "pwned"
    folder = _checkpoint(tmp_path, 4)
    torch.save({"torch_rng": Payload(marker)}, folder / "extra" / "rank00000.pt")
    manifest = json.loads((folder / "manifest.json").read_text())
    write_manifest(folder, {k: v for k, v in manifest.items() if k not in ("format", "files")})  # sha256 rewritten
    with pytest.raises(UnsafeCheckpoint, match="holds code"):
        check_resume(tmp_path, **RUN)
    assert not marker.exists()


def test_one_run_per_checkpoint_folder(tmp_path):
    with FolderLock(tmp_path):
        with pytest.raises(PlanError, match=f"in use by parallax run \\(pid {os.getpid()}"):
            with FolderLock(tmp_path):
                pass
    with FolderLock(tmp_path):  # released with the first run
        pass


def test_a_folder_other_users_may_write_is_refused_unless_trusted(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(PlanError, match="writable by every user.*--trust-checkpoint-dir"):
        check_owner(folder, trusted=False)
    check_owner(folder, trusted=True)
    folder.chmod(0o775)
    with pytest.raises(PlanError, match="writable by its group"):
        check_owner(folder, trusted=False)
    folder.chmod(0o755)
    check_owner(folder, trusted=False)


def test_a_tampered_checkpoint_is_refused_in_one_line_before_any_rank_starts(tmp_path, capsys):
    """The probe's case end to end: a real checkpoint, its rank state replaced by a pickle that
    runs a command, the manifest's sha256 rewritten; the resume exits 2 and nothing runs."""
    plan_path, ckpt, marker = tmp_path / "plan.json", tmp_path / "ckpt", tmp_path / "pwned"
    plan_path.write_text(make_plan("reference-tiny", dp=2).to_json())
    assert main(["run", str(plan_path), "--steps", "2", "--checkpoint-dir", str(ckpt)]) == 0
    folder = ckpt / "step-00000002"
    torch.save({"torch_rng": Payload(marker)}, folder / "extra" / "rank00000.pt")
    manifest = json.loads((folder / "manifest.json").read_text())
    write_manifest(folder, {k: v for k, v in manifest.items() if k not in ("format", "files")})
    capsys.readouterr()
    code = main(["run", str(plan_path), "--steps", "4", "--checkpoint-dir", str(ckpt)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "holds code" in err, err
    assert not marker.exists()
    code = main(["run", str(plan_path), "--steps", "4", "--checkpoint-dir", str(ckpt), "--seed", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "written with seed 0, this run has 1" in err, err
