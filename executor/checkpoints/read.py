"""A checkpoint read as data, never as code.

torch.distributed.checkpoint keeps its `.metadata` as a pickle and reads it with
`pickle.load`; its default planner reads non-tensor entries (an optimizer's step, its
param groups) with `torch.load(weights_only=False)`. Either would run whatever a
`__reduce__` in a swapped file asks, as the user, on every node that resumes. Here the
metadata is unpickled with an allow-list of the classes DCP itself writes (its metadata
records, torch.Size, dtypes, layouts, memory formats, paths), and byte entries load with
`weights_only=True`. A file that names anything else is refused in one line.
"""
from __future__ import annotations

import enum
import io
import pickle
from pathlib import Path, PurePath

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element  # DCP's own helper, as its planner uses it
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

from hardware.errors import PlanError

_DCP_CLASSES = {  # by name, never by module: a module's own imports (`os`) and dotted names stay out
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
}
_LAYOUT_FROM_NAME = ("torch.serialization", "_get_layout")  # how torch pickles a torch.layout: by its name


class UnsafeCheckpoint(PlanError):
    """A checkpoint file that would run code when read."""


def _enum_member(cls, name):
    """What `builtins.getattr` may do in a checkpoint: some Pythons (3.11.2, Debian 12's) pickle an
    enum member as getattr(its class, its name), DCP's `_MEM_FORMAT_ENCODING` among them. Only a
    member of an enum the allow-list let in is returned."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise UnsafeCheckpoint("checkpoint", f"its metadata asks for attribute {name!r} of {cls!r}, which is not an enum "
                           "member", "a checkpoint written by `parallax run`; do not resume from this folder")


class _DataOnly(pickle.Unpickler):
    """Unpickles DCP's metadata records and plain torch values; refuses every other global."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        found = super().find_class(module, name) if self._allowed(module, name) else None
        if found is None:
            raise UnsafeCheckpoint("checkpoint", f"its metadata names {module}.{name}, which is code, not checkpoint "
                                   "data", "a checkpoint written by `parallax run`; do not resume from this folder")
        return found

    @staticmethod
    def _allowed(module: str, name: str) -> bool:
        if "." in name:  # pickle resolves dotted names attribute by attribute ("os.system" through a module)
            return False
        if name in _DCP_CLASSES.get(module, ()) or (module, name) == _LAYOUT_FROM_NAME:
            return True
        if module == "torch":
            value = getattr(torch, name, None)
            return value is torch.Size or isinstance(value, (torch.dtype, torch.layout, torch.memory_format))
        if module == "pathlib":
            value = getattr(__import__("pathlib"), name, None)
            return isinstance(value, type) and issubclass(value, PurePath)
        return module == "collections" and name == "OrderedDict"


def read_metadata(folder: Path):
    """DCP's metadata of `folder`, through the allow-list."""
    with open(Path(folder) / ".metadata", "rb") as handle:
        try:
            return _DataOnly(handle).load()
        except UnsafeCheckpoint:
            raise
        except Exception as error:  # noqa: BLE001 - a damaged file: one line
            raise PlanError("checkpoint", f"{folder}/.metadata cannot be read ({type(error).__name__})",
                            "resume from another checkpoint or start afresh") from None


class DataOnlyReader(FileSystemReader):
    """FileSystemReader whose metadata goes through the allow-list (`read_metadata`)."""

    def read_metadata(self, *args, **kwargs):
        if kwargs.get("rank") is not None:  # per-rank metadata files: Parallax does not write them
            raise PlanError("checkpoint", "per-rank DCP metadata is not read", "a checkpoint written by `parallax run`")
        metadata = read_metadata(Path(self.path))
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class DataOnlyPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor entries load with `weights_only=True`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError:
            raise UnsafeCheckpoint("checkpoint", f"its entry {read_item.dest_index.fqn} holds code, not data",
                                   "do not resume from this folder") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def referenced_files(folder: Path) -> set[str]:
    """The shard files DCP's metadata says the checkpoint's entries live in."""
    storage = getattr(read_metadata(folder), "storage_data", None) or {}
    return {str(info.relative_path) for info in storage.values()}
