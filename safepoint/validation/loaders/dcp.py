"""torch.distributed.checkpoint (DCP) folders, read without a process group and without plain pickle.

DCP's `.metadata` is a pickle (protocol 4) that torch itself reads with plain `pickle.load`, and
torch's weights-only unpickler (torch 2.13) refuses protocol 4 (FRAME, SHORT_BINUNICODE, ...). So it is
decoded by our own reader of the opcode stream (safepoint.validation.loaders.dcp_metadata), which builds DCP's
metadata dataclasses from checked plain values and never imports, calls or hashes anything the file
names; each tensor's chunks must then tile it exactly (safepoint.validation.loaders.dcp_tiling). Tensor chunks
and non-tensor entries are read directly from the `.distcp` files at the offsets in the metadata and loaded with
`torch.load(weights_only=True)`; tensors are reassembled to their global shape one at a time.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch

from safepoint.core.errors import FormatError
from safepoint.core.format import safe_relpath
from safepoint.validation.loaders.base import (
    Limits,
    LoadedTensor,
    LoadError,
    OnProblem,
    Problem,
    TensorSource,
    iter_leaves,
    iter_tensors,
    one_line,
    raise_problem,
)
from safepoint.validation.loaders.dcp_metadata import clip, decode_metadata
from safepoint.validation.loaders.dcp_tiling import tiling_problem
from safepoint.validation.loaders.torchsave import ZIP_MAGIC, torch_load_safely

METADATA_NAME = ".metadata"
DCP_SUFFIX = ".distcp"


def read_metadata(path: str | os.PathLike, limits: Limits = Limits()) -> Any:
    """Read and check a DCP `.metadata` file safely. Raises LoadError (UNSAFE or MALFORMED)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    size = os.stat(path).st_size
    if size > limits.max_dcp_metadata_bytes:
        raise LoadError(Problem.MALFORMED, f"DCP .metadata is {size} bytes, over the "
                        f"{limits.max_dcp_metadata_bytes}-byte limit")
    with open(path, "rb") as f:
        data = f.read(size + 1)
    md = decode_metadata(data, limits)

    def bad(why: str) -> LoadError:
        return LoadError(Problem.MALFORMED, clip(f"DCP .metadata: {why}"))

    if not isinstance(md, Metadata):
        raise bad(f"not a DCP Metadata object ({type(md).__name__})")
    if not isinstance(md.state_dict_metadata, dict) or not isinstance(md.storage_data, dict):
        raise bad("state_dict_metadata and storage_data must be dicts (unsupported storage layout?)")
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(fqn, str):
            raise bad(f"key {fqn!r} is not a string")
        if isinstance(item, TensorStorageMetadata):
            _check_tensor_md(fqn, item, bad)
        elif not isinstance(item, BytesStorageMetadata):
            raise bad(f"{fqn}: unknown storage metadata {type(item).__name__}")
    for idx, info in md.storage_data.items():
        if not isinstance(idx, MetadataIndex) or not isinstance(info, _StorageInfo):
            raise bad("storage_data is not MetadataIndex -> _StorageInfo (unsupported storage layout)")
        if not (isinstance(info.offset, int) and isinstance(info.length, int) and info.offset >= 0
                and info.length >= 0):
            raise bad(f"{idx.fqn}: bad offset/length {info.offset!r}/{info.length!r}")
        try:
            safe_relpath(info.relative_path)
        except FormatError as e:
            raise LoadError(Problem.UNSAFE, clip(f"DCP .metadata: {idx.fqn}: {e}")) from None
        if info.transform_descriptors is not None and (
                not isinstance(info.transform_descriptors, (list, tuple))
                or not all(isinstance(d, str) for d in info.transform_descriptors)):
            raise bad(f"{idx.fqn}: bad transform_descriptors")
    return md


