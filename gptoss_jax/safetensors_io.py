"""Streaming safetensors reading and writing, one tensor at a time.

Reading memory-maps the file, so a tensor costs only its own bytes and a device shard only its
slice; bf16 comes back as `ml_dtypes.bfloat16`. Writing streams tensors to disk as they are made,
so a 120b-sized random checkpoint never sits in host memory whole.
"""

import json
import struct as pystruct
from pathlib import Path
from typing import Iterator

import ml_dtypes
import numpy as np

DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsError(ValueError):
    """A safetensors file is unreadable or inconsistent."""


class Reader:
    """Header of one file plus memory-mapped access to its tensors."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.exists():
            raise SafetensorsError(f"{self.path}: file not found")
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{self.path}: too short to be a safetensors file")
            (n,) = pystruct.unpack("<Q", head)
            try:
                self.header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise SafetensorsError(f"{self.path}: corrupt header ({e})") from None
        self.metadata = self.header.pop("__metadata__", {}) or {}
        self._data_start = 8 + n
        self._mmap = None

    def names(self) -> list[str]:
        """Tensor names in file order, so reads walk the file front to back."""
        return sorted(self.header, key=lambda k: self.header[k]["data_offsets"][0])

    def dtype_name(self, name: str) -> str:
        return self.header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        """The tensor as a read-only memory-mapped array (no copy until used)."""
        info = self.header[name]
        if info["dtype"] not in DTYPES:
            raise SafetensorsError(f"{self.path}: tensor '{name}' has unsupported dtype {info['dtype']}")
        dtype = DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        count = int(np.prod(info["shape"], dtype=np.int64))
        if end - begin != count * dtype.itemsize:
            raise SafetensorsError(
                f"{self.path}: tensor '{name}' has {end - begin} bytes, expected "
                f"{count * dtype.itemsize} for shape {info['shape']} {info['dtype']}"
            )
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        if self._data_start + end > self._mmap.size:
            raise SafetensorsError(f"{self.path}: truncated file (tensor '{name}' ends past the end)")
        raw = self._mmap[self._data_start + begin : self._data_start + end]
        return raw.view(dtype).reshape(info["shape"])


def write(
    path: str | Path, tensors: Iterator[tuple[str, np.ndarray]] | list, specs: dict, metadata: dict | None = None
) -> None:
    """Write tensors to `path`. `specs[name] = (shape, dtype)` fixes the header up front, then
    `tensors` yields `(name, array)` in the same order, each written and dropped in turn."""
    offsets, header, pos = {}, {}, 0
    for name, (shape, dtype) in specs.items():
        size = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": _NAMES[np.dtype(dtype)], "shape": list(shape), "data_offsets": [pos, pos + size]}
        offsets[name] = pos
        pos += size
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(pystruct.pack("<Q", len(blob)))
        f.write(blob)
        for name, array in tensors:
            shape, dtype = specs[name]
            if tuple(array.shape) != tuple(shape) or array.dtype != np.dtype(dtype):
                raise SafetensorsError(
                    f"{path}: tensor '{name}' is {array.shape} {array.dtype}, "
                    f"header says {tuple(shape)} {np.dtype(dtype)}"
                )
            if f.tell() != len(blob) + 8 + offsets[name]:
                raise SafetensorsError(f"{path}: tensor '{name}' written out of order")
            f.write(np.ascontiguousarray(array).tobytes())
