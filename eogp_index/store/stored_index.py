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
from pathlib import Path
from typing import Any, Dict, Optional, Union

from eogp_index.errors import IncompatibleIndexError
from eogp_index.store.codecs import Codec, SignLayout, codec_for
from eogp_index.store.manifest import MANIFEST_FILE, Manifest, check_compatible
from eogp_index.store.table import Store

HOT_DIR = "hot"


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