def _check_tensor_md(fqn: str, item: Any, bad: Any) -> None:
    dtype = getattr(item.properties, "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise bad(f"{fqn}: bad dtype {dtype!r}")
    if not isinstance(item.size, torch.Size) or any(d < 0 for d in item.size):
        raise bad(f"{fqn}: bad size {item.size!r}")
    if not isinstance(item.chunks, list):
        raise bad(f"{fqn}: chunks is not a list")
    problem = tiling_problem(tuple(item.size), [(tuple(c.offsets), tuple(c.sizes)) for c in item.chunks])
    if problem:
        raise bad(f"{fqn}: {problem}")


class _FileSlice(io.RawIOBase):
    """A read-only, seekable view of bytes [offset, offset+length) of an open file."""

    def __init__(self, f: IO[bytes], offset: int, length: int) -> None:
        self._f, self._start, self._len, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._len}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self._len - self._pos))
        if n == 0:
            return 0
        self._f.seek(self._start + self._pos)
        data = self._f.read(n)
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)


class DcpCheckpoint:
    """One DCP checkpoint folder (the folder that holds `.metadata`)."""

    def __init__(self, folder: str | os.PathLike, metadata: Any, limits: Limits = Limits()) -> None:
        self.folder = Path(folder)
        self.metadata = metadata
        self.limits = limits

    @classmethod
    def open(cls, folder: str | os.PathLike, limits: Limits = Limits()) -> DcpCheckpoint:
        folder = Path(folder)
        if folder.name == METADATA_NAME and folder.is_file():
            folder = folder.parent
        return cls(folder, read_metadata(folder / METADATA_NAME, limits), limits)

    @property
    def data_files(self) -> list[str]:
        """Relative paths (to the DCP folder) of every file the metadata references."""
        return sorted({info.relative_path for info in self.metadata.storage_data.values()})

    def file_problems(self) -> dict[str, LoadError]:
        """Referenced files that are missing, not regular files, or shorter than the metadata says."""
        ends: dict[str, int] = {}
        for info in self.metadata.storage_data.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
        problems: dict[str, LoadError] = {}
        for rel, end in sorted(ends.items()):
            p = self.folder / rel
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                problems[rel] = LoadError(Problem.MISSING, f"{rel}: referenced by DCP .metadata but missing", file=rel)
                continue
            except OSError as e:
                problems[rel] = LoadError(Problem.UNLOADABLE, f"{rel}: {one_line(e)}", file=rel)
                continue
            if not os.path.isfile(p) or os.path.islink(p):
                problems[rel] = LoadError(Problem.UNSAFE, f"{rel}: not a regular file", file=rel)
            elif st.st_size < end:
                problems[rel] = LoadError(Problem.MALFORMED, f"{rel}: truncated ({st.st_size} bytes, metadata "
                                          f"needs {end})", file=rel)
        return problems

    def _entries(self, on_problem: OnProblem) -> Iterator[tuple[str, Any, list[Any]]]:
        """(fqn, storage metadata, storage infos) per entry whose files are fine; problems go to on_problem."""
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

        bad_files = self.file_problems()
        for err in bad_files.values():
            on_problem(err)
        storage = self.metadata.storage_data
        for fqn in sorted(self.metadata.state_dict_metadata):
            item = self.metadata.state_dict_metadata[fqn]
            if isinstance(item, TensorStorageMetadata):
                idxs = [MetadataIndex(fqn, c.offsets) for c in item.chunks]
            else:
                idxs = [MetadataIndex(fqn)]
            infos = [storage.get(i) for i in idxs]
            if any(info is None for info in infos):
                on_problem(LoadError(Problem.MALFORMED, f"{fqn}: no storage entry in DCP .metadata", tensor=fqn))
                continue
            if any(info.relative_path in bad_files for info in infos):
                continue  # already reported once per file
            yield fqn, item, infos

    def iter_tensors(self, on_problem: OnProblem = raise_problem) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (fqn, full tensor) per tensor entry, and the tensors inside non-tensor entries.

        Problems with referenced files and with single entries go to on_problem; entries that need
        a bad file are skipped. Each tensor is reassembled to its global shape (memory: one tensor).
        """
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        handles: dict[str, IO[bytes]] = {}
        try:
            for fqn, item, infos in self._entries(on_problem):
                try:
                    if isinstance(item, TensorStorageMetadata):
                        yield fqn, self._read_tensor(fqn, item, infos, handles)
                    else:
                        obj = self._read_bytes(fqn, infos[0], handles)
                        yield from iter_tensors(obj, fqn, max_nesting=self.limits.max_nesting)
                except LoadError as e:
                    e.tensor = e.tensor or fqn
                    on_problem(e)
                except OSError as e:
                    on_problem(LoadError(Problem.UNLOADABLE, f"{fqn}: {one_line(e)}", tensor=fqn))
        finally:
            _close(handles)

    def iter_leaves(self, on_problem: OnProblem = raise_problem) -> Iterator[tuple[str, Any]]:
        """(fqn, DcpTensor or plain value) per leaf, without reassembling anything.

        A DcpTensor reads its chunks one at a time when its pieces are asked for (memory: one
        chunk, i.e. one rank's shard); non-tensor entries are read and unpickled safely here.
        """
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        handles: dict[str, IO[bytes]] = {}
        try:
            for fqn, item, infos in self._entries(on_problem):
                if isinstance(item, TensorStorageMetadata):
                    yield fqn, DcpTensor(self, fqn, item, infos, handles)
                    continue
                try:
                    obj = self._read_bytes(fqn, infos[0], handles)
                    leaves = list(iter_leaves(obj, fqn, max_nesting=self.limits.max_nesting))
                except LoadError as e:
                    e.tensor = e.tensor or fqn
                    e.file = e.file or infos[0].relative_path
                    on_problem(e)
                    continue
                except OSError as e:
                    on_problem(LoadError(Problem.UNLOADABLE, f"{fqn}: {one_line(e)}", tensor=fqn,
                                         file=infos[0].relative_path))
                    continue
                for name, leaf in leaves:
                    yield name, (LoadedTensor(leaf) if isinstance(leaf, torch.Tensor) else leaf)
        finally:
            _close(handles)

    def _chunk(self, fqn: str, item: Any, chunk: Any, info: Any, handles: dict[str, IO[bytes]]) -> torch.Tensor:
        """One saved chunk of a tensor entry, checked against the metadata."""
        part = self._load(fqn, info, self._stream(info, handles))
        if not isinstance(part, torch.Tensor):
            raise LoadError(Problem.MALFORMED, f"{fqn}: chunk holds {type(part).__name__}, not a tensor",
                            file=info.relative_path, tensor=fqn)
        dtype = item.properties.dtype
        if tuple(part.shape) != tuple(chunk.sizes) or part.dtype != dtype:
            raise LoadError(Problem.MALFORMED, f"{fqn}: chunk is {part.dtype} {list(part.shape)}, metadata says "
                            f"{dtype} {list(chunk.sizes)}", file=info.relative_path, tensor=fqn)
        return part

    def _stream(self, info: Any, handles: dict[str, IO[bytes]]) -> IO[bytes]:
        f = handles.get(info.relative_path)
        if f is None:
            f = handles[info.relative_path] = open(self.folder / info.relative_path, "rb")
        stream: IO[bytes] = io.BufferedReader(_FileSlice(f, info.offset, info.length))
        if info.transform_descriptors:
            from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

            try:
                for ext in ExtensionRegistry().from_descriptor_list(info.transform_descriptors):
                    if isinstance(ext, StreamTransformExtension):
                        stream = ext.transform_from(stream)
            except Exception as e:
                raise LoadError(Problem.UNLOADABLE, f"unsupported transform {info.transform_descriptors}: "
                                f"{one_line(e)}", file=info.relative_path) from None
            if not stream.seekable():
                stream = io.BytesIO(stream.read())
        return stream

    def _read_tensor(self, fqn: str, item: Any, infos: list[Any], handles: dict[str, IO[bytes]]) -> torch.Tensor:
        dtype, size = item.properties.dtype, tuple(item.size)
        nbytes = math.prod(size) * dtype.itemsize
        if self.limits.max_tensor_bytes is not None and nbytes > self.limits.max_tensor_bytes:
            raise LoadError(Problem.UNLOADABLE, f"{fqn}: {nbytes} bytes is over the max_tensor_bytes limit")
        out: torch.Tensor | None = None
        for chunk, info in zip(item.chunks, infos):
            part = self._chunk(fqn, item, chunk, info, handles)
            if len(item.chunks) == 1 and tuple(chunk.sizes) == size:
                return part
            if out is None:
                out = torch.empty(size, dtype=dtype)
            view = out
            for dim, (o, s) in enumerate(zip(chunk.offsets, chunk.sizes)):
                view = view.narrow(dim, o, s)
            view.copy_(part)
            del part
        return out if out is not None else torch.empty(size, dtype=dtype)

    def _read_bytes(self, fqn: str, info: Any, handles: dict[str, IO[bytes]]) -> Any:
        if info.length > self.limits.max_dcp_bytes_entry:
            raise LoadError(Problem.UNLOADABLE, f"{fqn}: non-tensor entry of {info.length} bytes is over the "
                            f"{self.limits.max_dcp_bytes_entry}-byte limit")
        data = self._stream(info, handles).read()
        if not data.startswith(ZIP_MAGIC):  # an io.BytesIO entry: DCP wrote the caller's bytes as they were
            raise LoadError(Problem.OPAQUE, f"{fqn}: not loaded: raw bytes (io.BytesIO entry)",
                            file=info.relative_path, tensor=fqn)
        return self._load(fqn, info, io.BytesIO(data))

    @staticmethod
    def _load(fqn: str, info: Any, stream: IO[bytes]) -> Any:
        try:
            return torch_load_safely(stream)
        except LoadError as e:
            raise LoadError(e.problem, f"{fqn} ({info.relative_path} at {info.offset}): {e.message}",
                            file=info.relative_path, tensor=fqn) from None


class DcpTensor(TensorSource):
    """A tensor entry of a DCP checkpoint, streamed chunk by chunk (never reassembled)."""

    def __init__(self, ckpt: DcpCheckpoint, fqn: str, item: Any, infos: list[Any],
                 handles: dict[str, IO[bytes]]) -> None:
        self.ckpt, self.fqn, self.item, self.infos, self._handles = ckpt, fqn, item, infos, handles
        self.dtype = item.properties.dtype
        self.shape = tuple(int(d) for d in item.size)

    def pieces(self, max_elems: int) -> Iterator[torch.Tensor]:
        for chunk, info in zip(self.item.chunks, self.infos):
            try:
                part = self.ckpt._chunk(self.fqn, self.item, chunk, info, self._handles)
            except OSError as e:
                raise LoadError(Problem.UNLOADABLE, f"{self.fqn}: {one_line(e)}", file=info.relative_path,
                                tensor=self.fqn) from None
            yield from LoadedTensor(part).pieces(max_elems)
            del part


def _close(handles: dict[str, IO[bytes]]) -> None:
    for h in handles.values():
        h.close()
    handles.clear()


def is_dcp_folder(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(path, METADATA_NAME))


def iter_dcp_tensors(
    folder: str | os.PathLike, limits: Limits = Limits(), on_problem: OnProblem = raise_problem,
) -> Iterator[tuple[str, torch.Tensor]]:
    yield from DcpCheckpoint.open(folder, limits).iter_tensors(on_problem)


__all__ = [
    "DCP_SUFFIX", "METADATA_NAME", "DcpCheckpoint", "DcpTensor", "is_dcp_folder", "iter_dcp_tensors", "read_metadata",
]
