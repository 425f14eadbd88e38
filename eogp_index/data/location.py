"""Where an index lives: a local directory or an object-store URL, and one file layer for both.

An index is named by a path (``wiki-index``, ``file:///data/wiki-index``) or a URL
(``s3://bucket/wiki-index``, ``gs://``, ``az://``, ``abfs://``). :func:`index_path` turns either
into a path object: a :class:`pathlib.Path` for a local index (so that every local code path stays
as it was), a :class:`RemotePath` for an object store. A :class:`RemotePath` offers the subset of
``pathlib`` the index's own files use (``/``, ``exists``, ``read_bytes``, ``read_text``,
``iterdir``, ...) over a :mod:`pyarrow.fs` file system:

- pyarrow is already a dependency (the table, the hot copy and every Arrow file use it), and its
  S3, GCS and Azure file systems are native (C++), read ranges of a file without downloading it
  (``open_input_file(...).read_at``), and write an object in one ``PUT``. fsspec would add a
  package per cloud (s3fs, gcsfs, adlfs) for the same operations.
- The table does not go through this layer: Lance has its own object store (Rust's
  ``object_store``), and commits through it conditionally. :func:`lance_target` gives the URI and
  storage options Lance needs.

Credentials and the endpoint come from the usual environment variables: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` and
``AWS_ENDPOINT_URL`` (an ``http://`` endpoint, e.g. MinIO or moto, turns on Lance's
``allow_http``); ``GOOGLE_APPLICATION_CREDENTIALS`` for GCS; ``AZURE_STORAGE_ACCOUNT_NAME`` and
``AZURE_STORAGE_ACCOUNT_KEY`` for Azure (``AZURE_STORAGE_USE_EMULATOR=true`` and
``AZURITE_BLOB_STORAGE_URL`` for Azurite, which both layers then use). pyarrow's S3 file system does not read
``AWS_ENDPOINT_URL`` itself, so it is passed as ``endpoint_override``.

Atomicity: a local file is written under a temporary name, flushed and renamed into place; an
object is written by one ``PUT`` (a multipart upload is completed in one request), which an object
store applies whole or not at all, so a reader never sees half a file either way.

A remote index keeps what must be on a local disk (the memory-mapped hot copy, block ingest's
first-stage cache) under :func:`local_cache_dir`: ``$EOGP_CACHE_DIR/<hash of the URL>`` (default
``~/.cache/eogp-index/``); a local index keeps them inside its directory.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, Iterator, Optional, Tuple, Union

from eogp_index.errors import ConfigError, IncompatibleIndexError, IndexNotFoundError

#: URL schemes an index may live at: the ones both pyarrow.fs and Lance's object store read.
REMOTE_SCHEMES = ("s3", "gs", "az", "abfs", "abfss")
SCHEMES = REMOTE_SCHEMES + ("file",)
#: Azurite's blob endpoint, account and key when ``AZURE_STORAGE_USE_EMULATOR`` is set: the
#: defaults Lance's object store uses too (Azurite's documented development account).
AZURITE_DEFAULT_URL = "http://127.0.0.1:10000"
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
#: The environment variable that moves the local cache of remote indexes.
CACHE_ENV = "EOGP_CACHE_DIR"
DEFAULT_CACHE = Path("~/.cache/eogp-index")
#: "s3:", "s3:/x", "foo://x": a scheme (two letters or more, so that "C:/" stays a Windows drive)
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(//)?")

IndexPath = Union[Path, "RemotePath"]


def _refuse(value: str, why: str) -> ConfigError:
    return ConfigError(
        f"{value!r} is not an index location this eogp-index reads: {why}. Give a local directory, "
        f"file:///absolute/path, or a URL with a bucket: {', '.join(s + '://bucket/prefix' for s in REMOTE_SCHEMES)}"
    )


def index_path(value: Union[str, os.PathLike, "RemotePath"]) -> IndexPath:
    """``value`` as a path object: a :class:`~pathlib.Path` for a local directory (``file://`` URLs
    included), a :class:`RemotePath` for an object-store URL.

    Raises:
        ConfigError: a URL of a scheme no layer reads (``foo://x``), or a malformed one (``s3:/x``,
            ``s3://`` without a bucket, ``s3:``), naming it and the schemes accepted. Nothing is
            created.
    """
    if isinstance(value, (Path, RemotePath)):
        return value
    text = os.fspath(value)
    found = _SCHEME.match(text)
    if found is None:
        return Path(text)
    scheme = found.group(1).lower()
    if scheme not in SCHEMES:
        raise _refuse(text, f"no layer reads the scheme {scheme!r}://")
    if not found.group(2):
        raise _refuse(text, f"a {scheme} URL starts with {scheme}://")
    rest = text[found.end() :]
    if scheme == "file":
        host, _, local = rest.partition("/")
        if host not in ("", "localhost") or not local:
            raise _refuse(text, "a file URL is file:///absolute/path (no host)")
        return Path("/" + local)
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise _refuse(text, "the URL names no bucket")
    return RemotePath(scheme, bucket, key.strip("/"))


def is_remote(path) -> bool:
    return isinstance(path, RemotePath)


# -- file systems -------------------------------------------------------------------------------


def _aws_region(bucket: Optional[str] = None) -> Optional[str]:
    """The region from the environment; else, for a bucket on AWS itself (no endpoint set), the
    bucket's region as S3 reports it; else None."""
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region or bucket is None or os.environ.get("AWS_ENDPOINT_URL"):
        return region
    return _bucket_region(bucket)


@functools.lru_cache(maxsize=None)
def _bucket_region(bucket: str) -> Optional[str]:
    import pyarrow.fs as pafs

    try:
        return pafs.resolve_s3_region(bucket)
    except OSError:  # no network, or no such bucket: the request that follows says which
        return None


@functools.lru_cache(maxsize=None)
def _filesystem(scheme: str, account: Optional[str], env: Tuple[Tuple[str, str], ...]):
    """One pyarrow file system per scheme, account and environment (cached: S3 clients are costly)."""
    import pyarrow.fs as pafs

    settings = dict(env)
    if scheme == "s3":
        options = {"region": settings.get("region") or "us-east-1"}
        if settings.get("endpoint"):
            options["endpoint_override"] = settings["endpoint"]
        return pafs.S3FileSystem(**options)
    if scheme == "gs":
        return pafs.GcsFileSystem()
    return pafs.AzureFileSystem(**_azure_options(account, settings))


def _azure_options(account: Optional[str], settings: Dict[str, str]) -> Dict[str, str]:
    """pyarrow's AzureFileSystem settings from the environment Lance's object store reads: the
    account and key, or Azurite's (``AZURE_STORAGE_USE_EMULATOR``) at ``AZURITE_BLOB_STORAGE_URL``,
    with Azurite's own account and key unless others are set."""
    name = account or settings.get("account")
    options: Dict[str, str] = {}
    if settings.get("emulator"):
        scheme, _, authority = settings["emulator"].rstrip("/").partition("://")
        name = name or AZURITE_ACCOUNT
        options = {"blob_storage_authority": authority, "blob_storage_scheme": scheme}
        options.update(dfs_storage_authority=authority, dfs_storage_scheme=scheme)
        options["account_key"] = settings.get("key") or (AZURITE_KEY if name == AZURITE_ACCOUNT else "")
    elif settings.get("key"):
        options["account_key"] = settings["key"]
    if not name:
        raise ConfigError(
            "an az:// or abfs:// index needs the storage account: set AZURE_STORAGE_ACCOUNT_NAME "
            "(and AZURE_STORAGE_ACCOUNT_KEY, or sign in so that Azure's default credentials apply; "
            "AZURE_STORAGE_USE_EMULATOR=true for Azurite)"
        )
    return {"account_name": name, **{k: v for k, v in options.items() if v}}


def _truthy(value: Optional[str]) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def _env_key(scheme: str, bucket: str) -> Tuple[Tuple[str, str], ...]:
    """What of the environment the file system of ``scheme`` is built from (its cache key)."""
    if scheme == "s3":
        return (("endpoint", os.environ.get("AWS_ENDPOINT_URL", "")), ("region", _aws_region(bucket) or ""))
    if scheme == "gs":
        return ()
    emulator = ""
    if _truthy(os.environ.get("AZURE_STORAGE_USE_EMULATOR")):
        emulator = os.environ.get("AZURITE_BLOB_STORAGE_URL") or AZURITE_DEFAULT_URL
    return (
        ("account", os.environ.get("AZURE_STORAGE_ACCOUNT_NAME", "")),
        ("key", os.environ.get("AZURE_STORAGE_ACCOUNT_KEY", "")),
        ("emulator", emulator),
    )


@dataclass(frozen=True)
class RemotePath:
    """A file or folder in an object store: ``scheme://bucket/key``, read and written through
    :mod:`pyarrow.fs`. Behaves like the part of :class:`pathlib.Path` an index's files use.

    ``bucket`` is a container for Azure; ``abfs://container@account.dfs.core.windows.net/key``
    names the account too.
    """

    scheme: str
    bucket: str
    key: str = ""

    # -- naming ----------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}" if self.key else f"{self.scheme}://{self.bucket}"

    def __str__(self) -> str:
        return self.url

    def __truediv__(self, name: Union[str, os.PathLike]) -> "RemotePath":
        name = os.fspath(name).strip("/")
        return RemotePath(self.scheme, self.bucket, f"{self.key}/{name}" if self.key else name)

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def suffix(self) -> str:
        return Path(self.name).suffix

    @property
    def parent(self) -> "RemotePath":
        return RemotePath(self.scheme, self.bucket, self.key.rpartition("/")[0])

    def with_name(self, name: str) -> "RemotePath":
        return self.parent / name

    def resolve(self) -> "RemotePath":
        return self

    # -- the file system -------------------------------------------------------------------------
    @property
    def filesystem(self):
        """The :class:`pyarrow.fs.FileSystem` this path is read through."""
        container, _, host = self.bucket.partition("@")
        account = host.split(".", 1)[0] if host else None
        return _filesystem(self.scheme, account, _env_key(self.scheme, container))

    @property
    def fs_path(self) -> str:
        """The path inside :attr:`filesystem`: ``bucket/key`` (``container/key`` for Azure)."""
        container = self.bucket.partition("@")[0]
        return f"{container}/{self.key}" if self.key else container

    def _info(self):
        return self.filesystem.get_file_info(self.fs_path)

    def exists(self) -> bool:
        import pyarrow.fs as pafs

        return self._info().type != pafs.FileType.NotFound

    def is_file(self) -> bool:
        import pyarrow.fs as pafs

        return self._info().type == pafs.FileType.File

    def is_dir(self) -> bool:
        import pyarrow.fs as pafs

        return self._info().type == pafs.FileType.Directory

    def stat(self):
        """``st_size`` (and ``st_mtime_ns`` where the store gives one) of a file."""
        info = self._info()
        if info.size is None:
            raise FileNotFoundError(f"{self} does not exist")
        mtime = info.mtime_ns if info.mtime_ns is not None else 0
        return SimpleNamespace(st_size=info.size, st_mtime_ns=mtime, st_mtime=mtime / 1e9)

    def stamp(self) -> str:
        """``"<size>:<mtime_ns>"`` of a file: changes when the object is written again."""
        info = self._info()
        if info.size is None:
            raise FileNotFoundError(f"{self} does not exist")
        return f"{info.size}:{info.mtime_ns}"

    def iterdir(self) -> Iterator["RemotePath"]:
        import pyarrow.fs as pafs

        selector = pafs.FileSelector(self.fs_path, recursive=False, allow_not_found=True)
        for info in self.filesystem.get_file_info(selector):
            yield self / info.base_name

    def glob(self, pattern: str) -> Iterator["RemotePath"]:
        import fnmatch

        return (child for child in self.iterdir() if fnmatch.fnmatch(child.name, pattern))

    # -- reading and writing ---------------------------------------------------------------------
    def open_input(self):
        """A :class:`pyarrow.NativeFile` with random access: ``read_at(n, offset)`` is one range read."""
        try:
            return self.filesystem.open_input_file(self.fs_path)
        except FileNotFoundError as exc:
            raise IndexNotFoundError(f"{self} does not exist") from exc

    def read_bytes(self) -> bytes:
        try:
            with self.filesystem.open_input_stream(self.fs_path) as handle:
                return handle.read()
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{self} does not exist") from exc

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def write_bytes(self, data: bytes) -> int:
        """One ``PUT``: the object appears whole or not at all."""
        with self.filesystem.open_output_stream(self.fs_path) as handle:
            handle.write(data)
        return len(data)

    def write_text(self, text: str, encoding: str = "utf-8") -> int:
        return self.write_bytes(text.encode(encoding))

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing to do: an object store has no folders, only keys."""

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.filesystem.delete_file(self.fs_path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def rmtree(self) -> None:
        """Delete every object under this prefix."""
        if self.is_dir():
            self.filesystem.delete_dir(self.fs_path)


# -- helpers for both kinds ---------------------------------------------------------------------


def write_atomic(path: IndexPath, data: Union[bytes, str]) -> None:
    """Write a whole file so that a reader sees the old one or the new one, never half of it: a
    temporary file flushed and renamed into place on a local disk, one ``PUT`` on an object store."""
    raw = data.encode() if isinstance(data, str) else data
    if is_remote(path):
        path.write_bytes(raw)
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as handle:
            handle.write(raw)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def remove_tree(path: IndexPath) -> None:
    """Delete a folder and everything in it (a prefix's objects), if it exists."""
    if is_remote(path):
        path.rmtree()
    else:
        import shutil

        shutil.rmtree(path, ignore_errors=True)


def open_random_access(path: IndexPath):
    """A :class:`pyarrow.NativeFile` over ``path`` whose ``read_at`` reads only the bytes asked:
    memory-mapped locally, range reads (``GET`` with ``Range``) on an object store."""
    if is_remote(path):
        return path.open_input()
    import pyarrow as pa

    return pa.memory_map(str(path), "r")


def filesystem_of(path: IndexPath):
    """``(pyarrow.fs.FileSystem, path inside it)`` for ``path``, local or remote."""
    if is_remote(path):
        return path.filesystem, path.fs_path
    import pyarrow.fs as pafs

    return pafs.LocalFileSystem(), str(Path(path).absolute())


def storage_options(url: str) -> Optional[Dict[str, str]]:
    """Lance's ``storage_options`` for a table at ``url``: the endpoint and region from the
    environment (an ``http://`` endpoint allows plain HTTP; without a region, an AWS bucket's
    own); for Azurite, its account; None for a local table, and for the stores whose settings
    Lance reads from the environment itself (GCS, Azure)."""
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in ("az", "abfs", "abfss"):
        return _azure_emulator_options()
    if scheme != "s3":
        return None
    options: Dict[str, str] = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["aws_endpoint"] = endpoint
        if endpoint.startswith("http://"):
            options["allow_http"] = "true"
    region = _aws_region(url.split("://", 1)[1].split("/", 1)[0])
    if region:
        options["aws_region"] = region
    elif endpoint:  # an S3-compatible store: Lance needs a region to sign requests
        options["aws_region"] = "us-east-1"
    return options or None


def _azure_emulator_options() -> Optional[Dict[str, str]]:
    """For Azurite (``AZURE_STORAGE_USE_EMULATOR``): the account Lance names its store by, which
    it does not default to Azurite's own; None otherwise (Lance reads the Azure variables)."""
    if not _truthy(os.environ.get("AZURE_STORAGE_USE_EMULATOR")):
        return None
    return {"azure_storage_account_name": os.environ.get("AZURE_STORAGE_ACCOUNT_NAME") or AZURITE_ACCOUNT}


def lance_target(path: Union[str, IndexPath]) -> Tuple[str, Optional[Dict[str, str]]]:
    """The URI Lance opens for a table folder at ``path`` and its ``storage_options``."""
    if is_remote(path):
        return path.url, storage_options(path.url)
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        return text, storage_options(text)
    return str(Path(text.removeprefix("file://"))), None


def local_cache_dir(path: IndexPath) -> Path:
    """Where an index keeps what must be on a local disk (the hot copy, block ingest's cache): the
    index directory itself when local; ``$EOGP_CACHE_DIR/<16 hex of the URL's SHA-256>`` (default
    ``~/.cache/eogp-index/``) when remote, so that every index at a URL has its own."""
    if not is_remote(path):
        return Path(path)
    root = Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()
    return root / hashlib.sha256(path.url.rstrip("/").encode()).hexdigest()[:16]


def upload(local: Path, target: RemotePath) -> None:
    """Copy a finished local file to an object (one upload: the object appears whole or not at all)."""
    import pyarrow.fs as pafs

    pafs.copy_files(str(Path(local).absolute()), target.fs_path, pafs.LocalFileSystem(), target.filesystem)


#: safetensors' dtype names → torch dtypes (what :class:`RangeSafetensors` reads).
_TORCH_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}


class _Slice:
    def __init__(self, entry: Dict[str, Any]):
        self._entry = entry

    def get_dtype(self) -> str:
        return self._entry["dtype"]

    def get_shape(self) -> list:
        return list(self._entry["shape"])


class RangeSafetensors:
    """A safetensors file read by ranges through a :class:`pyarrow.NativeFile` (an object in an
    object store, :func:`~eogp_index.data.location.open_random_access`): the header once, then
    each tensor's own bytes when it is asked for, nothing else. Offers what the index reads of
    ``safetensors.safe_open``: ``metadata()``, ``keys()``, ``get_slice(key)`` (``get_dtype()``,
    ``get_shape()``) and ``get_tensor(key)``.
    """

    def __init__(self, handle, where: str):
        self._handle = handle
        self._where = where
        raw = handle.read_at(8, 0)
        length = struct.unpack("<Q", raw)[0] if len(raw) == 8 else 0
        try:
            header = json.loads(handle.read_at(length, 8)) if 0 < length < handle.size() else None
        except ValueError:
            header = None
        if not isinstance(header, dict):
            raise IncompatibleIndexError(f"{where} is not a safetensors file; refit the index")
        self._metadata = header.pop("__metadata__", None)
        self._entries = header
        self._data_start = 8 + length
        #: bytes read from the file for tensors so far
        self.bytes_read = 0

    def metadata(self) -> Dict[str, str]:
        return self._metadata

    def keys(self):
        return list(self._entries)

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self._entries[key])

    def get_tensor(self, key: str):
        """The tensor ``key`` (a ``torch.Tensor``), from one range read of its bytes."""
        import torch

        entry = self._entries[key]
        begin, end = (int(x) for x in entry["data_offsets"])
        data = self._handle.read_at(end - begin, self._data_start + begin)
        self.bytes_read += len(data)
        dtype = getattr(torch, _TORCH_DTYPES[entry["dtype"]])
        if end == begin:
            return torch.empty(entry["shape"], dtype=dtype)
        return torch.frombuffer(bytearray(data), dtype=dtype).reshape(entry["shape"])
