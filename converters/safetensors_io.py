"""Streaming read and write of HF safetensors checkpoints.

`HFCheckpoint` validates every header up front (so a corrupt download fails before any work is
done, with the file and tensor named) and then hands out one tensor at a time from memory-mapped
files: converting a model never needs the whole model in RAM.

`ShardedWriter` writes `model-0000i-of-0000N.safetensors` + `model.safetensors.index.json`
(or a single `model.safetensors` when everything fits in one shard, as `save_pretrained` does),
flushing a shard as soon as it is full, into a temp directory that becomes the output directory
only on `commit()` (see output_dir.py).
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import CheckpointError, TensorMismatchError
from .output_dir import AtomicDir, atomic_output_dir, check_output_dir  # noqa: F401  (re-exported)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# safetensors dtype codes -> torch dtypes (the format's full list that torch can hold).
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
# Headers larger than this are not real safetensors headers (the format caps them at 100 MB).
_MAX_HEADER_BYTES = 100 * 1024 * 1024


class _Entry:
    __slots__ = ("file", "dtype", "shape")

    def __init__(self, file: Path, dtype: torch.dtype, shape: tuple[int, ...]):
        self.file, self.dtype, self.shape = file, dtype, shape


def read_safetensors_header(file: Path) -> dict[str, _Entry]:
    """Parse and validate one safetensors file's header; raise CheckpointError naming file/tensor."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{file}: truncated file ({size} bytes): no safetensors header")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(
                    f"{file}: corrupt or truncated header: it declares {header_len} header bytes "
                    f"but the file has {size} bytes"
                )
            raw = f.read(header_len)
    except OSError as e:
        raise CheckpointError(f"{file}: cannot read: {e}") from e
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{file}: corrupt safetensors header (not valid JSON): {e}") from e

    entries: dict[str, _Entry] = {}
    data_end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{file}: corrupt header entry for tensor '{name}': {info!r}") from e
        numel = 1
        for d in shape:
            numel *= d
        if end - begin != numel * dtype.itemsize or begin < 0:
            raise CheckpointError(
                f"{file}: corrupt header entry for tensor '{name}': offsets [{begin}, {end}) do not hold "
                f"{info['dtype']}{list(shape)} ({numel * dtype.itemsize} bytes)"
            )
        entries[name] = _Entry(file, dtype, shape)
        if end > data_end:
            data_end, last = end, name
    if data_end and 8 + header_len + data_end > size:
        raise CheckpointError(
            f"{file}: truncated file: it has {size} bytes but its header declares data up to byte "
            f"{8 + header_len + data_end} (tensor '{last}')"
        )
    return entries


