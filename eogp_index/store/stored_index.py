"""An index directory opened without its model: manifest, table, codec, hot copy, projection on demand.

Listing rows, reading metadata, indexing columns and reporting ``eogp info`` need no weights and
no torch. :class:`~eogp_index.client.AttributionIndex` adds the model (and the gradients it
takes to project a query) on top of one of these.

Example:
    >>> stored = StoredIndex.open("my-index")  # doctest: +SKIP
    >>> stored.info()["rows"]  # doctest: +SKIP
"""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any, Dict, Optional, Union

from eogp_index.errors import IncompatibleIndexError
from eogp_index.store.codecs import Codec, SignLayout, codec_for
from eogp_index.errors import ConfigError
from eogp_index.store.manifest import (
    MANIFEST_FILE,
    PROJECTION_FILE,
    TABLE_NAME,
    Manifest,
    ModuleEntry,
    check_compatible,
)
from eogp_index.store.table import Store

HOT_DIR = "hot"


def prepare_index_dir(path: Union[str, Path], *, table_uri: Optional[str] = None,
                      mode: str = "create") -> Path:
    """Make ``path`` ready for a new index: refuse an existing one (``mode="create"``) or remove
    it and its table (``mode="overwrite"``)."""
    path = Path(path)
    if mode not in ("create", "overwrite"):
        raise ConfigError(f"mode must be 'create' or 'overwrite', got {mode!r}")
    if (path / MANIFEST_FILE).exists():
        if mode != "overwrite":
            raise ConfigError(f"{path} already holds an index; pass mode='overwrite' (--overwrite) to replace it")
        shutil.rmtree(path)
    if table_uri is not None:
        remote = Store(table_uri, TABLE_NAME)
        if remote.table is not None:
            if mode != "overwrite":
                raise ConfigError(f"{table_uri} already holds a table {TABLE_NAME!r}; pass mode='overwrite' "
                                  "(--overwrite) to replace it or choose another --table-uri")
            remote.drop()
    path.mkdir(parents=True, exist_ok=True)
    return path


class StoredIndex:
    """The on-disk parts of an index.

    Attributes:
        path: the index directory. manifest: its parsed ``manifest.json``.
        store: the LanceDB table. codec: how its rows encode coordinates (one per precision).
    """

    def __init__(self, path: Union[str, Path], manifest: Manifest):
        self.path = Path(path)
        self.manifest = manifest
        self.layout = SignLayout(manifest.k)
        self.codec: Codec = codec_for(manifest.precision, self.layout)
        self.store = Store(manifest.store_uri(self.path), manifest.table)
        self._hot = None

    @classmethod
    def open(cls, path: Union[str, Path]) -> "StoredIndex":
        """Read and validate the manifest; loads no model and imports no torch."""
        return cls(path, Manifest.load(Path(path)))

    @classmethod
    def create(cls, path: Union[str, Path], fitted, *, model_name: str, tokenizer_name: Optional[str],
               precision: str, damping_ratio: float, curvature: Dict[str, Any], max_tokens: Optional[int],
               table_uri: Optional[str] = None) -> "StoredIndex":
        """Write a fitted projection and its manifest into ``path`` (prepared by :func:`prepare_index_dir`).

        Args:
            fitted: a :class:`~eogp_index.fit.fitting.FittedProjection`.
            model_name: what :meth:`AttributionIndex.open` reloads the model from; a local
                directory is recorded absolute, so the index opens from any working directory.
            curvature: the curvature settings recorded in the manifest.
        """
        from eogp_index.version import __version__

        path = Path(path)
        projection = fitted.projection
        proj_hash = projection.save(path / PROJECTION_FILE)
        layout = SignLayout(projection.k)
        manifest = Manifest(
            model={"name": str(Path(model_name).resolve()) if Path(model_name).is_dir() else model_name,
                   "weights_sha256": fitted.weights_sha256, "num_parameters": fitted.num_parameters,
                   "tokenizer": tokenizer_name},
            projection={"file": PROJECTION_FILE, "sha256": proj_hash, "variant": projection.config.variant,
                        "seed": projection.config.seed, "num_fit_examples": fitted.pca_examples},
            modules=[ModuleEntry(name=n, d_out=p.shape[0], d_in=p.shape[1], m=p.m, k=p.k, damping=p.damping)
                     for n, p in projection.modules.items()],
            precision=precision,
            damping_ratio=damping_ratio,
            bytes_per_example=codec_for(precision, layout).bytes_per_example,  # type: ignore[arg-type]
            curvature=curvature,
            max_tokens=max_tokens,
            table=TABLE_NAME,
            table_uri=table_uri,
            created_by=f"eogp-index {__version__}",
        )
        manifest.save(path)
        stored = cls(path, manifest)
        stored.__dict__["projection"] = projection  # just written: no need to read it back
        return stored

    @functools.cached_property
    def projection(self):
        """The fitted projection (``fit.projection.Projection``), loaded and checked on first use."""
        from eogp_index.fit.projection import Projection, file_sha256

        path = self.path / self.manifest.projection["file"]
        projection = Projection.load(path)
        check_compatible(self.manifest, projection_hash=file_sha256(path), where=str(self.path))
        if projection.k != self.manifest.k or projection.names != self.manifest.module_names:
            raise IncompatibleIndexError(f"{path} does not match the modules of {self.path / MANIFEST_FILE}; "
                                         "the index was refitted partway. Rebuild it with `eogp fit --overwrite`.")
        return projection

    def hot_codes(self):
        """The in-memory copy of the stored codes (:class:`~eogp_index.store.hot.HotCodes`), refreshed
        when the table has a newer version."""
        from eogp_index.store.hot import load_hot

        if self._hot is None or self._hot.version != self.store.version:
            self._hot = load_hot(self.store, self.codec, self.path / HOT_DIR)
        return self._hot

    def info(self) -> Dict[str, Any]:
        """The manifest plus live facts: row count, table version, path."""
        data = self.manifest.to_json()
        data["rows"] = self.store.count()
        data["table_version"] = self.store.version
        data["path"] = str(self.path)
        return data

    def count(self, where: Optional[str] = None) -> int:
        return self.store.count(where)
