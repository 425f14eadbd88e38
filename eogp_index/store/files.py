"""Files the index writes and checks: a streaming safetensors writer, its header reader, and the
hashes that identify a file (the full SHA-256 ``eogp verify`` checks, and the sampled fingerprint
checked on every open).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Sequence

import torch

from eogp_index.data.location import index_path, is_remote, open_random_access, upload
from eogp_index.errors import ConfigError


@dataclass(frozen=True)
class TensorEntry:
    """A tensor to write: its name, stored dtype and shape, and how to get it (called once, when its
    bytes are written; the result is cast to ``dtype`` block by block)."""

    name: str
    dtype: torch.dtype
    shape: tuple
    read: Callable[[], torch.Tensor]


_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
#: Bytes written per block: the most a conversion (e.g. float32 → FP16 P) holds at once.
_WRITE_BLOCK_BYTES = 16 << 20


def write_safetensors(path: Path, entries: Sequence[TensorEntry], metadata: Dict[str, str]) -> str:
    """Write a safetensors file one tensor at a time, in blocks; return its SHA-256.

    The header is known before any tensor is read (names, dtypes, shapes), so the file is written
    front to back: the 8-byte little-endian header length, the JSON header padded with spaces to a
    multiple of 8, then each tensor's bytes at its ``data_offsets``. Tensors are laid out by
    decreasing element size (stable), so every tensor starts aligned to its own element size, as
    ``safetensors.torch.save_file`` arranges. Each tensor is read only when its turn comes and is
    released after, so a writer never holds more than one tensor (plus a block). The file is
    written under a temporary name, flushed to disk and renamed into place.
    """
    if sys.byteorder != "little":  # pragma: no cover - safetensors is little endian; so are our targets
        raise ConfigError("writing safetensors needs a little-endian machine")
    order = sorted(entries, key=lambda e: -e.dtype.itemsize)
    header: Dict[str, object] = {"__metadata__": dict(metadata)}
    offset = 0
    for entry in order:
        size = math.prod(entry.shape) * entry.dtype.itemsize
        header[entry.name] = {
            "dtype": _SAFETENSORS_DTYPES[entry.dtype],
            "shape": list(entry.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    digest = hashlib.sha256()
    target = index_path(path)
    # An object is written by one upload of the finished file: a failure midway leaves no object.
    local = Path(tempfile.mkdtemp(prefix="eogp-upload-")) / target.name if is_remote(target) else Path(target)
    tmp = local.with_name(f".{local.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as handle:

            def put(data) -> None:
                handle.write(data)
                digest.update(data)

            put(struct.pack("<Q", len(raw)))
            put(raw)
            for entry in order:
                tensor = torch.as_tensor(entry.read())
                if tuple(tensor.shape) != tuple(entry.shape):
                    raise ConfigError(f"{entry.name}: shape {tuple(tensor.shape)}, expected {tuple(entry.shape)}")
                flat = tensor.detach().reshape(-1)
                step = max(1, _WRITE_BLOCK_BYTES // entry.dtype.itemsize)
                for start in range(0, flat.numel(), step):
                    block = flat[start : start + step].to("cpu", entry.dtype).contiguous()
                    # As raw bytes: numpy has no bfloat16, and the bytes are what the file holds.
                    put(memoryview(block.view(torch.uint8).numpy()))
                    del block
                # Dropping the last reference unmaps a memory-mapped source: its pages leave this
                # process's memory before the next tensor is read.
                del tensor, flat
            handle.flush()
            os.fsync(handle.fileno())
        if is_remote(target):
            upload(tmp, target)
        else:
            os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
        if is_remote(target):
            local.parent.rmdir()
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open_random_access(index_path(path)) as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


#: A file up to this size is fingerprinted whole (it reads in well under a second).
FINGERPRINT_WHOLE_FILE_BYTES = 64 << 20
#: Otherwise: the safetensors header, this many evenly spaced chunks, and each tensor's ends.
FINGERPRINT_CHUNKS = 1024
FINGERPRINT_CHUNK_BYTES = 4096
FINGERPRINT_TENSOR_END_BYTES = 256
FINGERPRINT_PREFIX = "sample1:"
#: Range reads in flight at once when fingerprinting an object (each sample is one request).
FINGERPRINT_REMOTE_READS = 32


def file_fingerprint(path: Path) -> str:
    """A cheap identity of a safetensors file, checked on every open instead of its full SHA-256.

    ``sample1:`` + SHA-256 over the file size and either the whole file (up to
    ``FINGERPRINT_WHOLE_FILE_BYTES``) or: the header (every tensor's name, dtype, shape and
    offsets, and the metadata), ``FINGERPRINT_CHUNKS`` chunks of ``FINGERPRINT_CHUNK_BYTES`` evenly
    spaced over the file, and the first and last ``FINGERPRINT_TENSOR_END_BYTES`` of every tensor
    — about 4 MiB read from a 481 GB file. A change of size, layout, metadata or a sampled byte is
    caught; a change confined to unsampled bytes is not (``eogp verify`` hashes every byte).
    """
    path = index_path(path)
    size = path.stat().st_size
    digest = hashlib.sha256(f"{size}|".encode())
    with open_random_access(path) as handle:
        if size <= FINGERPRINT_WHOLE_FILE_BYTES:
            for chunk in iter(lambda: handle.read(1 << 22), b""):
                digest.update(chunk)
            return FINGERPRINT_PREFIX + digest.hexdigest()
        raw = handle.read(8)
        header_len = min(struct.unpack("<Q", raw)[0], size - 8) if len(raw) == 8 else 0
        header = handle.read(header_len)
        digest.update(raw + header)
        reads = [
            (round(i * (size - FINGERPRINT_CHUNK_BYTES) / (FINGERPRINT_CHUNKS - 1)), FINGERPRINT_CHUNK_BYTES)
            for i in range(FINGERPRINT_CHUNKS)
        ]
        try:
            entries = json.loads(header)
        except ValueError:
            entries = {}  # not a safetensors header: the evenly spaced chunks still cover the file
        data_start = 8 + header_len
        for key, entry in sorted(entries.items()):
            if key == "__metadata__" or not isinstance(entry, dict) or "data_offsets" not in entry:
                continue
            begin, end = (data_start + int(x) for x in entry["data_offsets"])
            n = min(FINGERPRINT_TENSOR_END_BYTES, end - begin)
            reads += [(begin, n), (end - n, n)]
        if is_remote(path):  # a range request each: many at once, hashed in file order
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(max_workers=FINGERPRINT_REMOTE_READS) as pool:
                for data in pool.map(lambda read: handle.read_at(read[1], read[0]), sorted(reads)):
                    digest.update(data)
            return FINGERPRINT_PREFIX + digest.hexdigest()
        for offset, n in sorted(reads):  # in file order: one forward sweep
            handle.seek(offset)
            digest.update(handle.read(n))
    return FINGERPRINT_PREFIX + digest.hexdigest()


def safetensors_header(path: Path) -> Dict[str, Any]:
    """The JSON header of a safetensors file: each tensor's ``dtype``, ``shape`` and ``data_offsets``,
    and the ``__metadata__`` strings. Reads only the header, however large the file."""
    with open_random_access(index_path(path)) as handle:
        length = int.from_bytes(handle.read(8), "little")
        return json.loads(handle.read(length))


def tensor_bytes(entry: Dict[str, Any]) -> int:
    """Bytes of one tensor of a :func:`safetensors_header`, at its stored dtype."""
    begin, end = entry["data_offsets"]
    return int(end) - int(begin)