class HFCheckpoint:
    """A HF checkpoint directory: config.json + model.safetensors or index + shards.

    All headers are read and cross-checked in the constructor; `get` reads one tensor, memory-mapped.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: HF checkpoint directory does not exist")
        config_file = self.path / "config.json"
        try:
            self.config: dict[str, Any] = json.loads(config_file.read_text())
        except FileNotFoundError as e:
            raise CheckpointError(f"{config_file}: missing (a HF checkpoint needs its config.json)") from e
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{config_file}: unreadable: {e}") from e
        self._entries = self._index() if (self.path / INDEX_FILE).exists() else self._single()
        self._handles: dict[Path, Any] = {}

    def _single(self) -> dict[str, _Entry]:
        file = self.path / SINGLE_FILE
        if not file.exists():
            found = sorted(p.name for p in self.path.glob("*.safetensors"))
            hint = f" (found {found[:3]} but no {INDEX_FILE})" if found else ""
            raise CheckpointError(f"{self.path}: neither {SINGLE_FILE} nor {INDEX_FILE} exists{hint}")
        return read_safetensors_header(file)

    def _index(self) -> dict[str, _Entry]:
        index_file = self.path / INDEX_FILE
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise ValueError("weight_map is not an object")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_file}: corrupt index: {e!r}") from e
        headers: dict[str, dict[str, _Entry]] = {}
        entries: dict[str, _Entry] = {}
        for name, shard in weight_map.items():
            if shard not in headers:
                shard_file = self.path / shard
                if not shard_file.is_file():
                    raise CheckpointError(
                        f"{index_file}: shard file {shard_file} (holding tensor '{name}') does not exist"
                    )
                headers[shard] = read_safetensors_header(shard_file)
            if name not in headers[shard]:
                raise CheckpointError(
                    f"{self.path / shard}: tensor '{name}' is listed in {INDEX_FILE} but absent from this shard"
                )
            entries[name] = headers[shard][name]
        return entries

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, name: str) -> _Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: no tensor named '{name}' in this checkpoint") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return self._entry(name).dtype

    def file(self, name: str) -> Path:
        return self._entry(name).file

    def get(self, name: str) -> torch.Tensor:
        """One tensor, read from the memory-mapped shard (the file handle is kept open and reused)."""
        file = self._entry(name).file
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return handle.get_tensor(name)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) one at a time, in file order so reads stay sequential."""
        for name in sorted(self._entries, key=lambda n: str(self._entries[n].file)):
            yield name, self.get(name)

    def total_bytes(self) -> int:
        return sum(e.dtype.itemsize * _numel(e.shape) for e in self._entries.values())


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_tensor(
    name: str, tensor: torch.Tensor, expected_shape: Sequence[int] | None, expected_dtype: torch.dtype | None
) -> None:
    """Raise TensorMismatchError naming `name` if the shape or dtype is not the expected one."""
    if expected_shape is not None and tuple(tensor.shape) != tuple(expected_shape):
        raise TensorMismatchError(
            f"tensor '{name}': shape {list(tensor.shape)} does not match the expected {list(expected_shape)}"
        )
    if expected_dtype is not None and tensor.dtype != expected_dtype:
        raise TensorMismatchError(f"tensor '{name}': dtype {tensor.dtype} does not match the expected {expected_dtype}")


class ShardedWriter:
    """Stream tensors into size-capped safetensors shards, published atomically on commit().

    Other files (config.json, tokenizer) go into `writer.path` (the temp directory) before commit.
    Use as a context manager to commit on success and abort on any exception.
    """

    def __init__(self, out_dir: str | os.PathLike, max_shard_bytes: int = 5 * 1024**3, overwrite: bool = False):
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.max_shard_bytes = max_shard_bytes
        self._staging = AtomicDir(out_dir, overwrite)
        self.out_dir = self._staging.out
        self.path = self._staging.path
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []  # (temp file name, tensor names)
        self._seen: set[str] = set()
        self.total_size = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._seen:
            raise ValueError(f"tensor '{name}' was already written to {self.out_dir}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"tensor '{name}': expected a torch.Tensor, got {type(tensor).__name__}")
        tensor = tensor.detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        # A tensor larger than the cap gets a shard of its own (as save_pretrained does).
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._seen.add(name)
        self._pending[name] = tensor
        self._pending_bytes += nbytes
        self.total_size += nbytes

    def _flush(self) -> None:
        if not self._pending:
            return
        file = f"shard-{len(self._shards) + 1:05d}.safetensors.partial"
        save_file(self._pending, str(self.path / file), metadata={"format": "pt"})
        self._shards.append((file, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def commit(self) -> Path:
        """Write the last shard, name the shards, write the index, and publish the directory (once: a second
        call, e.g. from __exit__ after an explicit commit, returns the published path)."""
        if getattr(self, "_published", None) is not None:
            return self._published
        self._flush()
        if not self._shards:
            self.abort()
            raise ValueError(f"{self.out_dir}: no tensors were written")
        n = len(self._shards)
        weight_map: dict[str, str] = {}
        # safetensors creates files as 0600; give shards the same permissions as any other file we write
        umask = os.umask(0)
        os.umask(umask)
        for i, (tmp_name, names) in enumerate(self._shards, start=1):
            final = SINGLE_FILE if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
            os.rename(self.path / tmp_name, self.path / final)
            os.chmod(self.path / final, 0o666 & ~umask)
            weight_map.update((name, final) for name in names)
        if n > 1:
            index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(weight_map.items()))}
            (self.path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        self._published = self._staging.commit()
        return self._published

    def abort(self) -> None:
        self._pending = {}
        self._staging.abort()

    def __enter__(self) -> "ShardedWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()
